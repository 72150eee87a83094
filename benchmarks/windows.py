"""Local windows on a GPU: a spec with and without `window: {left, right}`, and plain SDPA (no relative terms, no
window) as the ceiling, as a Markdown table (or JSON) headed by the date, the commit and the GPU.

    python benchmarks/windows.py [--specs shaw,txl] [--seq-lens 8192,32768] [--left 256] [--right 0] [--json]
                                 [--breakdown] [--forward-only]

fp16, B = 1, H = 12, d = 64 by default. Times are medians over --reps calls measured with CUDA events (after
--warmup calls): the forward alone (under no_grad) and the forward + backward for a fixed dO. A run that does not
fit in memory is reported as "OOM" (the spec without a window at 32K on an identity map stores N × N projections).
The windowed forward should be at least 10× faster than the unwindowed one at 32K for a window of 256: its key
tiles per query tile shrink from N / BN to about (left + right) / BN + 2.

A name in --specs is a shipped spec (specs/NAME.yaml) or a path to a spec file. --breakdown adds, per row, where a
forward's time goes: each kernel's CUDA time per forward (torch.profiler), their sum, and the host's time per
forward (calls issued back to back without a sync, as relgen.bench's host_ms): a forward whose event time exceeds
its kernels' sum by about its host time is host-bound; a cProfile of the host path follows (per call, the
functions with the most own time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import yaml
from layouts import DTYPE, commit, tables

import relgen

ROOT = Path(__file__).resolve().parent.parent


def event_ms(run: Callable[[], object], warmup: int, reps: int) -> float:
    """Median milliseconds of `run` by CUDA events, one pair per call."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def breakdown(run: Callable[[], object]) -> dict:
    """Each kernel's CUDA time per call (ms), their sum, the host's time per call (µs) of `run`, and a cProfile of
    its host path (the 15 functions with the most own time per call)."""
    from profile_kernels import kernel_times, profile_calls

    from relgen.bench.worker import host_ms, queued_calls

    kernels = kernel_times(run, iters=10)
    gpu_ms = sum(kernels.values())
    calls = queued_calls(max(gpu_ms, 1e-3))
    return {
        "kernels_ms": {name: round(ms, 4) for name, ms in kernels.items()},
        "gpu_ms": gpu_ms,
        "host_us": host_ms(run, torch.device("cuda"), calls) * 1e3,
        "host_profile": profile_calls(run, calls=4 * calls, rows=15, sync_every=calls),
    }


def timings(
    run: Callable[[], torch.Tensor],
    leaves: list[torch.Tensor],
    warmup: int,
    reps: int,
    split: bool = False,
    forward_only: bool = False,
) -> dict:
    """{"fwd_ms", "fwd_bwd_ms"} of `run`, None where it ran out of memory or was not asked for; with `split`, the
    forward's breakdown."""
    result: dict = {"fwd_ms": None, "fwd_bwd_ms": None}
    try:
        with torch.no_grad():
            result["fwd_ms"] = event_ms(run, warmup, reps)
            if split:
                result["fwd_breakdown"] = breakdown(run)
        if forward_only:
            return result
        do = torch.randn_like(run())
        result["fwd_bwd_ms"] = event_ms(lambda: torch.autograd.grad(run(), leaves, do), warmup, reps)
    except torch.cuda.OutOfMemoryError:
        pass
    torch.cuda.empty_cache()
    return result


def spec_data(name: str) -> dict:
    path = Path(name) if name.endswith((".yaml", ".yml")) else ROOT / "specs" / f"{name}.yaml"
    return yaml.safe_load(path.read_text())


def spec_rows(name: str, n: int, args: argparse.Namespace) -> list[dict]:
    data = spec_data(name)
    plain = relgen.load_spec(data)
    local = relgen.load_spec(
        {**data, "name": f"{data['name']}_local", "window": {"left": args.left, "right": args.right}}
    )
    b, h, d = args.batch, args.heads, args.head_dim
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=DTYPE).requires_grad_() for _ in range(3))
    rows = []
    for label, spec in (("no window", plain), (f"window [{-args.right}, {args.left}]", local)):
        fn = relgen.compile_mechanism(spec)
        t = tables(spec, n, h, d)
        call = lambda fn=fn, t=t: fn(q, k, v, **t)  # noqa: E731
        measured = timings(call, [q, k, v], args.warmup, args.reps, args.breakdown, args.forward_only)
        rows.append({"spec": plain.name, "n": n, "call": label, **measured})
    return rows


def sdpa_row(n: int, args: argparse.Namespace) -> dict:
    b, h, d = args.batch, args.heads, args.head_dim
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=DTYPE).requires_grad_() for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    measured = timings(lambda: sdpa(q, k, v), [q, k, v], args.warmup, args.reps, forward_only=args.forward_only)
    return {"spec": "SDPA (no relative terms)", "n": n, "call": "no window", **measured}


def shown(ms: float | None) -> str:
    return f"{ms:.3f}" if ms is not None else "OOM"


def speedup(base: float | None, ms: float | None) -> str:
    return f"{base / ms:.1f}×" if base is not None and ms is not None else "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="shaw,txl")
    parser.add_argument("--seq-lens", default="8192,32768")
    parser.add_argument("--left", type=int, default=256)
    parser.add_argument("--right", type=int, default=0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    parser.add_argument("--breakdown", action="store_true", help="add each forward's kernels and host time")
    parser.add_argument("--forward-only", action="store_true", help="time the forward alone (no backward kernels)")
    args = parser.parse_args()

    rows: list[dict] = []
    for n in (int(x) for x in args.seq_lens.split(",")):
        for name in args.specs.split(","):
            rows += spec_rows(name, n, args)
        rows.append(sdpa_row(n, args))
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "float16",
        "shape": f"B={args.batch} H={args.heads} d={args.head_dim}",
    }
    if args.json:
        print(json.dumps({**header, "rows": rows}, indent=1))
        return
    print(", ".join(f"{key} {value}" for key, value in header.items()) + "\n")
    print("| spec | N | call | fwd ms | fwd+bwd ms | fwd speed-up | fwd+bwd speed-up |")
    print("|---|---|---|---|---|---|---|")
    base: dict[tuple[str, int], dict] = {}
    for row in rows:
        key = (row["spec"], row["n"])
        first = base.setdefault(key, row)  # each spec's first row is its call without a window
        fwd, both = row["fwd_ms"], row["fwd_bwd_ms"]
        both_text = "–" if args.forward_only else shown(both)
        print(f"| {row['spec']} | {row['n']} | {row['call']} | {shown(fwd)} | {both_text} | "
              f"{speedup(first['fwd_ms'], fwd)} | {speedup(first['fwd_bwd_ms'], both)} |")  # fmt: skip
    for row in rows:
        split = row.get("fwd_breakdown")
        if split:
            kernels = ", ".join(f"{name} {ms:.3f}" for name, ms in split["kernels_ms"].items())
            print(f"\n{row['spec']} {row['n']} {row['call']}: forward kernels {split['gpu_ms']:.3f} ms in all "
                  f"({kernels}); host {split['host_us']:.0f} µs per forward")  # fmt: skip
            print("\n".join(f"    {line}" for line in split["host_profile"]))


if __name__ == "__main__":
    main()
