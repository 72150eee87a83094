"""Long context: relgen's stored projections against in-tile relation products, and plain SDPA, on a GPU.

python benchmarks/long_context.py [--specs txl] [--seq-lens 8192,32768,65536,131072] [--relations projected,in_tile]
    [--batch 1] [--heads 12] [--head-dim 64] [--dtype fp16] [--causal] [--warmup 3] [--reps 10] [--json OUT.jsonl]
    [--tiles forward.num_warps=8 ...]
python benchmarks/long_context.py --plot DIR --json RECORDS.jsonl [--tree COMMIT]

For each spec, length N and relation strategy (the plan's `relations`: "projected" stores Z̃ between the passes,
"in_tile" forms the relation products, and their gradients, inside the tiles), and for plain SDPA at the same
shapes (torch.nn.functional.scaled_dot_product_attention, flash backend, no relation term), it measures with
torch.cuda.Event pairs, after `--warmup` calls, the median of `--reps`:

* fwd ms: the forward of a call whose inputs require grad (what a training step runs; the stored path keeps Z̃);
* bwd ms: the backward alone (autograd.grad of a kept forward);
* kept MiB: what the forward leaves allocated for the backward (its output included), above the inputs;
* peak MiB: the peak of forward + backward above the inputs (torch.cuda.max_memory_allocated);
* TFLOP/s: the paper's credited work (relgen.bench.common.credited_flops; causal calls credited half) over the time.

A case that runs out of memory is listed as OOM. Prints a Markdown table with the date, the commit and the GPU.
--tiles runs relgen's kernels with the tiles they would pick at each length, changed as given
(KernelConfig.with_changes); the records name the changes.

--plot draws the records of --json (those of --tree, when given; the last of each case) against N, as relgen
bench draws its own (relgen.bench.report.plot): DIR/long_context_throughput.png (credited TFLOP/s, forward and
backward) and DIR/long_context_memory.png (the peak of forward + backward above the inputs, in the backward's
panel), plain SDPA dashed as the ceiling.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import relgen
from relgen.bench.common import credited_flops
from relgen.check.verify import make_inputs
from relgen.tiles.select import changed_tiles

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MIB = 1 << 20


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "relgen", "templates") else "")


def median_ms(step: Callable[[], object], warmup: int, reps: int, before: Callable[[], object] | None = None) -> float:
    """Median time of `step` by CUDA events; `before` (untimed) runs ahead of each call."""
    for _ in range(warmup):
        if before:
            before()
        step()
    times = []
    for _ in range(reps):
        if before:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def module_of(spec: relgen.MechanismSpec, relations: str):
    """The mechanism's module for `relations`: its own (projected), or the variant the runtime builds."""
    mechanism = relgen.compile_mechanism(spec)
    if relations == "projected":
        return mechanism.module
    return mechanism._variant(mechanism.module, relations=relations)


def measure(name: str, n: int, system: str, args: argparse.Namespace) -> dict:
    dtype = DTYPES[args.dtype]
    data = relgen.load_spec(ROOT / "specs" / f"{name}.yaml").model_dump()
    if args.causal:
        data["causal"] = True
    spec = relgen.load_spec(data)
    record = {"spec": name, "seq_len": n, "system": system, "dtype": args.dtype, "causal": args.causal}
    if system != "sdpa" and args.tiles:
        record["tiles"] = args.tiles
        with changed_tiles(module_of(spec, system).PLAN, dtype, args.head_dim, n, args.tiles):
            return _measured(record, spec, n, system, args)
    return _measured(record, spec, n, system, args)


