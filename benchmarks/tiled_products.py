"""Transformer-XL attention with its relation products formed inside each tile: a standalone Triton prototype.

The score of query i and key j is S_ij = τ·(q_i·k_j + q_i·p_δ), δ = i − j, with one table P [H, 2N − 1, d] shared by
the batch (row δ + N − 1). The stored path of relgen keeps Z̃^Q = Q·Pᵀ (N × (N + G) entries per head) between the
passes; here nothing of size N × N (or N × W) is ever written: every program forms the products its tile needs.

A score tile [B, B] of queries i0 + a and keys j0 + b reads the products q_(i0+a)·P_(r0+c) at c = a − b + B − 1,
r0 = i0 − j0 + N − B: a band of 2B − 1 table rows, each query row reading its own B consecutive columns of
Y = Q_tile·P_bandᵀ [B, 2B] (the relative shift of Transformer-XL). The skew from Y to the tile is the whole problem;
the forward compares three ways (`METHODS`):

* gather:  Y in registers, `tl.gather` along its columns (relgen's ablation `no_projections`);
* scratch: Y stored to a small per-program buffer (it stays in L1/L2) and read back with row stride 2B + 1, so that
  entry (a, b) sits at a·2B + (a − b + B − 1); one barrier between the store and the load;
* reuse:   as scratch, but tile t + 1's band overlaps tile t's by B − 1 rows: Y is two [B, B] blocks, the lower one
  new (rows r0 … r0 + B − 1), the upper one the previous tile's lower block. Each tile multiplies one [B, B] block,
  so the relation products cost one QKᵀ-sized product per tile instead of two; a ring of three blocks lets one
  barrier per tile order the stores and loads.

The backward needs no N × N buffer and no atomics; each gradient has one owner:

* dQ, query-parallel (as the forward, with reuse): dq_i = τ·Σ_j dS_ij·(k_j + p_(i−j)). The relation half is the
  inverse skew: block m of the band receives tile t's lower triangle and tile t + 1's upper one (complementary, so
  every entry has exactly one writer), read back from a two-tile ring of dS and multiplied by P's block once.
* dK, dV, key-parallel: the forward's tile recomputed (full band through the scratch, since the query tile
  changes along the loop and no product carries over).
* dP, offset-parallel: a program owns B table rows δ0 … δ0 + B − 1 and visits the pairs (i, i − δ) of those
  offsets, a parallelogram of the (i, j) plane that is a rectangle in (i, δ): there q·P_blockᵀ needs no skew and
  dP_block = τ·dSᵀ·Q is one product; the skews move to q·K_bandᵀ and dO·V_bandᵀ (same scratch read as the forward).
  Each row of dP is written once, in P's dtype; the batch is summed inside the program, in a fixed order.

Work per tile in units of one [B, B, d] product (SDPA: 2 forward, 5 backward with atomics):
forward 4 (gather, scratch) or 3 (reuse); backward dQ 5 + dK/dV 7 + dP 6 = 18.

Programs are persistent (a few per SM, each looping over work items) so that the scratch is a few MiB, not one
slice per tile. Everything is exact and deterministic by construction: fixed loop orders, one writer per entry.

    python benchmarks/tiled_products.py --check                      # small-N exactness on whatever device
    python benchmarks/tiled_products.py --bench --seq-lens 8192,32768 --batch 1 --heads 12
    python benchmarks/tiled_products.py --compile-check [--arch 90]  # every kernel for sm_90 without a GPU

Credited FLOPs (relgen.bench.common.credited_flops, the paper's App. D): forward 4·B·H·N²·d + 2·B·H·N·(2N − 1)·d,
backward twice that; causal calls are credited half of both.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

METHODS = ("gather", "scratch", "reuse")
BY_GATHER = tl.constexpr(0)
BY_SCRATCH = tl.constexpr(1)
BY_REUSE = tl.constexpr(2)
#: warps and pipeline stages of every launch (two stages keep the forward at two programs per SM)
LAUNCH_OPTIONS = {"num_warps": 4, "num_stages": 2}
#: programs of a persistent launch in the interpreter: a handful, so that tests run the work loop
INTERPRETED_PROGRAMS = 3
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


# ------------------------------------------------------------------------------------------------------------
# tiles: rows of a matrix, the band product, and the skewed reads of the scratch
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _rows(base, rows, n_rows, D: tl.constexpr):
    """Rows `rows` of a row-major [n_rows, D] matrix; rows outside [0, n_rows) read as 0."""
    offs_d = tl.arange(0, D)
    ok = (rows >= 0) & (rows < n_rows)
    return tl.load(base + rows[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _store_tile(base, x, COLS: tl.constexpr):
    """x [rows, COLS] row-major at `base`."""
    r = tl.arange(0, x.shape[0])[:, None]
    c = tl.arange(0, COLS)[None, :]
    tl.store(base + r * COLS + c, x)


@triton.jit
def _barrier():
    """A CTA barrier (bar.sync) that returns 0, for the scratch reads to add to their addresses: the reads then
    depend on it, and the loop stays one the software pipeliner takes (a tl.debug_barrier in the loop body keeps
    it from pipelining the K, V and P loads). The interpreter runs programs one at a time and needs none."""
    if INTERPRETED:
        return 0
    else:
        return tl.inline_asm_elementwise(
            "bar.sync 0;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _scratch_load(ptrs):
    """fp32 entries of the scratch, loaded in PTX: Triton's software pipeliner only moves tl.load, so these stay
    after the barrier whose result their addresses add (it would otherwise issue a load feeding a product's
    operand iterations early, before the store it must see)."""
    if INTERPRETED:
        return tl.load(ptrs)
    else:
        return tl.inline_asm_elementwise(
            "ld.global.f32 $0, [$1];", "=r,l", [ptrs], dtype=tl.float32, is_pure=False, pack=1
        )


@triton.jit
def _skewed(band, BLOCK: tl.constexpr):
    """T[a, b] = Y[a, a − b + B − 1] of the [B, 2B] tile Y stored row-major at `band`: row a read with stride
    2B + 1, its B entries one contiguous (descending) run."""
    a = tl.arange(0, BLOCK)[:, None]
    b = tl.arange(0, BLOCK)[None, :]
    return _scratch_load(band + a * (2 * BLOCK + 1) + (BLOCK - 1 - b))


@triton.jit
def _skewed_pair(lower, upper, BLOCK: tl.constexpr):
    """_skewed of Y = [lower | upper], two [B, B] blocks stored apart (the reuse ring)."""
    a = tl.arange(0, BLOCK)[:, None]
    c = a - tl.arange(0, BLOCK)[None, :] + BLOCK - 1
    return _scratch_load(tl.where(c < BLOCK, lower + a * BLOCK + c, upper + a * BLOCK + (c - BLOCK)))


@triton.jit
def _unskewed_block(older, newer, OLDER, NEWER, BLOCK: tl.constexpr):
    """The inverse skew of one band block: G[a, c] = Σ_b [c = a − b + B − 1] dS[a, b] over the two tiles that reach
    it, whose dS [B, B] (fp32) are stored row-major at `older` (tile t, columns c ≥ a) and `newer` (tile t + 1,
    c < a). The two triangles are complementary, so each entry is one load, never a sum. OLDER / NEWER: whether
    that tile exists (the loop's first and last blocks have one tile only); a missing one's entries are 0."""
    a = tl.arange(0, BLOCK)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    upper = c >= a
    x = _scratch_load(tl.where(upper, older + a * BLOCK + (a - c + BLOCK - 1), newer + a * BLOCK + (a - c - 1)))
    return tl.where(tl.where(upper, OLDER, NEWER), x, 0.0)


@triton.jit
def _relation_tile(
    q, P_h, r0, R, scratch, t, D: tl.constexpr, BLOCK: tl.constexpr, SKEW: tl.constexpr, PREC: tl.constexpr
):
    """q_(i0+a)·p_(i0+a−j0−b) of tile t ([B, B], fp32): the band product Y = q·P[r0 : r0 + 2B]ᵀ, skewed."""
    a = tl.arange(0, BLOCK)
    if SKEW == BY_REUSE:
        # the ring holds Y's blocks of tiles t − 1 (slot (t + 2) % 3, this tile's upper half) and t − 2
        y = tl.dot(q, tl.trans(_rows(P_h, r0 + a, R, D)), input_precision=PREC)
        lower = scratch + (t % 3) * (BLOCK * BLOCK)
        _store_tile(lower, y, BLOCK)
        z = _barrier()  # other threads read these entries
        return _skewed_pair(lower + z, scratch + ((t + 2) % 3) * (BLOCK * BLOCK) + z, BLOCK)
    else:
        y = tl.dot(q, tl.trans(_rows(P_h, r0 + tl.arange(0, 2 * BLOCK), R, D)), input_precision=PREC)
        if SKEW == BY_GATHER:
            return tl.gather(y, a[:, None] - a[None, :] + BLOCK - 1, 1)
        else:
            band = scratch + (t % 2) * (2 * BLOCK * BLOCK)  # two slots: one barrier per tile orders them
            _store_tile(band, y, 2 * BLOCK)
            return _skewed(band + _barrier(), BLOCK)


@triton.jit
def _pair_mask(offs_m, offs_n, N, CAUSAL: tl.constexpr):
    keep = (offs_n < N)[None, :]
    if CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    return keep


# ------------------------------------------------------------------------------------------------------------
# forward: online softmax over key tiles, the relation tile formed per tile
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    P,
    OUT,
    LSE,
    SCRATCH,
    N,
    R,
    BH,
    H,
    qk_scale,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SKEW: tl.constexpr,
    PREC: tl.constexpr,
):
    """Persistent: program pid takes the work items pid, pid + programs, …; item = (query block, bh), the
    causal heaviest blocks first. LSE is the base-2 log-sum-exp of the scores in log2 units."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK)
    scratch = SCRATCH + pid.to(tl.int64) * (4 * BLOCK * BLOCK)
    a = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    for work in range(pid, n_blocks * BH, tl.num_programs(0)):
        blk = n_blocks - 1 - work // BH
        bh = work % BH
        i0 = blk * BLOCK
        offs_m = i0 + a
        base = bh.to(tl.int64) * N * D
        P_h = P + (bh % H).to(tl.int64) * R * D
        q = _rows(Q + base, offs_m, N, D)
        n_keys = blk + 1 if CAUSAL else n_blocks
        tl.debug_barrier()  # the previous item's reads of the scratch are done
        if SKEW == BY_REUSE:
            # tile 0's upper half (its rows r0 + B …, r0 = i0 + N − B), as if a tile −1 had left it in the ring
            y = tl.dot(q, tl.trans(_rows(P_h, i0 + N + a, R, D)), input_precision=PREC)
            _store_tile(scratch + 2 * BLOCK * BLOCK, y, BLOCK)
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, D], tl.float32)
        for t in range(0, n_keys):
            j0 = t * BLOCK
            offs_n = j0 + a
            k = _rows(K + base, offs_n, N, D)
            v = _rows(V + base, offs_n, N, D)
            rel = _relation_tile(q, P_h, i0 - j0 + N - BLOCK, R, scratch, t, D, BLOCK, SKEW, PREC)
            s = tl.dot(q, tl.trans(k), rel, input_precision=PREC) * qk_scale
            s = tl.where(_pair_mask(offs_m, offs_n, N, CAUSAL), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        row_ok = offs_m < N
        tl.store(
            OUT + base + offs_m[:, None] * D + offs_d[None, :],
            (acc / l_i[:, None]).to(OUT.dtype.element_ty),
            mask=row_ok[:, None],
        )
        tl.store(LSE + bh.to(tl.int64) * N + offs_m, m_i + tl.log2(l_i), mask=row_ok)


# ------------------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess(OUT, DO, DELTA, N, D: tl.constexpr, BLOCK: tl.constexpr):
    """Δ_i = Σ_d dO_id·O_id (fp32), FlashAttention's D."""
    blk, bh = tl.program_id(0), tl.program_id(1)
    offs_m = blk * BLOCK + tl.arange(0, BLOCK)
    base = bh.to(tl.int64) * N * D
    o = _rows(OUT + base, offs_m, N, D).to(tl.float32)
    do = _rows(DO + base, offs_m, N, D).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * N + offs_m, tl.sum(o * do, 1), mask=offs_m < N)


