"""Context-parallel timing: relgen.distributed's ring over 1 … P GPUs (NCCL), per-GPU throughput and peak memory.

python benchmarks/context_parallel.py [--world-sizes 1,2,4,8] [--seq-lens 32k,64k,128k,256k]
    [--specs shaw,t5_decoder] [--shardings auto] [--heads 8] [--head-dim 64] [--dtype bf16] [--dropout 0.0]
    [--warmup 2] [--reps 5] [--rounds 3] [--out DIR]
python benchmarks/context_parallel.py --smoke [--out DIR]   # CPU, gloo, Triton's interpreter, tiny shapes

Each world size runs in a group of processes of its own (one GPU per rank, spawned; the rings of one, two, …
GPUs use GPUs 0, 1, …). Every rank holds its shard of q, k, v ([1, H, N/P, d], random) and the gathered call's
tables, as a model would. A reading is the median over --reps of the slowest rank's time, the ranks lined up
by a barrier before each call: the forward alone, and a step (forward and backward). On one GPU the plain call
on the whole sequence is timed beside the ring of one, in --rounds alternating rounds: the ratio (the median of
the rounds' ratios) is the ring's own overhead, for single calls and for forwards issued back to back (throughput,
where a call's host time overlaps the previous call's kernels). Peak memory is the
most any rank allocated during a step, its inputs included. Throughput per GPU credits the gathered call
4·B·H·N²·d FLOPs forward (half of it causal; twice that backward) and divides by P.

`--shardings auto` takes zigzag for causal specs on more than one GPU and contiguous otherwise. Writes into --out:
context_parallel.jsonl (one record per reading, appended as it is measured, to what an earlier run left there:
a group that fails or times out keeps what it measured), and from all of its records context_parallel.json and
context_parallel.md (dates, commits, device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 1 << 30


def spec_path(name: str) -> Path:
    return Path(name) if name.endswith(".yaml") else ROOT / "specs" / f"{name}.yaml"


def length(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def commit() -> str:
    """The tree measured: the commit, and '+dirty' when relgen or the template differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "relgen", "templates") else "")


# ------------------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------------------
class Clock:
    """The slowest rank's time of a call, in ms: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device, distributed: bool):
        self.device = device
        self.distributed = distributed

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median(self, call: Callable[[], object], warmup: int, reps: int) -> float:
        import torch.distributed as dist

        for _ in range(warmup):
            call()
        times = []
        for _ in range(reps):
            self.sync()
            if self.distributed:
                dist.barrier()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e3)
        slowest = torch.tensor(times, dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return statistics.median(slowest.tolist())


def _inputs(spec, n_local: int, n: int, args, device: torch.device, rank: int):
    """This rank's shard of q, k, v and dO, and the gathered call's tables (the same on every rank)."""
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)

    def rand(*shape, scale=1.0, generator=gen):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype).requires_grad_()

    shard = (1, args.heads, n_local, args.head_dim)
    q, k, v = rand(*shard), rand(*shard), rand(*shard)
    do = rand(*shard).detach()
    rows = spec.map.num_rows(n)
    table = (rows, args.head_dim) if spec.heads_share_tables else (args.heads, rows, args.head_dim)
    shared = torch.Generator(device="cpu").manual_seed(7)
    tables = {}
    if spec.has_query:
        tables["aq"] = rand(*table, scale=0.5, generator=shared)
    if spec.has_key:
        tables["ak"] = rand(*table, scale=0.5, generator=shared)
    if spec.has_bias:
        tables["bias"] = rand(*table[:-1], generator=shared)
    return q, k, v, do, tables


def _measure(call, q, k, v, do, tables, clock: Clock, args) -> dict[str, float]:
    """Forward and step times of `call` (the ring or the plain call) and the step's peak memory."""
    leaves = [q, k, v, *tables.values()]
    options = {"dropout_p": args.dropout, "dropout_seed": 1234} if args.dropout else {}

    def forward():
        with torch.no_grad():
            call(q, k, v, **tables, **options)

    def step():
        out = call(q, k, v, **tables, **options)
        torch.autograd.grad(out, leaves, do)

    fwd = clock.median(forward, args.warmup, args.reps)
    if clock.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(clock.device)
    step_ms = clock.median(step, args.warmup, args.reps)
    times = {"fwd_ms": fwd, "step_ms": step_ms, "bwd_ms": step_ms - fwd, "peak_gib": None}
    if clock.device.type == "cuda":
        peak = torch.tensor([torch.cuda.max_memory_allocated(clock.device) / GIB], device=clock.device)
        if clock.distributed:
            import torch.distributed as dist

            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        times["peak_gib"] = float(peak.item())
    return times


