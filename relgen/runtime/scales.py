"""The fp16 storage of the stored projections Z̃ and their gradients dZ̃: a power-of-two scale per buffer, so that no
entry leaves fp16's range, chosen on the device (nothing is read back on the host: calls stay capturable in CUDA
graphs).

* Z̃ (q·ã^Q, k·ã^K, with b̃ where folded) is written as it is: every program that writes entries also folds the
  largest |entry| it computed (in fp32, before the store) into a zeroed [2] tensor, one atomic maximum per
  program and side. Where that maximum M exceeds STORE_LIMIT, which only inputs far from ordinary reach, the
  buffer is written again, each entry times 2^-s (`unlifted_scales(M)`), by a second launch of the writer whose
  programs all return at once when M fits; readers multiply by 2^s, which is 1 whenever M fits. The forward's own
  rows of Z̃^Q (written by the program that reads them back) take their block's own scale, and the backward
  writes them again at one scale before it reads them, again only where M exceeds fp16's range. So no launch
  reads q or k only to bound them, and ordinary inputs store exactly what an unscaled fp16 store holds.
* dZ̃ holds τ·dS summed over pairs that share a column (docs/algorithm.md, sections 5 and 7, derive the bound).
  With dP_ij = dO_i·v_j, D_i = dO_i·O_i and P'_ij = P_ij·keep_ij/(1 − p): |dS_ij| ≤ 2·P_ij·‖dO_i‖·max‖v‖/(1 − p),
  so an entry of a query row is at most β_Q = 2τ·max‖dO‖·max‖v‖/(1 − p) (Σ_j P_ij ≤ 1), and one of a key row
  at most Nq·β_Q (it sums over up to Nq queries). The backward's preprocessing kernel, which streams dO anyway,
  folds the two factors into a zeroed [2] tensor by atomic maxima over a full grid; its kernels then scale by
  `pow2_scales(β)`, which also lifts small buffers (s < 0): a dZ̃ whose entries are all tiny (e.g. for a small dO)
  keeps them in fp16's normal range rather than among its subnormals.

A maximum of non-negative fp32 numbers does not depend on the order its operands arrive in, so every maximum is
the same bits whatever the programs' order (the backward stays bitwise deterministic). 2^-s is the largest power
of two with β·2^-s ≤ STORE_LIMIT = 65248 = 65504 − 256, fp16's largest number less a margin (for dZ̃'s bound: an
fp32 sum over d terms, relative 10⁻⁵ at d = 256; for Z̃, the rounding of the second writer's products against the
first's). Writers multiply by 2^-s before the fp16 store, readers by 2^s after the load: multiplications by powers
of two, exact. Whenever β ≤ STORE_LIMIT, s ≤ 0, and every entry is stored at least as exactly as the unscaled
store would store it. Otherwise entries keep fp16's relative error 2⁻¹¹ down to |entry| ≥ 2^-14·2^s and have an
absolute error ≤ 2^(s−25) below, where 2^s < β/32624: an underflow of at most β·2⁻⁴⁰, against the buffer's own
bound.

bf16 inputs whose products exceed fp32's range (|x·a| > 3.4·10³⁸) overflow in the kernels' fp32 accumulators
whatever the storage; s is clamped to [−100, 114] so that 2^±s stay normal fp32 numbers for every bound."""

from __future__ import annotations

import torch

from relgen.backend import configure_triton

configure_triton()  # before this module's kernels are defined: Triton's interpreter when there is no CUDA device

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: the most a scaled entry may reach: fp16's largest number 65504 less 256 (0.4 %)
STORE_LIMIT = tl.constexpr(65248.0)


@triton.jit
def _pow2(s):
    """2^s for an integer s in [−126, 127]: the fp32 number with that exponent and no mantissa bits (exact)."""
    return ((127 + s) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_scales(bound):
    """(2^-s, 2^s) for a buffer whose entries are at most `bound` (an fp32 scalar) in magnitude: 2^-s is the
    largest power of two with bound·2^-s ≤ STORE_LIMIT, s clamped to [−100, 114] (see the module)."""
    exponent = (bound.to(tl.int32, bitcast=True) >> 23) & 0xFF  # bound ∈ [2^(e−127), 2^(e−126))
    s = tl.minimum(tl.maximum(exponent - 142, -100), 114)  # unclamped: bound·2^-s ∈ [2^15, 2^16)
    s = tl.minimum(s + (bound * _pow2(-s) > STORE_LIMIT).to(tl.int32), 114)
    return _pow2(-s), _pow2(s)


@triton.jit
def unlifted_scales(bound):
    """pow2_scales with s ≥ 0 (Z̃'s scale, from the largest |entry| its writers computed): a buffer that fits fp16
    is stored as it is (2^0), so that its readers can skip the multiplication by 2^s (the forward's band tiles
    read an entry per score)."""
    down, up = pow2_scales(bound)
    fits = bound <= STORE_LIMIT
    return tl.where(fits, 1.0, down), tl.where(fits, 1.0, up)


@triton.jit
def fold_max(BOUND, value):
    """BOUND[0] = max(BOUND[0], value), value a non-negative fp32 scalar: one program's share of a maximum. Relaxed
    order: only later launches read the maxima, and a launch boundary orders them; the default acq_rel order would
    hold the program until its earlier stores (Z̃'s rows) drained and the atomic returned, before its next loads."""
    tl.atomic_max(BOUND, value, sem="relaxed")


@triton.jit
def row_norms(x):
    """‖x_t‖₂ of each row of an fp32 block [BT, BD]. Each row is scaled by its largest magnitude before it is
    squared, so that no bf16 row's norm overflows fp32."""
    x = tl.abs(x)
    top = tl.max(x, 1)
    unit = x * (1.0 / tl.where(top > 0, top, 1.0))[:, None]  # a reciprocal a row, not a division an entry
    return top * tl.sqrt(tl.sum(unit * unit, 1))


@triton.jit
def max_row_norm(
    X, s_b, s_h, s_n, H, N, rows, pid, programs, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr
):
    """max ‖x_t‖₂ over this program's share of the rows t = (b·H + h)·N + n of X [B, H, N, HEAD_DIM] (0 if none)."""
    offs_d = tl.arange(0, BLOCK_D)
    best = tl.zeros([BLOCK_T], tl.float32)
    for r0 in range(pid * BLOCK_T, rows, programs * BLOCK_T):
        t = r0 + tl.arange(0, BLOCK_T)
        bh = t // N
        row = (bh // H).to(tl.int64) * s_b + (bh % H).to(tl.int64) * s_h + (t % N).to(tl.int64) * s_n
        ok = (t < rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
        x = tl.load(X + row[:, None] + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        best = tl.maximum(best, row_norms(x))
    return tl.max(best, 0)


def token_rows(x: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(batch, head, token strides, H, N, rows) of [B, H, N, d] tokens, packed [total, H, d] tokens (no batch
    stride, N = total) or rows [rows, d] (one head)."""
    if x.dim() == 4:
        b, h, n = x.shape[:3]
        return x.stride(0), x.stride(1), x.stride(2), h, n, b * h * n
    if x.dim() == 3:
        return 0, x.stride(1), x.stride(0), x.shape[1], x.shape[0], x.shape[0] * x.shape[1]
    if x.dim() != 2:
        raise ValueError(f"x: expected [B, H, N, d], [total, H, d] or [rows, d], got shape {list(x.shape)}")
    return 0, 0, x.stride(0), 1, max(x.shape[0], 1), x.shape[0]
