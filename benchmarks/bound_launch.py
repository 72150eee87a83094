"""The fp16 storage's bound launch alone (`relgen.runtime.scales.projection_bounds`) on a GPU, over its launch
constants: the most programs (`MAX_BOUND_PROGRAMS`), the elements a program reads at a time (`_BLOCK_ELEMENTS`), its
warps (`_BOUND_WARPS`) and the memory order of its atomic maxima (`_ATOMIC_SEM`). The problem is the benchmark's:
16K tokens of H heads and head dim d in fp16 ([B, H, N, d] with B·N = tokens), with a table of 2·256 + 1 rows per
head on the query side (Shaw's clipped map at ±256) and, with `--sides qk`, on the key side too (DeBERTa's two
terms).

    python benchmarks/bound_launch.py [--tokens 16384] [--heads 12] [--head-dim 64] [--sides q|qk]
        [--programs 132,264,528,1024,4096] [--elements 2048,4096,8192,16384] [--warps 4,8] [--sems acq_rel,relaxed]

Prints one JSON line per variant: the launch's CUDA time (`triton.testing.do_bench` median, L2 flushed, the
zeroing of the [6] tensor included), the bytes it reads and the bandwidth they make; every variant's maxima are
first checked against the default constants' (to fp32 rounding: a row's norm may be summed in another order).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton.testing

from relgen.runtime import scales


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sides", choices=("q", "qk"), default="q")
    parser.add_argument("--programs", type=_ints, default=[132, 264, 528, 1024, 4096])
    parser.add_argument("--elements", type=_ints, default=[2048, 4096, 8192, 16384])
    parser.add_argument("--warps", type=_ints, default=[4, 8])
    parser.add_argument("--sems", type=lambda text: text.split(","), default=["acq_rel", "relaxed"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bound_launch.py times a GPU launch: no CUDA device")

    h, d, rows = args.heads, args.head_dim, 2 * 256 + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, h, args.tokens, d, device="cuda", generator=gen, dtype=torch.float16)
    k = torch.randn_like(q)
    aq = torch.randn(h * rows, d, device="cuda", generator=gen, dtype=torch.float16)
    ak = torch.randn_like(aq) if args.sides == "qk" else None
    operands = (q, aq, None, k, ak, None)
    read = q.numel() * 2 + aq.numel() * 2 + (k.numel() * 2 + ak.numel() * 2 if ak is not None else 0)
    want = scales.projection_bounds(*operands)

    names = ("MAX_BOUND_PROGRAMS", "_BLOCK_ELEMENTS", "_BOUND_WARPS", "_ATOMIC_SEM")
    defaults = {name: getattr(scales, name) for name in names}
    try:
        variants = itertools.product(args.programs, args.elements, args.warps, args.sems)
        for programs, elements, warps, sem in variants:
            scales.MAX_BOUND_PROGRAMS, scales._BLOCK_ELEMENTS, scales._BOUND_WARPS = programs, elements, warps
            scales._ATOMIC_SEM = sem
            got = scales.projection_bounds(*operands)
            if not torch.allclose(got, want, rtol=1e-6, atol=0.0):
                raise SystemExit(f"programs={programs} elements={elements} warps={warps} sem={sem}: maxima {got} "
                                 f"!= {want}")  # fmt: skip
            ms = triton.testing.do_bench(lambda: scales.projection_bounds(*operands), warmup=25, rep=200,
                                         return_mode="median")  # fmt: skip
            record = {"tokens": args.tokens, "heads": h, "head_dim": d, "sides": args.sides, "max_programs": programs,
                      "block_elements": elements, "warps": warps, "sem": sem, "us": ms * 1e3, "bytes": read,
                      "tb_per_s": read / (ms * 1e-3) / 1e12}  # fmt: skip
            print(json.dumps(record), flush=True)
    finally:
        for name, value in defaults.items():
            setattr(scales, name, value)


if __name__ == "__main__":
    main()
