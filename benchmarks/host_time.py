"""relgen's own host time per call, without a GPU: every Triton launch of the generated module is replaced by a
no-op, so what remains is argument checking, geometry, tile selection, buffer allocation and autograd glue.

At N ≤ 1K a call is host-bound on the H200 (docs/performance.md), and this part of it can be
measured and trimmed on any machine. Triton's own launcher (tens of µs per launch) is not included: time it on
the GPU with `benchmarks/profile_kernels.py`'s host_ms_per_fwd_call.

    python benchmarks/host_time.py [--specs shaw,txl] [--calls 400]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

import relgen
from relgen.check.verify import make_inputs

ROOT = Path(__file__).resolve().parent.parent


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **meta)` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **meta: None


def best_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    for _ in range(30):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def host_time(name: str, calls: int) -> tuple[float, float]:
    """(forward, forward + backward) µs per call at B = H = 1, N = 128, d = 64, fp16, on the CPU."""
    spec = relgen.load_spec(ROOT / "specs" / f"{name}.yaml")
    fn = relgen.compile_mechanism(spec)
    module = fn.module
    for attr in dir(module):
        if attr.endswith("_kernel"):
            setattr(module, attr, _NoLaunch())
    inputs = make_inputs(spec, b=1, h=1, nq=128, d=64, dtype=torch.float16, device="cpu")
    leaves = list(inputs.leaves.values())

    def forward():
        return fn(inputs.q, inputs.k, inputs.v, **inputs.tables)

    def both():
        out = forward()
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    return best_us(forward, calls), best_us(both, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="shaw,txl,deberta_v3,t5")
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    for name in args.specs.split(","):
        fwd, both = host_time(name, args.calls)
        print(f"{name:12s} forward {fwd:7.1f} µs   forward + backward {both:7.1f} µs  (launches stubbed, best of 5)")


if __name__ == "__main__":
    main()