def _measured(record: dict, spec: relgen.MechanismSpec, n: int, system: str, args: argparse.Namespace) -> dict:
    dtype = DTYPES[args.dtype]
    made = make_inputs(
        spec, b=args.batch, h=args.heads, nq=n, d=args.head_dim, dtype=dtype, device="cuda", bias_dtype=dtype
    )
    leaves = [made.q, made.k, made.v, *made.tables.values()]
    if system == "sdpa":
        leaves = leaves[:3]

        def forward() -> torch.Tensor:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(made.q, made.k, made.v, is_causal=args.causal)
    else:
        attention = module_of(spec, system).attention
        tables = made.tables

        def forward() -> torch.Tensor:
            return attention(made.q, made.k, made.v, tables.get("aq"), tables.get("ak"), tables.get("bias"))

    do = torch.randn_like(made.q)
    kept: list[torch.Tensor] = []

    def keep_forward() -> None:
        kept.clear()
        kept.append(forward())

    def backward() -> None:
        torch.autograd.grad(kept.pop(), leaves, do)

    try:
        record["fwd_ms"] = median_ms(forward, args.warmup, args.reps)
        record["bwd_ms"] = median_ms(backward, args.warmup, args.reps, before=keep_forward)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = forward()
        torch.cuda.synchronize()
        record["kept_mib"] = (torch.cuda.memory_allocated() - base) / MIB
        torch.autograd.grad(out, leaves, do)
        torch.cuda.synchronize()
        record["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
        del out
    except torch.cuda.OutOfMemoryError:
        record["oom"] = True
    kept.clear()
    half = 0.5 if args.causal else 1.0
    for pass_, key in (("fwd", "fwd_ms"), ("bwd", "bwd_ms")):
        if key in record:
            flops = credited_flops(spec, n, args.batch, args.heads, args.head_dim, pass_) * half
            record[f"{pass_}_tflops"] = flops / (record[key] * 1e-3) / 1e12
    return record


#: long_context's systems as relgen.bench.report plots them (plain SDPA by the benchmark's own name for it)
PLOTTED = {"sdpa": "sdpa_plain", "projected": "relgen, stored projections", "in_tile": "relgen, in-tile products"}


def plot(records: list[dict], out: Path) -> list[Path]:
    """The records as relgen.bench.report.plot takes them; returns the files written (none without matplotlib)."""
    from relgen.bench.report import plot as draw

    last = {(r["spec"], r["seq_len"], r["system"]): r for r in records if not r.get("tiles")}
    points = []
    for r in last.values():
        for pass_ in ("fwd", "bwd"):
            point = {"mechanism": r["spec"], "pass": pass_, "system": PLOTTED[r["system"]], "seq_len": r["seq_len"]}
            point |= {"status": "oom" if r.get("oom") else "ok", "tflops": r.get(f"{pass_}_tflops")}
            point["peak_mib"] = r.get("peak_mib") if pass_ == "bwd" else None
            points.append(point)
    written = (draw(points, field, out / name) for field, name in (
        ("tflops", "long_context_throughput.png"), ("peak_mib", "long_context_memory.png")))  # fmt: skip
    return [path for path in written if path is not None]


def table(records: list[dict]) -> list[str]:
    lines = [
        "| spec | N | system | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | kept MiB | peak MiB | peak / SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    sdpa = {(r["spec"], r["seq_len"]): r for r in records if r["system"] == "sdpa" and "peak_mib" in r}
    for r in records:
        if r.get("oom") and "fwd_ms" not in r:
            lines.append(f"| {r['spec']} | {r['seq_len']} | {r['system']} | OOM | | | | | | |")
            continue
        ref = sdpa.get((r["spec"], r["seq_len"]))
        ratio = f"{r['peak_mib'] / ref['peak_mib']:.2f}" if ref and "peak_mib" in r else ""

        def cell(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if key in r else "OOM"

        lines.append(
            f"| {r['spec']} | {r['seq_len']} | {r['system']} | {cell('fwd_ms', '.3f')} | {cell('fwd_tflops', '.0f')} "
            f"| {cell('bwd_ms', '.3f')} | {cell('bwd_tflops', '.0f')} | {cell('kept_mib', '.0f')} "
            f"| {cell('peak_mib', '.0f')} | {ratio} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", default="txl")
    parser.add_argument("--seq-lens", default="8192,32768,65536,131072")
    parser.add_argument("--relations", default="projected,in_tile")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None, help="append one JSON record per case to this file")
    parser.add_argument(
        "--tiles", nargs="*", default=[], metavar="PART.FIELD=N", help="relgen tiles changed: forward.num_warps=8"
    )
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR", help="plot the --json records into DIR")
    parser.add_argument("--tree", default=None, help="with --plot: the records of this commit only")
    args = parser.parse_args()
    if args.plot is not None:
        if args.json is None:
            parser.error("--plot needs --json, the records to draw")
        records = [json.loads(line) for line in Path(args.json).read_text().splitlines() if line.strip()]
        records = [r for r in records if args.tree is None or r.get("tree") == args.tree]
        for path in plot(records, args.plot) or ["nothing drawn (no records, or no matplotlib)"]:
            print(path)
        return
    systems = ["sdpa", *args.relations.split(",")]
    records = []
    for name in args.specs.split(","):
        for n in (int(x) for x in args.seq_lens.split(",")):
            for system in systems:
                records.append(measure(name, n, system, args))
                torch.cuda.empty_cache()  # the case's inputs are gone with measure's frame
                print(json.dumps(records[-1]), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(records[-1]) + "\n")
    print(
        f"\n{datetime.date.today()} · {commit()} · {torch.cuda.get_device_name()} · {args.dtype} · B={args.batch} "
        f"H={args.heads} d={args.head_dim}{' · causal' if args.causal else ''}\n"
    )
    print("\n".join(table(records)))


if __name__ == "__main__":
    main()
