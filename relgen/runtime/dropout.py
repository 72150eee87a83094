"""Attention dropout's random stream, shared by the generated kernels and `relgen.testing.dropout_keep_mask`.

A counter-based generator (Philox 4x32, through `tl.randint4x`) keyed by (seed, b·H + h, i, ⌊j / 4⌋): one call
draws the numbers of four consecutive keys of a query, so a tile costs a quarter of the Philox calls that one draw
per score would (the rounds of a call are its cost, and a call always yields four words). The backward pass and
the testing helper regenerate exactly the mask the forward pass drew, and nothing is stored. The seed reaches the
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
def dropout_keep(
    seed,
    bh,
    offs_m,
    j_first,
    Nq,
    Nk,
    dropout_p,
    BLOCK_N: tl.constexpr,
    DESCENDING: tl.constexpr,
    KEY_MAJOR: tl.constexpr,
):
    """Where the scores of batch·head `bh` are kept, for the queries offs_m and the tile's keys j_first + u, or
    j_first − u when DESCENDING (u = 0 … BLOCK_N − 1; the tile's keys start on a multiple of four): [BM, BN], or
    [BN, BM] when KEY_MAJOR. Nq, Nk: the counter's sizes (the same in every pass)."""
    t = tl.arange(0, BLOCK_N // 4)
    if DESCENDING:  # noqa: SIM108 (constexpr branches: Triton compiles the taken one only)
        groups = (j_first - 3) // 4 - t
    else:
        groups = j_first // 4 + t
    counter = (bh.to(tl.int64) * Nq + offs_m[:, None]) * ((Nk + 3) // 4) + groups[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counter)
    # word w of group g is key 4g + w; a tile lists a group's keys up (u = 4t + w) or down (u = 4t + 3 − w), and
    # join(join(a, c), join(b, d)) lays a, b, c, d out in that order
    if DESCENDING:  # noqa: SIM108
        words = tl.join(tl.join(r3, r1), tl.join(r2, r0))
    else:
        words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    uniform = tl.uint_to_uniform_float(tl.reshape(words, [offs_m.shape[0], BLOCK_N]))
    if KEY_MAJOR:
        uniform = tl.trans(uniform)
    return uniform >= dropout_p


@triton.jit(do_not_specialize=["seed"])  # as the attention kernels: one compiled kernel for every seed
def _keep_mask_kernel(OUT, seed, dropout_p, Nq, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed, bh, offs_m, pid_n * BLOCK_N, Nq, Nk, dropout_p, BLOCK_N, False, False)
    ptrs = OUT + (bh.to(tl.int64) * Nq + offs_m[:, None]) * Nk + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < Nq) & (offs_n[None, :] < Nk))


def keep_mask(shape: tuple[int, int, int, int], p: float, seed: int, device) -> torch.Tensor:
    """The bool keep mask [B, H, Nq, Nk] a call with `dropout_p=p, dropout_seed=seed` uses."""
    b, h, nq, nk = shape
    out = torch.empty((b, h, nq, nk), dtype=torch.int8, device=device)
    grid = (triton.cdiv(nq, 32), triton.cdiv(nk, 32), b * h)
    _keep_mask_kernel[grid](out, seed, float(p), nq, nk, BLOCK_M=32, BLOCK_N=32)
    return out.bool()