def _ring_of_one(ring, plain, q, k, v, do, tables, clock: Clock, args) -> dict[str, Any]:
    """The ring of one and the plain call measured in --rounds alternating rounds (ring first, then plain, in
    each): every time is the median over the rounds, and each ratio the median of the rounds' own ratios, so that a
    drift of the GPU's clocks during the run weighs on both calls alike."""
    rounds = [(_measure(ring, q, k, v, do, tables, clock, args), _measure(plain, q, k, v, do, tables, clock, args))
              for _ in range(args.rounds)]  # fmt: skip
    record: dict[str, Any] = {"rounds": args.rounds}
    for key in rounds[0][0]:
        for prefix, index in (("", 0), ("plain_", 1)):
            values = [r[index][key] for r in rounds if r[index][key] is not None]
            record[prefix + key] = statistics.median(values) if values else None
    for key in ("fwd", "step"):
        ratios = [r[0][f"{key}_ms"] / r[1][f"{key}_ms"] for r in rounds]
        record[f"ring_over_plain_{key}"] = statistics.median(ratios)
        record[f"ring_over_plain_{key}_rounds"] = ratios
    if clock.device.type == "cuda":  # throughput: calls back to back, as a model's layers issue them
        pairs = [(_back_to_back(ring, q, k, v, tables, clock), _back_to_back(plain, q, k, v, tables, clock))
                 for _ in range(args.rounds)]  # fmt: skip
        record["fwd_ms_back_to_back"] = statistics.median(a for a, _ in pairs)
        record["plain_fwd_ms_back_to_back"] = statistics.median(b for _, b in pairs)
        record["ring_over_plain_fwd_back_to_back"] = statistics.median(a / b for a, b in pairs)
    return record


def _back_to_back(call, q, k, v, tables, clock: Clock, calls: int = 50) -> float:
    """ms per forward over `calls` forwards issued back to back (no synchronisation between them)."""
    with torch.no_grad():
        call(q, k, v, **tables)
        clock.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call(q, k, v, **tables)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / calls


