"""Per-kernel CUDA time of one relgen forward and one backward (torch.profiler, mean of 10 calls) on the
benchmark's problem (16K tokens, H = 12, d = 64, fp16), through the public API and the FP64 checker's input maker
only, so that the same file also runs against an older tree: an A/B of two commits kernel by kernel.

    python benchmarks/kernel_breakdown.py --spec txl --seq-len 8192 [--tag current] [--projections tiled]
    cd OTHER && PYTHONPATH=$PWD python /path/to/kernel_breakdown.py --spec txl --seq-len 8192 --tag other

Prints one JSON line: each kernel's µs per call in the forward and in the backward, and their sums.
--projections passes the call option of that name (trees from before it take none); --batch replaces the
benchmark's B = 16K / N (long sequences: --batch 1).
"""

from __future__ import annotations

import argparse
import json

import torch

import relgen

try:
    from relgen.check.verify import make_inputs
except ImportError:  # a tree from before the package layout
    from relgen.verify import make_inputs  # type: ignore[no-redef]

CALLS = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="a shipped spec's name (specs/NAME.yaml of the current tree)")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--tag", default="", help="a label for the tree measured")
    parser.add_argument("--projections", default=None, choices=("auto", "stored", "tiled"))
    parser.add_argument("--batch", type=int, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_breakdown.py times GPU kernels: no CUDA device")
    n = args.seq_len
    spec = relgen.load_spec(f"specs/{args.spec}.yaml")
    b = args.batch or max(1, 16384 // n)
    made = make_inputs(spec, b=b, h=12, nq=n, d=64, dtype=torch.float16, device="cuda", bias_dtype=torch.float16)
    mechanism = relgen.compile_mechanism(spec)
    options = {} if args.projections is None else {"projections": args.projections}
    leaves = [made.q, made.k, made.v, *made.tables.values()]

    def forward() -> torch.Tensor:
        return mechanism(made.q, made.k, made.v, **made.tables, **options)

    out = forward()
    do = torch.randn_like(out)
    for _ in range(3):  # compile and warm every kernel of both passes
        out = forward()
        torch.autograd.grad(out, leaves, do, retain_graph=True)
    torch.cuda.synchronize()
    record = {"spec": args.spec, "seq_len": n, "batch": b, "tag": args.tag, **options}
    passes = {"fwd": forward, "bwd": lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)}
    for name, run in passes.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                run()
            torch.cuda.synchronize()
        kernels = {}
        for event in prof.key_averages():
            us = getattr(event, "self_device_time_total", None)
            us = getattr(event, "self_cuda_time_total", 0) if us is None else us
            if us > 0:
                kernels[event.key[:60]] = round(us / CALLS, 1)
        record[name] = dict(sorted(kernels.items(), key=lambda item: -item[1]))
        record[f"{name}_total_us"] = round(sum(kernels.values()), 1)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
