"""What the storage of the stored projections costs on a GPU: fp16 (the default, scaled on the device) against fp32.

python benchmarks/projection_dtype.py [--specs shaw,txl,deberta_v3,t5] [--seq-lens 1024,8192] [--dtypes fp16,bf16]
    [--storages fp16,fp32] [--warmup 10] [--reps 50] [--out RESULT.md] [--json RESULT.jsonl]

For each input dtype, spec, length N (B = 16K tokens / N, H = 12, d = 64, tables in the inputs' dtype) and storage
(relgen.config.set_projection_storage), it times the forward and a forward + backward step with torch.cuda.Event
pairs around each call after `--warmup` calls, and reads the peak memory a call allocates above its inputs
(torch.cuda.max_memory_allocated). The fp16 storage's times include the launches that bound each buffer and choose
its scale on the device (relgen.runtime.scales); nothing synchronises. Prints a Markdown table with the date, the commit
and the GPU; the last two columns divide each case's times by the fp32 storage's.
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

import relgen
from relgen import config
from relgen.check.verify import make_inputs

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MIB = 1 << 20


def spec_path(name: str) -> Path:
    return Path(name) if name.endswith(".yaml") else ROOT / "specs" / f"{name}.yaml"


def commit() -> str:
    """The tree measured: the commit, and '+dirty' when relgen or the template differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "relgen", "templates") else "")


def timed(step: Callable[[], object], warmup: int, reps: int) -> tuple[float, float]:
    """(median ms, peak MiB above what was allocated before) of `step`, timed by CUDA events per call."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in times)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / MIB


def measure(name: str, n: int, dtype: torch.dtype, storage: str, args: argparse.Namespace) -> dict:
    config.set_projection_storage(storage)
    spec = relgen.load_spec(spec_path(name))
    b = max(1, args.tokens // n)
    made = make_inputs(spec, b=b, h=args.heads, nq=n, d=args.head_dim, dtype=dtype, device="cuda", bias_dtype=dtype)
    fn = relgen.compile_mechanism(spec)
    leaves = [made.q, made.k, made.v, *made.tables.values()]
    do = torch.randn_like(made.q)

    def forward() -> torch.Tensor:
        return fn(made.q, made.k, made.v, **made.tables)

    def step() -> None:
        torch.autograd.grad(forward(), leaves, do)

    fwd_ms, fwd_mib = timed(forward, args.warmup, args.reps)
    step_ms, step_mib = timed(step, args.warmup, args.reps)
    return {
        "dtype": next(k for k, v in DTYPES.items() if v == dtype),
        "spec": name,
        "seq_len": n,
        "batch": b,
        "storage": storage,
        "fwd_ms": fwd_ms,
        "step_ms": step_ms,
        "fwd_peak_mib": fwd_mib,
        "step_peak_mib": step_mib,
    }


def table(records: list[dict]) -> list[str]:
    """One row per (dtype, spec, N, storage); the last columns compare with the fp32 storage of the same case."""
    lines = [
        "| dtype | spec | N | storage | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB | fwd / fp32 "
        "| step / fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    wide = {(r["dtype"], r["spec"], r["seq_len"]): r for r in records if r["storage"] == "fp32"}
    for r in records:
        ref = wide.get((r["dtype"], r["spec"], r["seq_len"]))
        ratios = [f"{r[key] / ref[key]:.3f}" if ref else "" for key in ("fwd_ms", "step_ms")]
        lines.append(
            f"| {r['dtype']} | {r['spec']} | {r['seq_len']} | {r['storage']} | {r['fwd_ms']:.3f} | "
            f"{r['step_ms']:.3f} | {r['fwd_peak_mib']:.1f} | {r['step_peak_mib']:.1f} | {ratios[0]} | {ratios[1]} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", default="shaw,txl,deberta_v3,t5")
    parser.add_argument("--seq-lens", default="1024,8192")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--storages", default=",".join(config.PROJECTION_STORAGES))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10, help="calls before timing (each case)")
    parser.add_argument("--reps", type=int, default=50, help="timed calls (each case)")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown report here")
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per case here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("projection_dtype.py: needs a CUDA GPU")

    records = []
    for dtype_name in args.dtypes.split(","):
        for name in args.specs.split(","):
            for n in (int(x) for x in args.seq_lens.split(",")):
                for storage in args.storages.split(","):
                    record = measure(name, n, DTYPES[dtype_name], storage, args)
                    print(json.dumps(record), flush=True)
                    records.append(record)
                    if args.json:
                        with args.json.open("a") as f:
                            f.write(json.dumps(record) + "\n")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        f"# Stored projections: fp32 against fp16 storage ({now}, commit {commit()})",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}; "
        f"{args.tokens} tokens (B = tokens / N), H = {args.heads}, d = {args.head_dim}; median of {args.reps} calls "
        f"after {args.warmup}; peak MiB above the inputs.",
        "",
    ]
    report = "\n".join(header + table(records)) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