def _worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    if args.smoke:  # before triton is imported: the kernels run in Triton's interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    import relgen
    import relgen.distributed as rd

    device = torch.device("cpu") if args.smoke else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo" if args.smoke else "nccl", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=args.timeout_s),
    )  # fmt: skip
    clock = Clock(device, distributed=world > 1)
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "backend": dist.get_backend(),
    }
    for name in args.specs.split(","):
        spec = relgen.load_spec(spec_path(name))
        fn = relgen.compile_mechanism(spec)
        if args.shardings != "auto":
            shardings = args.shardings.split(",")
        else:  # zigzag balances a causal ring; a ring of one in one chunk runs the plain call's kernels
            shardings = ["zigzag" if spec.causal and world > 1 else "contiguous"]
        for n in (length(s) for s in args.seq_lens.split(",")):
            for sharding in shardings:
                if n % (world * (2 if sharding == "zigzag" else 1)):
                    continue
                q, k, v, do, tables = _inputs(spec, n // world, n, args, device, rank)
                record: dict[str, Any] = {
                    **env, "spec": name, "causal": spec.causal, "sharding": sharding, "world_size": world,
                    "seq_len": n, "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
                    "dropout_p": args.dropout,
                }  # fmt: skip
                cp_fn = rd.context_parallel(fn, sharding=sharding)
                if world == 1:  # the plain call beside the ring of one, in alternating rounds: the ring's own overhead
                    record.update(_ring_of_one(cp_fn, fn, q, k, v, do, tables, clock, args))
                else:
                    record.update(_measure(cp_fn, q, k, v, do, tables, clock, args))
                flops = 4 * args.heads * n * n * args.head_dim * (0.5 if spec.causal else 1.0)
                record["fwd_tflops_per_gpu"] = flops / record["fwd_ms"] * 1e-9 / world
                record["step_tflops_per_gpu"] = 3 * flops / record["step_ms"] * 1e-9 / world
                record["tokens_per_s_per_gpu"] = n / record["step_ms"] * 1e3 / world
                if rank == 0:
                    with open(args.out / "context_parallel.jsonl", "a") as f:
                        f.write(json.dumps(record) + "\n")
                    print(json.dumps(record), flush=True)
                del q, k, v, do, tables
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------------------
def report(records: list[dict[str, Any]]) -> str:
    def values(name: str) -> str:
        return ", ".join(sorted({str(r.get(name, "?")) for r in records})) or "?"

    dates = sorted(r["date"][:10] for r in records) or ["?"]
    lines = [
        "# Context parallelism (relgen.distributed)",
        "",
        f"{dates[0]} – {dates[-1]} · commit {values('commit')} · {values('device')} · torch {values('torch')} · "
        f"{values('backend')}; B = 1, H = {values('heads')}, d = {values('head_dim')}, {values('dtype')}, "
        f"dropout_p {values('dropout_p')}.",
        "",
        "Median over the reps of the slowest rank; per-GPU throughput credits 4·B·H·N²·d forward FLOPs (half when "
        "causal, three times that for a step) over P GPUs; peak: the most any rank allocated in a step, inputs "
        "included. ring/plain: the ring of one against the plain call on the same GPU.",
        "",
        "| spec | sharding | N | P | fwd ms | step ms | fwd TFLOP/s/GPU | step TFLOP/s/GPU | tokens/s/GPU | peak GiB "
        "| ring/plain fwd | ring/plain step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(record: dict[str, Any], name: str) -> str:
        return f"{record[name]:.3f}" if name in record else "–"

    def gib(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "–"

    for r in sorted(records, key=lambda r: (r["spec"], r["sharding"], r["seq_len"], r["world_size"])):
        lines.append(
            f"| {r['spec']} | {r['sharding']} | {r['seq_len']} | {r['world_size']} | {r['fwd_ms']:.2f} | "
            f"{r['step_ms']:.2f} | {r['fwd_tflops_per_gpu']:.1f} | {r['step_tflops_per_gpu']:.1f} | "
            f"{r['tokens_per_s_per_gpu']:.3g} | {gib(r['peak_gib'])} | {ratio(r, 'ring_over_plain_fwd')} | "
            f"{ratio(r, 'ring_over_plain_step')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default=None, help="default: 1, 2, 4, … up to the GPUs present")
    parser.add_argument("--seq-lens", default="32k,64k,128k,256k")
    parser.add_argument("--specs", default="shaw,t5_decoder")
    parser.add_argument("--shardings", default="auto", help="auto, or a list of contiguous, zigzag")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every call (one seed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of a ring of one and the plain call")
    parser.add_argument("--timeout-s", type=int, default=600, help="the process group's timeout")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/context_parallel")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, the interpreter, tiny shapes")
    args = parser.parse_args()
    if args.smoke:
        args.world_sizes = args.world_sizes or "1,2"
        args.seq_lens, args.specs, args.heads, args.head_dim, args.dtype = "32", "t5_decoder", 2, 16, "fp32"
        args.warmup, args.reps, args.rounds = 0, 1, 1
        args.out = args.out or Path(tempfile.mkdtemp(prefix="relgen_cp_smoke_"))
    else:
        if not torch.cuda.is_available():
            sys.exit("context_parallel.py: no CUDA GPU (use --smoke for the CPU check)")
        count = torch.cuda.device_count()
        args.world_sizes = args.world_sizes or ",".join(str(1 << i) for i in range(count.bit_length()))
        args.out = args.out or ROOT / "benchmarks" / "results" / "context_parallel"
    args.out.mkdir(parents=True, exist_ok=True)
    args.commit = commit()
    failed = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.start_processes(_worker, args=(world, f"{tmp}/store", args), nprocs=world, start_method="spawn")
            except Exception as error:  # a group that fails keeps what it wrote; the next group still runs
                failed.append(world)
                print(f"world size {world} failed: {error}", file=sys.stderr)
    jsonl = args.out / "context_parallel.jsonl"
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()] if jsonl.exists() else []
    (args.out / "context_parallel.json").write_text(json.dumps(records, indent=1) + "\n")
    (args.out / "context_parallel.md").write_text(report(records))
    print(f"{len(records)} records in {args.out}" + (f"; world sizes {failed} failed" if failed else ""))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