@triton.jit
def _row_stats(LSE, DELTA, bh, offs_m, N):
    """Per-query LSE (+inf past the sequence's end, so that those rows' probabilities are 0) and Δ."""
    ok = offs_m < N
    lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=ok, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * N + offs_m, mask=ok, other=0.0)
    return lse, delta


@triton.jit
def _score_grad(s, keep, lse, delta, dp):
    """dS = A ∘ (dA − Δ) of a tile of scores s (log2 units), A = 2^(s − LSE) on the kept pairs."""
    p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
    return p, p * (dp - delta[:, None])


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    P,
    DO,
    LSE,
    DELTA,
    DQ,
    SCRATCH,
    N,
    R,
    BH,
    H,
    qk_scale,
    sm_scale,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
):
    """dQ = τ·(dS·K + Σ_m G_m·P_m), G_m the band blocks of dS (the inverse skew). The scratch holds two rings of
    two [B, B] slots: Y's blocks and dS tiles (fp32, holding dS as rounded for the products); two
    barriers per tile order them."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK)
    y_ring = SCRATCH + pid.to(tl.int64) * (4 * BLOCK * BLOCK)
    ds_ring = y_ring + 2 * BLOCK * BLOCK
    a = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    for work in range(pid, n_blocks * BH, tl.num_programs(0)):
        blk = n_blocks - 1 - work // BH
        bh = work % BH
        i0 = blk * BLOCK
        offs_m = i0 + a
        base = bh.to(tl.int64) * N * D
        P_h = P + (bh % H).to(tl.int64) * R * D
        q = _rows(Q + base, offs_m, N, D)
        do = _rows(DO + base, offs_m, N, D)
        lse, delta = _row_stats(LSE, DELTA, bh, offs_m, N)
        n_keys = blk + 1 if CAUSAL else n_blocks
        tl.debug_barrier()
        p_prev = _rows(P_h, i0 + N + a, R, D)  # tile 0's upper block, which no earlier tile's lower one is
        y = tl.dot(q, tl.trans(p_prev), input_precision=PREC)
        _store_tile(y_ring + BLOCK * BLOCK, y, BLOCK)
        dq = tl.zeros([BLOCK, D], tl.float32)
        for t in range(0, n_keys):
            j0 = t * BLOCK
            offs_n = j0 + a
            k = _rows(K + base, offs_n, N, D)
            v = _rows(V + base, offs_n, N, D)
            p_lo = _rows(P_h, i0 - j0 + N - BLOCK + a, R, D)
            y = tl.dot(q, tl.trans(p_lo), input_precision=PREC)
            lower = y_ring + (t % 2) * (BLOCK * BLOCK)
            _store_tile(lower, y, BLOCK)
            z = _barrier()
            rel = _skewed_pair(lower + z, y_ring + ((t + 1) % 2) * (BLOCK * BLOCK) + z, BLOCK)
            s = tl.dot(q, tl.trans(k), rel, input_precision=PREC) * qk_scale
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            _p, ds = _score_grad(s, _pair_mask(offs_m, offs_n, N, CAUSAL), lse, delta, dp)
            ds = ds.to(k.dtype)
            dq = tl.dot(ds, k, dq, input_precision=PREC)
            newer = ds_ring + (t % 2) * (BLOCK * BLOCK)
            _store_tile(newer, ds.to(tl.float32), BLOCK)  # exactly the rounded dS the products read
            z = _barrier()
            # the band block below this tile's upper half is complete: tile t − 1's triangle and this one's
            g = _unskewed_block(ds_ring + ((t + 1) % 2) * (BLOCK * BLOCK) + z, newer + z, t > 0, True, BLOCK)
            dq = tl.dot(g.to(k.dtype), p_prev, dq, input_precision=PREC)
            p_prev = p_lo
        # the last tile's lower block has no later tile
        g = _unskewed_block(ds_ring + ((n_keys + 1) % 2) * (BLOCK * BLOCK), ds_ring, True, False, BLOCK)
        dq = tl.dot(g.to(q.dtype), p_prev, dq, input_precision=PREC)
        tl.store(
            DQ + base + offs_m[:, None] * D + offs_d[None, :],
            (dq * sm_scale).to(DQ.dtype.element_ty),
            mask=(offs_m < N)[:, None],
        )


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    P,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    SCRATCH,
    N,
    R,
    BH,
    H,
    qk_scale,
    sm_scale,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
):
    """dK = τ·dSᵀ·Q, dV = Aᵀ·dO over the query tiles of a key block; work items key blocks, causal lightest last."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK)
    scratch = SCRATCH + pid.to(tl.int64) * (4 * BLOCK * BLOCK)
    a = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    for work in range(pid, n_blocks * BH, tl.num_programs(0)):
        blk = work // BH
        bh = work % BH
        j0 = blk * BLOCK
        offs_n = j0 + a
        base = bh.to(tl.int64) * N * D
        P_h = P + (bh % H).to(tl.int64) * R * D
        k = _rows(K + base, offs_n, N, D)
        v = _rows(V + base, offs_n, N, D)
        first = blk if CAUSAL else 0
        tl.debug_barrier()
        dk = tl.zeros([BLOCK, D], tl.float32)
        dv = tl.zeros([BLOCK, D], tl.float32)
        for t in range(first, n_blocks):
            i0 = t * BLOCK
            offs_m = i0 + a
            q = _rows(Q + base, offs_m, N, D)
            do = _rows(DO + base, offs_m, N, D)
            lse, delta = _row_stats(LSE, DELTA, bh, offs_m, N)
            rel = _relation_tile(q, P_h, i0 - j0 + N - BLOCK, R, scratch, t, D, BLOCK, BY_SCRATCH, PREC)
            s = tl.dot(q, tl.trans(k), rel, input_precision=PREC) * qk_scale
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            p, ds = _score_grad(s, _pair_mask(offs_m, offs_n, N, CAUSAL), lse, delta, dp)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PREC)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PREC)
        col_ok = (offs_n < N)[:, None]
        tl.store(
            DK + base + offs_n[:, None] * D + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok
        )
        tl.store(DV + base + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _bwd_dp_kernel(
    Q,
    K,
    V,
    P,
    DO,
    LSE,
    DELTA,
    DP,
    SCRATCH,
    N,
    R,
    BATCH,
    H,
    qk_scale,
    sm_scale,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
):
    """dP_δ = τ·Σ_b Σ_i dS_(i, i−δ)·q_i for the B rows δ0 … δ0 + B − 1 of a work item (row block, head).

    A tile is the queries i0 + a and the offsets δ0 + c (keys i0 + a − δ0 − c): q·P_blockᵀ needs no skew there,
    while q·kᵀ and dO·vᵀ are read skewed out of the [B, 2B] products with the key band j_lo + e,
    e = a − c + B − 1 (the forward's skew, with c for b)."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(R, BLOCK)
    scratch = SCRATCH + pid.to(tl.int64) * (8 * BLOCK * BLOCK)
    a = tl.arange(0, BLOCK)
    band = tl.arange(0, 2 * BLOCK)
    offs_d = tl.arange(0, D)
    for work in range(pid, n_row_blocks * H, tl.num_programs(0)):
        h = work % H
        rows = (work // H) * BLOCK + a  # table rows, δ = row − (N − 1)
        delta0 = (work // H) * BLOCK - (N - 1)
        P_h = P + h.to(tl.int64) * R * D
        p_block = _rows(P_h, rows, R, D)
        offs_c = delta0 + a  # δ of the tile's columns
        # queries that have a key at some offset of the block: j = i − δ ∈ [0, N)
        i_first = tl.maximum(delta0, 0)
        i_end = tl.minimum(N, N + delta0 + BLOCK - 1)
        if CAUSAL:
            i_end = tl.where(delta0 + BLOCK - 1 < 0, i_first, i_end)  # every offset negative: no pair
        n_tiles = tl.cdiv(tl.maximum(i_end - i_first, 0), BLOCK)
        tl.debug_barrier()
        dpb = tl.zeros([BLOCK, D], tl.float32)
        for step in range(0, BATCH * n_tiles):
            t = step % n_tiles
            bh = (step // n_tiles) * H + h
            base = bh.to(tl.int64) * N * D
            i0 = i_first + t * BLOCK
            offs_m = i0 + a
            j_lo = i0 - delta0 - BLOCK + 1
            q = _rows(Q + base, offs_m, N, D)
            do = _rows(DO + base, offs_m, N, D)
            lse, delta = _row_stats(LSE, DELTA, bh, offs_m, N)
            x = tl.dot(q, tl.trans(_rows(K + base, j_lo + band, N, D)), input_precision=PREC)
            z = tl.dot(do, tl.trans(_rows(V + base, j_lo + band, N, D)), input_precision=PREC)
            slot = scratch + (step % 2) * (4 * BLOCK * BLOCK)
            _store_tile(slot, x, 2 * BLOCK)
            _store_tile(slot + 2 * BLOCK * BLOCK, z, 2 * BLOCK)
            z = _barrier()
            qk = _skewed(slot + z, BLOCK)
            dp = _skewed(slot + 2 * BLOCK * BLOCK + z, BLOCK)
            s = tl.dot(q, tl.trans(p_block), qk, input_precision=PREC) * qk_scale
            keys = offs_m[:, None] - offs_c[None, :]
            keep = (offs_m < N)[:, None] & (keys >= 0) & (keys < N) & (rows < R)[None, :]
            if CAUSAL:
                keep = keep & (offs_c >= 0)[None, :]
            _p, ds = _score_grad(s, keep, lse, delta, dp)
            dpb = tl.dot(tl.trans(ds.to(q.dtype)), q, dpb, input_precision=PREC)
        tl.store(
            DP + h.to(tl.int64) * R * D + rows[:, None] * D + offs_d[None, :],
            (dpb * sm_scale).to(DP.dtype.element_ty),
            mask=(rows < R)[:, None],
        )


# ------------------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------------------
def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_block(dtype: torch.dtype) -> int:
    """B (queries = keys = table rows per tile): 16 in the interpreter (tests), else 64 (fp16) or 32 (fp32)."""
    if _interpreted():
        return 16
    return 64 if dtype != torch.float32 else 32


_RESIDENT: dict[tuple, int] = {}


def _persistent(kernel, work: int, head: tuple, tail: tuple, scratch_floats: int, constexprs: dict) -> None:
    """Launches kernel(*head, scratch, *tail) with as many programs as the GPU holds at once (at most `work`; a
    persistent program that waited for a free SM would start its whole list of work items late), each with
    `scratch_floats` fp32 of scratch."""
    device = head[0].device
    if device.type != "cuda":
        programs = max(1, min(work, INTERPRETED_PROGRAMS))
    else:
        key = (kernel.fn.__name__, head[0].dtype, *sorted(constexprs.items()))
        if key not in _RESIDENT:
            probe = torch.empty(4, device=device, dtype=torch.float32)
            compiled = kernel.warmup(*head, probe, *tail, grid=(1,), **constexprs, **LAUNCH_OPTIONS)
            compiled._init_handles()  # loads the binary, which fills n_regs
            props = torch.cuda.get_device_properties(device)
            threads = 32 * LAUNCH_OPTIONS["num_warps"]
            by_regs = 65536 // max(1, compiled.n_regs * threads)
            by_shared = props.shared_memory_per_multiprocessor // max(1, compiled.metadata.shared + 1024)
            _RESIDENT[key] = props.multi_processor_count * max(1, min(by_regs, by_shared, 2048 // threads))
        programs = max(1, min(work, _RESIDENT[key]))
    scratch = torch.empty(programs * scratch_floats, device=device, dtype=torch.float32)
    kernel[(programs,)](*head, scratch, *tail, **constexprs, **LAUNCH_OPTIONS)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp16 products ignore it; fp32 ones stay exact


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must share one shape [B, H, N, d], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _b, h, n, d = q.shape
    if table.shape != (h, 2 * n - 1, d):
        raise ValueError(f"table must be [H, 2N - 1, d] = {(h, 2 * n - 1, d)}, got {tuple(table.shape)}")
    if d < 16 or d & (d - 1):
        raise NotImplementedError(f"head dim d must be a power of two ≥ 16, got {d}")
    if len({q.dtype, k.dtype, v.dtype, table.dtype}) != 1 or q.dtype not in (torch.float16, torch.float32):
        raise NotImplementedError("q, k, v and table must share one dtype, float16 or float32")


def forward(q, k, v, table, causal: bool, scale: float, method: str, block: int):
    """(O, LSE₂) of the kernel: LSE₂ the base-2 log-sum-exp of the scores in log2 units."""
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((b * h, n), device=q.device, dtype=torch.float32)
    constexprs = {"D": d, "BLOCK": block, "CAUSAL": causal, "SKEW": METHODS.index(method), "PREC": _precision(q.dtype)}
    _persistent(
        _fwd_kernel,
        triton.cdiv(n, block) * b * h,
        (q, k, v, table, o, lse),
        (n, 2 * n - 1, b * h, h, scale * math.log2(math.e)),
        4 * block * block,
        constexprs,
    )
    return o, lse


def backward(q, k, v, table, o, lse, do, causal: bool, scale: float, block: int):
    """(dq, dk, dv, dtable): three passes, each gradient entry written once by one program."""
    b, h, n, d = q.shape
    r = 2 * n - 1
    do = do.contiguous()
    delta = torch.empty_like(lse)
    _bwd_preprocess[(triton.cdiv(n, block), b * h)](o, do, delta, n, D=d, BLOCK=block, **LAUNCH_OPTIONS)
    dq, dk, dv, dtable = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(table)
    qk_scale = scale * math.log2(math.e)
    constexprs = {"D": d, "BLOCK": block, "CAUSAL": causal, "PREC": _precision(q.dtype)}
    inputs = (q, k, v, table, do, lse, delta)
    rows = triton.cdiv(n, block) * b * h
    tail = (n, r, b * h, h, qk_scale, scale)
    _persistent(_bwd_dq_kernel, rows, (*inputs, dq), tail, 4 * block * block, constexprs)
    _persistent(_bwd_dkdv_kernel, rows, (*inputs, dk, dv), tail, 4 * block * block, constexprs)
    _persistent(
        _bwd_dp_kernel,
        triton.cdiv(r, block) * h,
        (*inputs, dtable),
        (n, r, b, h, qk_scale, scale),
        8 * block * block,
        constexprs,
    )
    return dq, dk, dv, dtable


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, table, causal, scale, method, block):
        q, k, v, table = (t.contiguous() for t in (q, k, v, table))
        o, lse = forward(q, k, v, table, causal, scale, method, block)
        ctx.save_for_backward(q, k, v, table, o, lse)
        ctx.options = (causal, scale, block)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, table, o, lse = ctx.saved_tensors
        causal, scale, block = ctx.options
        return (*backward(q, k, v, table, o, lse, do, causal, scale, block), None, None, None, None)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    method: str = "reuse",
    block: int | None = None,
) -> torch.Tensor:
    """softmax(τ·(q·kᵀ + q·p_(i−j)))·v for q, k, v [B, H, N, d] and table [H, 2N − 1, d] (row δ + N − 1)."""
    _check_inputs(q, k, v, table, method)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    block = block or default_block(q.dtype)
    return _TiledAttention.apply(q, k, v, table, causal, scale, method, block)


def attention_lse(q, k, v, table, causal=False, scale=None, method="reuse", block=None):
    """(O, LSE) of the forward alone, LSE the natural log-sum-exp of the scores S (for tests)."""
    _check_inputs(q, k, v, table, method)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    o, lse2 = forward(
        *(t.contiguous() for t in (q, k, v, table)), causal, scale, method, block or default_block(q.dtype)
    )
    return o, (lse2 * math.log(2.0)).view(q.shape[:3])


def reference(q, k, v, table, causal=False, scale=None):
    """(O, LSE) in float64, dense: the oracle of the tests and of --check."""
    q, k, v, table = (t.double() for t in (q, k, v, table))
    n = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    i = torch.arange(n, device=q.device)
    rows = (i[:, None] - i[None, :]) + n - 1
    z = torch.einsum("bhid,hrd->bhir", q, table)  # every query against every table row
    rel = torch.gather(z, 3, rows.expand(*q.shape[:2], n, n))
    s = scale * (q @ k.transpose(-1, -2) + rel)
    if causal:
        s = s.masked_fill(i[:, None] < i[None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def credited_flops(b: int, h: int, n: int, d: int, causal: bool, pass_: str) -> float:
    """The paper's credit (relgen.bench.common.credited_flops): 4BHN²d + 2BHN(2N − 1)d forward, backward twice
    that; causal half."""
    forward_flops = 4 * b * h * n * n * d + 2 * b * h * n * (2 * n - 1) * d
    return forward_flops * (2 if pass_ == "bwd" else 1) * (0.5 if causal else 1.0)


# ------------------------------------------------------------------------------------------------------------
# --compile-check: every kernel for a GPU target, without a GPU
# ------------------------------------------------------------------------------------------------------------
def _kernel_variants(dtype: str, block: int, d: int = 64):
    """(label, kernel, signature, constexprs) of every kernel a call in `dtype` launches."""
    ptr, f32 = f"*{dtype}", "*fp32"
    prec = "ieee" if dtype == "fp32" else "tf32"
    ints = {"N": "i32", "R": "i32", "BH": "i32", "H": "i32", "qk_scale": "fp32"}
    common = {"D": d, "BLOCK": block, "PREC": prec}
    for causal in (False, True):
        tag = "causal" if causal else "full"
        for method in METHODS:
            sig = {n: ptr for n in ("Q", "K", "V", "P", "OUT")} | {"LSE": f32, "SCRATCH": f32} | ints
            yield (f"fwd/{method}/{tag}", _fwd_kernel, sig, common | {"CAUSAL": causal, "SKEW": METHODS.index(method)})
        bwd = {n: ptr for n in ("Q", "K", "V", "P", "DO")} | {"LSE": f32, "DELTA": f32}
        yield (
            f"dq/{tag}",
            _bwd_dq_kernel,
            bwd | {"DQ": ptr, "SCRATCH": f32} | ints | {"sm_scale": "fp32"},
            common | {"CAUSAL": causal},
        )
        yield (
            f"dkdv/{tag}",
            _bwd_dkdv_kernel,
            bwd | {"DK": ptr, "DV": ptr, "SCRATCH": f32} | ints | {"sm_scale": "fp32"},
            common | {"CAUSAL": causal},
        )
        dp_ints = {"N": "i32", "R": "i32", "BATCH": "i32", "H": "i32", "qk_scale": "fp32", "sm_scale": "fp32"}
        yield (f"dp/{tag}", _bwd_dp_kernel, bwd | {"DP": ptr, "SCRATCH": f32} | dp_ints, common | {"CAUSAL": causal})
    yield ("preprocess", _bwd_preprocess, {"OUT": ptr, "DO": ptr, "DELTA": f32, "N": "i32"}, {"D": d, "BLOCK": block})


def _ptxas(ptx: str, arch: int) -> str:
    """Registers and spills by Triton's bundled ptxas -v."""
    import re
    from pathlib import Path

    import triton.backends.nvidia as nvidia

    ptxas = Path(nvidia.__file__).parent / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    done = subprocess.run(
        [str(ptxas), f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True, check=False
    )
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if regs is None:
        return f"regs=? ({done.stderr.strip()[-200:]})"
    return f"regs={regs.group(1):>3} spills={spills.group(1)}/{spills.group(2)}B" if spills else f"regs={regs.group(1)}"


def compile_check(arch: int, dump: str | None) -> int:
    """Compiles every kernel variant for sm_`arch`; prints shared memory, registers, spills, and how many of the
    loop's loads the pipeliner made asynchronous (the scratch reads must not be among them: they follow a
    barrier)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = 0
    for dtype, block in (("fp16", 64), ("fp32", 32)):
        for label, kernel, signature, constexprs in _kernel_variants(dtype, block):
            names = [p.name for p in kernel.params]
            sig = {n: signature.get(n, "constexpr") for n in names}
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
            src = ASTSource(kernel, signature=sig, constexprs=constexprs, attrs=attrs)
            try:
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=LAUNCH_OPTIONS)
            except Exception as err:  # report every kernel, not the first failure only
                failures += 1
                print(f"FAIL {dtype} {label}: {type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}")
                continue
            ttgir = compiled.asm["ttgir"]
            asynchronous = ttgir.count("ttg.async_copy_global_to_local")
            print(
                f"ok   {dtype} B={block:<3} {label:22s} shared={compiled.metadata.shared:6d}B "
                f"{_ptxas(compiled.asm['ptx'], arch)} async_loads={asynchronous}"
            )
            if dump:
                with open(os.path.join(dump, f"{dtype}_{label.replace('/', '_')}.ttgir"), "w") as f:
                    f.write(ttgir)
    return failures


# ------------------------------------------------------------------------------------------------------------
# --check and --bench (GPU)
# ------------------------------------------------------------------------------------------------------------
def _inputs(b: int, h: int, n: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen, device=device, dtype=dtype) for _ in range(3))
    table = torch.randn(h, 2 * n - 1, d, generator=gen, device=device, dtype=dtype)
    do = torch.randn(b, h, n, d, generator=gen, device=device, dtype=dtype)
    return q, k, v, table, do


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max |a − e|, relative ℓ2) in float64."""
    a, e = actual.double(), expected.double()
    return (a - e).abs().max().item(), ((a - e).norm() / e.norm().clamp_min(1e-300)).item()


#: relative ℓ2 allowed (relgen.testing: eight rounding units for fp16, 2e-5 for fp32)
REL_L2 = {torch.float16: 8 * 2.0**-10, torch.float32: 2e-5}


def check(device: str, sizes: tuple[int, ...] = (64, 200, 1000)) -> bool:
    """Every method's output and LSE, and the gradients, against the float64 reference; two backwards bitwise
    equal. Prints one line per case; returns whether every case passed."""
    ok = True
    names = ("o", "lse", "dq", "dk", "dv", "dP")
    for dtype in (torch.float16, torch.float32):
        for causal in (False, True):
            for n in sizes:
                q, k, v, table, do = _inputs(1, 2, n, 64, dtype, device)
                leaves = [t.double().requires_grad_() for t in (q, k, v, table)]
                ref_o, ref_lse = reference(*leaves, causal)
                expected = [ref_o, ref_lse, *torch.autograd.grad(ref_o, leaves, do.double())]
                for method in METHODS:
                    o, lse = attention_lse(q, k, v, table, causal, method=method)
                    got = [o, lse]
                    if method == "reuse":  # the backward does not depend on the forward's skew
                        mine = [t.clone().requires_grad_() for t in (q, k, v, table)]
                        out = attention(*mine, causal, method=method)
                        grads = torch.autograd.grad(out, mine, do)
                        again = torch.autograd.grad(attention(*mine, causal, method=method), mine, do)
                        same = all(torch.equal(x, y) for x, y in zip(grads, again, strict=True))
                        got += list(grads)
                    parts, passed = [], True
                    for name, a, e in zip(names, got, expected, strict=False):
                        _err, rel = _errors(a, e)
                        passed &= bool(torch.isfinite(a).all()) and rel <= REL_L2[dtype]
                        parts.append(f"{name} {rel:.1e}")
                    if method == "reuse":
                        parts.append(f"bitwise-deterministic={same}")
                        passed &= same
                    ok &= passed
                    print(
                        f"{'ok  ' if passed else 'FAIL'} {str(dtype)[6:]:8s} causal={causal!s:5s} N={n:<5d} "
                        f"{method:8s} rel-l2: " + " ".join(parts),
                        flush=True,
                    )
    return ok


def _timed(fn, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


def _peak(fn) -> float:
    """MiB allocated at the peak of fn() beyond what was allocated before."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _bench_length(n: int, b: int, h: int, d: int, causal: bool, rep_ms: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, table, do = _inputs(b, h, n, d, torch.float16, "cuda")
    f_fwd, f_bwd = (credited_flops(b, h, n, d, causal, p) for p in ("fwd", "bwd"))

    def line(system: str, fwd_ms: float, fwd_peak: float, bwd: tuple[float, float] | None, note: str) -> None:
        row = f"{n:>7} {system:10s} {fwd_ms:9.3f} {f_fwd / fwd_ms / 1e9:8.1f} "
        if bwd is None:
            row += f"{'':9s} {'':8s} {fwd_peak:9.1f} {'':9s}"
        else:
            row += f"{bwd[0]:9.3f} {f_bwd / bwd[0] / 1e9:8.1f} {fwd_peak:9.1f} {bwd[1]:9.1f}"
        print(f"{row}  {note}", flush=True)

    def backward_of(call, leaves: list[torch.Tensor]) -> tuple[float, float]:
        """(ms, peak MiB) of the backward alone, and of forward + backward's peak."""
        out = call(*leaves)
        ms = _timed(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), rep_ms)
        out = None  # the backward's peak below is its own graph's
        return ms, _peak(lambda: torch.autograd.grad(call(*leaves), leaves, do))

    with torch.no_grad():
        base = attention(q, k, v, table, causal, method="reuse")
    for method in METHODS:

        def call(*xs, method=method):
            return attention(*xs, causal, method=method)

        with torch.no_grad():
            fwd_ms = _timed(lambda: call(q, k, v, table), rep_ms)
            fwd_peak = _peak(lambda: call(q, k, v, table))
            diff = (call(q, k, v, table) - base).abs().max().item()
        # one backward for all methods: it does not depend on the forward's skew
        bwd = backward_of(call, [t.clone().requires_grad_() for t in (q, k, v, table)]) if method == "reuse" else None
        line(method, fwd_ms, fwd_peak, bwd, f"max |O − O_reuse| = {diff:.2e}")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):

        def sdpa(*xs):
            return torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=causal)

        with torch.no_grad():
            fwd_ms = _timed(lambda: sdpa(q, k, v), rep_ms)
            fwd_peak = _peak(lambda: sdpa(q, k, v))
        bwd = backward_of(sdpa, [t.clone().requires_grad_() for t in (q, k, v)])
    line("sdpa-flash", fwd_ms, fwd_peak, bwd, "(no relation term; credited the same FLOPs)")


