"""How fast a Triton kernel of relgen's forward design runs *plain* attention on this GPU (a development aid).

relgen's forward spends most of its tiles on saturated offsets, where a tile is plain attention plus one number
per query. This probe times a minimal forward of the same design (one program per query block and head, online
softmax in exp2, the key loop over tiles) with no relative terms at all, next to plain SDPA, over a few tile
configurations, with and without TMA descriptor loads and Triton's warp specialisation. Its best time is the
ceiling relgen's forward can approach with this design; the distance to SDPA is what the design itself costs.

    python benchmarks/plain_ceiling.py [--seq-len 8192] [--json OUT.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _plain_fwd(
    Q,
    K,
    V,
    Out,
    k_desc,
    v_desc,
    H,
    N,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    base = bh.to(tl.int64) * N * HEAD_DIM  # contiguous [B, H, N, d]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile in tl.range(0, N // BLOCK_N, warp_specialize=WS):
        if TMA:
            k = k_desc.load([b, h, tile * BLOCK_N, 0]).reshape([BLOCK_N, HEAD_DIM])
            v = v_desc.load([b, h, tile * BLOCK_N, 0]).reshape([BLOCK_N, HEAD_DIM])
        else:
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            k = tl.load(K + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
            v = tl.load(V + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
        x = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(x, 1) * qk_scale)
        p = tl.exp2(x * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    tl.store(Out + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty))


def plain_forward(q, k, v, block_m: int, block_n: int, warps: int, stages: int, tma: bool, ws: bool):
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, n, d = q.shape
    o = torch.empty_like(q)
    box = [1, 1, block_n, d]
    k_desc = TensorDescriptor(k, list(k.shape), list(k.stride()), box) if tma else None
    v_desc = TensorDescriptor(v, list(v.shape), list(v.stride()), box) if tma else None
    grid = (n // block_m, b * h)
    _plain_fwd[grid](
        q,
        k,
        v,
        o,
        k_desc,
        v_desc,
        h,
        n,
        LOG2E / math.sqrt(d),
        d,
        block_m,
        block_n,
        tma,
        ws,
        num_warps=warps,
        num_stages=stages,
    )
    return o


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    n, h, d = args.seq_len, 12, 64
    b = max(1, 16384 // n)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    sdpa = triton.testing.do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), warmup=25, rep=200, return_mode="median"
    )
    rows = [{"system": "sdpa_plain", "seq_len": n, "ms": sdpa}]
    print(json.dumps(rows[0]), flush=True)
    for (bm, bn, warps), stages, tma, ws in itertools.product(
        [(64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8)], [2, 3, 4], [False, True], [False, True]
    ):
        row = {
            "system": "triton_plain",
            "seq_len": n,
            "block_m": bm,
            "block_n": bn,
            "warps": warps,
            "stages": stages,
            "tma": tma,
            "ws": ws,
        }
        try:
            run = functools.partial(plain_forward, q, k, v, bm, bn, warps, stages, tma, ws)
            row["max_err"] = (run().float() - ref.float()).abs().max().item()
            row["ms"] = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        except Exception as err:  # a configuration the compiler rejects is a finding, not a stop
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
