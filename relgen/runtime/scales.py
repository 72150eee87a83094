"""The fp16 storage of the stored projections Z̃ and their gradients dZ̃: a power-of-two scale per buffer, chosen on
the device before the kernels that write the buffer run, so that no entry can leave fp16's range.

Each buffer has an upper bound β on |entry| that follows from the inputs alone:

* Z̃^Q = q·ã^Q (+ b̃ where folded): |q_i·ã_s + b̃_s| ≤ max_i ‖q_i‖ · max_r ‖a_r‖ + max_r |b_r| (Cauchy–Schwarz; the
  expanded rows ã_s are copies of the table's rows a_r). Z̃^K alike with k and ã^K.
* dZ̃ holds τ·dS summed over pairs that share a column (docs/algorithm.md, sections 5 and 7,
  derive both bounds).
  With dP_ij = dO_i·v_j, D_i = dO_i·O_i and P'_ij = P_ij·keep_ij/(1 − p): |dS_ij| ≤ 2·P_ij·‖dO_i‖·max‖v‖/(1 − p),
  so an entry of a query row is at most β_Q = 2τ·max‖dO‖·max‖v‖/(1 − p) (Σ_j P_ij ≤ 1), and one of a key row
  at most Nq·β_Q (it sums over up to Nq queries).

`projection_bounds` (for Z̃) and the backward's preprocessing kernel (for dZ̃) compute the maxima in one launch
each, over a grid wide enough to stream q, k (or dO and V) at the device's bandwidth: each program reduces its
share of the rows on chip and folds its maxima into a zeroed [factors] tensor with one atomic maximum per factor.
A maximum of non-negative fp32 numbers does not depend on the order its operands arrive in, so the result is the
same bits whatever the programs' order (the backward stays bitwise deterministic). Each kernel that reads a bound
loads the maxima, turns them into β and β into the scale with `pow2_scales`:
2^-s is the largest power of two with β·2^-s ≤ STORE_LIMIT = 65248 = 65504 − 256, fp16's largest number less
a margin for the rounding of the bound itself (an fp32 sum over d terms: relative 10⁻⁵ at d = 256). Writers
multiply by 2^-s before the fp16 store, readers by 2^s after the load: multiplications by powers of two, exact.

The scale of dZ̃ also lifts small buffers (s < 0): a buffer whose entries are all tiny (e.g. dZ̃ for a small dO)
keeps them in fp16's normal range rather than among its subnormals. Whenever β ≤ STORE_LIMIT (an unscaled fp16
store could not overflow), s ≤ 0, and every entry is stored at least as exactly as the unscaled store would store
it. Z̃ takes s ≥ 0 (`unlifted_scales`): ordinary inputs store it exactly as the unscaled store does, and the
forward's band tiles, which read an entry per score, then run without the multiplication by 2^s.
Otherwise entries keep fp16's relative error 2⁻¹¹ down to |entry| ≥ 2^-14·2^s and have an absolute error
≤ 2^(s−25) below, where 2^s < β/32624: an underflow of at most β·2⁻⁴⁰, against the buffer's own bound. Nothing is
read back on the host, so calls stay capturable in CUDA graphs.

bf16 inputs whose products exceed fp32's range (|x·a| > 3.4·10³⁸) overflow in the kernels' fp32 accumulators
whatever the storage; s is clamped to [−100, 114] so that 2^±s stay normal fp32 numbers for every bound."""

from __future__ import annotations

from typing import NamedTuple

import torch

from relgen.backend import configure_triton

configure_triton()  # before this module's kernels are defined: Triton's interpreter when there is no CUDA device

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from relgen.runtime.launch import Launcher  # noqa: E402
from relgen.tiles.configs import head_block  # noqa: E402

#: the most a scaled entry may reach: fp16's largest number 65504 less 256 (0.4 %)
STORE_LIMIT = tl.constexpr(65248.0)
#: elements (rows × padded head dim) each program of a bound launch reads at a time: 32 fp32 values a thread with
#: _BOUND_WARPS warps, so that many programs fit on each SM and keep enough loads in flight
_BLOCK_ELEMENTS = 4096
_BOUND_WARPS = 4
#: most programs of a bound launch (beyond, each loops over several blocks): it bounds the atomic maxima that meet
#: at one address (16K tokens of 12 heads at d = 64 are 3,072 blocks, three a program)
MAX_BOUND_PROGRAMS = 1024
#: memory order of the programs' atomic maxima: only later launches read the maxima, and a launch boundary orders
#: every write before them, so the atomics need no fence of their own
_ATOMIC_SEM = "acq_rel"


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
    """pow2_scales with s ≥ 0: a buffer whose bound fits fp16 is stored as it is (2^0), so that its readers can
    skip the multiplication by 2^s (Z̃, whose band entries the forward reads once per score)."""
    down, up = pow2_scales(bound)
    fits = bound <= STORE_LIMIT
    return tl.where(fits, 1.0, down), tl.where(fits, 1.0, up)


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