def bench(seq_lens: list[int], b: int, h: int, d: int, causal: bool, rep_ms: int) -> None:
    print(
        f"B={b} H={h} d={d} fp16 causal={causal}; credited FLOPs: forward 4BHN²d + 2BHN(2N−1)d, backward twice"
        f" that{', both halved (causal)' if causal else ''}. Peak: MiB allocated beyond the inputs (q, k, v, P, dO);"
        " the backward's peak is that of forward + backward."
    )
    print(
        f"{'N':>7} {'system':10s} {'fwd ms':>9} {'TFLOP/s':>8} {'bwd ms':>9} {'TFLOP/s':>8} {'fwd peak':>9} "
        f"{'bwd peak':>9}"
    )
    for n in seq_lens:
        _bench_length(n, b, h, d, causal, rep_ms)
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="small-N exactness against float64 (GPU or CPU)")
    parser.add_argument("--bench", action="store_true", help="time every method against SDPA (GPU)")
    parser.add_argument("--compile-check", action="store_true", help="compile every kernel for --arch, no GPU")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dump-ttgir", default=None, metavar="DIR", help="with --compile-check: write each TTGIR")
    parser.add_argument("--seq-lens", default="8192,32768")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=60, help="do_bench's rep (ms) per measurement")
    args = parser.parse_args()
    if args.compile_check:
        if _interpreted():  # compile for real: the kernels must be JIT functions, not interpreted ones
            env = {**os.environ, "TRITON_INTERPRET": "0"}
            return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode
        return 1 if compile_check(args.arch, args.dump_ttgir) else 0
    status = 0
    if args.check:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        status |= 0 if check(device, (64, 200, 1000) if device == "cuda" else (48, 67)) else 1
    if args.bench:
        bench(
            [int(x) for x in args.seq_lens.split(",")], args.batch, args.heads, args.head_dim, args.causal, args.rep_ms
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
