"""Attention dropout's random stream, shared by the generated kernels and `relgen.testing.dropout_keep_mask`.

A counter-based generator (Philox, through `tl.rand`) keyed by (seed, b·H + h, i, j): the backward pass and the
testing helper regenerate exactly the mask the forward pass drew, and nothing is stored. The seed reaches the
kernels as an int, or as a one-element tensor they read (`seed_value`): the same seed draws the same mask either
way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def seed_value(seed):
    """The seed the kernels draw with: an int argument, or read from a one-element integer tensor (a seed that
    changes between the replays of a CUDA graph, where an int would be captured once)."""
    if seed.dtype.is_ptr():
        return tl.load(seed).to(tl.int64)
    else:
        return seed


@triton.jit
def dropout_keep(seed, bh, i, j, Nq, Nk, dropout_p):
    """True where score (i, j) of batch·head `bh` is kept; i and j broadcast to the tile (either orientation)."""
    counter = (bh.to(tl.int64) * Nq + i) * Nk + j
    return tl.rand(seed, counter) >= dropout_p


@triton.jit(do_not_specialize=["seed"])  # as the attention kernels: one compiled kernel for every seed
def _keep_mask_kernel(OUT, seed, dropout_p, Nq, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed_value(seed), bh, offs_m[:, None], offs_n[None, :], Nq, Nk, dropout_p)
    ptrs = OUT + (bh.to(tl.int64) * Nq + offs_m[:, None]) * Nk + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < Nq) & (offs_n[None, :] < Nk))


def keep_mask(shape: tuple[int, int, int, int], p: float, seed: int | torch.Tensor, device) -> torch.Tensor:
    """The bool keep mask [B, H, Nq, Nk] a call with `dropout_p=p, dropout_seed=seed` uses (seed: an int, or a
    one-element integer tensor on `device`)."""
    b, h, nq, nk = shape
    out = torch.empty((b, h, nq, nk), dtype=torch.int8, device=device)
    grid = (triton.cdiv(nq, 32), triton.cdiv(nk, 32), b * h)
    _keep_mask_kernel[grid](out, seed, float(p), nq, nk, BLOCK_M=32, BLOCK_N=32)
    return out.bool()
