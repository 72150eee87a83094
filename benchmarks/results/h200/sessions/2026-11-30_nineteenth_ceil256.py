"""Plain-attention ceiling of relgen's design with 256-row query blocks (8 warps: 128 rows per warpgroup)."""

import functools
import json
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
from plain_ceiling import plain_forward

n, h, d = 8192, 12, 64
b = 16384 // n
q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
for r in range(2):
    sd = triton.testing.do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), warmup=25, rep=200, return_mode="median"
    )
    print(json.dumps({"system": "sdpa_plain", "round": r, "ms": sd}), flush=True)
    for bm, bn, w, s in [
        (128, 64, 4, 3),
        (128, 64, 4, 4),
        (256, 64, 8, 2),
        (256, 64, 8, 3),
        (256, 64, 8, 4),
        (256, 128, 8, 2),
        (256, 128, 8, 3),
        (256, 32, 8, 3),
        (256, 32, 8, 4),
    ]:
        row = {"round": r, "block_m": bm, "block_n": bn, "warps": w, "stages": s}
        try:
            run = functools.partial(plain_forward, q, k, v, bm, bn, w, s, True, False)
            row["max_err"] = (run().float() - ref.float()).abs().max().item()
            row["ms"] = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        print(json.dumps(row), flush=True)