@triton.jit
def _side_maxima(
    OUT,
    X,
    sx_b,
    sx_h,
    sx_n,
    HX,
    NX,
    x_rows,
    A,
    sa,
    a_rows,
    B,
    b_rows,
    pid,
    programs,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    BT_B: tl.constexpr,
    SEM: tl.constexpr,
):
    """Fold this program's maxima of ‖x_t‖ (tokens), ‖a_r‖ (rows [a_rows, D]) and |b_r| into OUT[0..2]."""
    tl.atomic_max(OUT, max_row_norm(X, sx_b, sx_h, sx_n, HX, NX, x_rows, pid, programs, D, BD, BT), sem=SEM)
    tl.atomic_max(OUT + 1, max_row_norm(A, 0, 0, sa, 1, a_rows, a_rows, pid, programs, D, BD, BT), sem=SEM)
    tl.atomic_max(OUT + 2, max_row_norm(B, 0, 0, 1, 1, b_rows, b_rows, pid, programs, 1, 1, BT_B), sem=SEM)


@Launcher
@triton.jit
def _projection_bounds_kernel(
    OUT,
    Q,
    sq_b,
    sq_h,
    sq_n,
    HQ,
    NQ,
    q_rows,
    AQ,
    saq,
    aq_rows,
    BQ,
    bq_rows,
    K,
    sk_b,
    sk_h,
    sk_n,
    HK,
    NK,
    k_rows,
    AK,
    sak,
    ak_rows,
    BK,
    bk_rows,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    BT_B: tl.constexpr,
    SEM: tl.constexpr,
):
    """OUT [6] (zeroed): max ‖q‖, ‖a^Q‖, |b^Q|, ‖k‖, ‖a^K‖, |b^K| over this program's share of the rows."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    _side_maxima(OUT, Q, sq_b, sq_h, sq_n, HQ, NQ, q_rows, AQ, saq, aq_rows, BQ, bq_rows, pid, programs,
                 D, BD, BT, BT_B, SEM)  # fmt: skip
    _side_maxima(OUT + 3, K, sk_b, sk_h, sk_n, HK, NK, k_rows, AK, sak, ak_rows, BK, bk_rows, pid, programs,
                 D, BD, BT, BT_B, SEM)  # fmt: skip


def projection_bounds(
    q: torch.Tensor,
    aq: torch.Tensor | None,
    bq: torch.Tensor | None,
    k: torch.Tensor,
    ak: torch.Tensor | None,
    bk: torch.Tensor | None,
) -> torch.Tensor:
    """The factors of the bounds on |Z̃^Q| and |Z̃^K|: a [6] fp32 tensor of max ‖q_t‖, ‖a^Q_r‖, |b^Q_r|, ‖k_t‖,
    ‖a^K_r‖, |b^K_r| (a side without a table: q or k not read, all 0). q, k: [B, H, N, d] or packed [total, H, d]
    tokens, read through their strides (no copy); aq, ak: a table's rows [rows, d]; bq, bk: vectors. One launch
    after a zeroing, no synchronisation."""
    out = torch.zeros(6, device=q.device, dtype=torch.float32)
    d = q.shape[-1]
    block_d = head_block(d)
    rows = _BLOCK_ELEMENTS // block_d
    sides = _side(q, aq, bq, out), _side(k, ak, bk, out)
    most = max(n for side in sides for n in (side.x_rows, side.a_rows))  # a bias vector has no more rows than its table
    programs = min(max(triton.cdiv(most, rows), 1), MAX_BOUND_PROGRAMS)
    constexprs = {"D": d, "BD": block_d, "BT": rows, "BT_B": _BLOCK_ELEMENTS, "SEM": _ATOMIC_SEM}
    _projection_bounds_kernel[(programs,)](out, *sides[0], *sides[1], **constexprs, num_warps=_BOUND_WARPS)
    return out


class _Side(NamedTuple):
    """One side's arguments of _projection_bounds_kernel, in its order."""

    x: torch.Tensor
    sx_b: int
    sx_h: int
    sx_n: int
    heads: int
    tokens: int
    x_rows: int
    a: torch.Tensor
    sa: int
    a_rows: int
    b: torch.Tensor
    b_rows: int


def _side(x: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, dummy: torch.Tensor) -> _Side:
    """One side's arguments: no rows to read where the side has no table."""
    if a is None:
        return _Side(dummy, 0, 0, 0, 1, 1, 0, dummy, 0, 0, dummy, 0)
    bias = (b, b.shape[0]) if b is not None else (dummy, 0)
    return _Side(x, *token_rows(x), a, a.stride(0), a.shape[0], *bias)


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
