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
each, with PARTIALS programs: each writes its partial maxima to its own slot of a [factors, PARTIALS] tensor, so the
tensor needs no zeroing launch and the result no atomics (nor depends on the programs' order); each kernel that
reads a bound takes the maximum of the slots itself (`partial_max`), turns the maxima into β and β into the scale
with `pow2_scales`:
2^-s is the largest power of two with β·2^-s ≤ STORE_LIMIT = 65248 = 65504 − 256, fp16's largest number less
a margin for the rounding of the bound itself (an fp32 sum over d terms: relative 10⁻⁵ at d = 256). Writers
multiply by 2^-s before the fp16 store, readers by 2^s after the load: multiplications by powers of two, exact.

The scale also lifts small buffers (s < 0): a buffer whose entries are all tiny (e.g. dZ̃ for a small dO) keeps
them in fp16's normal range rather than among its subnormals. Whenever β ≤ STORE_LIMIT (an unscaled fp16 store
could not overflow), s ≤ 0, and every entry is stored at least as exactly as the unscaled store would store it.
Otherwise entries keep fp16's relative error 2⁻¹¹ down to |entry| ≥ 2^-14·2^s and have an absolute error
≤ 2^(s−25) below, where 2^s < β/32624: an underflow of at most β·2⁻⁴⁰, against the buffer's own bound. Nothing is
read back on the host, so calls stay capturable in CUDA graphs.

bf16 inputs whose products exceed fp32's range (|x·a| > 3.4·10³⁸) overflow in the kernels' fp32 accumulators
whatever the storage; s is clamped to [−100, 114] so that 2^±s stay normal fp32 numbers for every bound."""

from __future__ import annotations

import torch

from relgen.backend import configure_triton

configure_triton()  # before this module's kernels are defined: Triton's interpreter when there is no CUDA device

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from relgen.runtime.launch import Launcher  # noqa: E402
from relgen.tiles.configs import head_block  # noqa: E402

#: the most a scaled entry may reach: fp16's largest number 65504 less 256 (0.4 %)
STORE_LIMIT = tl.constexpr(65248.0)
#: programs of a bound launch, hence slots per factor of a bounds tensor. Few, because every kernel that reads a
#: bound reduces them (sm_90 compile of Shaw's backward: 256 slots spill 84 B in the query pass, 64 spill 12 B),
#: each reading large blocks (_BLOCK_ELEMENTS, BOUND_WARPS) so that the 64 stream q, k or V at full bandwidth
PARTIALS = tl.constexpr(64)
#: elements (rows × padded head dim) each program of a bound launch reads at a time
_BLOCK_ELEMENTS = 16384
#: warps of a bound launch's programs: 64 fp32 registers a thread for a block of _BLOCK_ELEMENTS
BOUND_WARPS = 8


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
def partial_max(BOUNDS, factor):
    """One factor of a bound: the maximum of its PARTIALS programs' partial maxima (row `factor` of BOUNDS)."""
    return tl.max(tl.load(BOUNDS + factor * PARTIALS + tl.arange(0, PARTIALS)), 0)


@triton.jit
def row_norms(x):
    """‖x_t‖₂ of each row of an fp32 block [BT, BD]. Each row is scaled by its largest magnitude before it is
    squared, so that no bf16 row's norm overflows fp32."""
    x = tl.abs(x)
    top = tl.max(x, 1)
    unit = x / tl.where(top > 0, top, 1.0)[:, None]
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
def _side_partials(
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
):
    """This program's partial maxima of ‖x_t‖ (tokens), ‖a_r‖ (rows [a_rows, D]) and |b_r| to OUT[0..2, pid]."""
    tl.store(OUT + pid, max_row_norm(X, sx_b, sx_h, sx_n, HX, NX, x_rows, pid, programs, D, BD, BT))
    tl.store(OUT + PARTIALS + pid, max_row_norm(A, 0, 0, sa, 1, a_rows, a_rows, pid, programs, D, BD, BT))
    tl.store(OUT + 2 * PARTIALS + pid, max_row_norm(B, 0, 0, 1, 1, b_rows, b_rows, pid, programs, 1, 1, BT_B))


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
):
    """OUT [6, PARTIALS]: this program's partial maxima of ‖q‖, ‖a^Q‖, |b^Q|, ‖k‖, ‖a^K‖, |b^K| (0 for none)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    _side_partials(OUT, Q, sq_b, sq_h, sq_n, HQ, NQ, q_rows, AQ, saq, aq_rows, BQ, bq_rows, pid, programs,
                   D, BD, BT, BT_B)  # fmt: skip
    _side_partials(OUT + 3 * PARTIALS, K, sk_b, sk_h, sk_n, HK, NK, k_rows, AK, sak, ak_rows, BK, bk_rows, pid,
                   programs, D, BD, BT, BT_B)  # fmt: skip


def projection_bounds(
    q: torch.Tensor,
    aq: torch.Tensor | None,
    bq: torch.Tensor | None,
    k: torch.Tensor,
    ak: torch.Tensor | None,
    bk: torch.Tensor | None,
) -> torch.Tensor:
    """The factors of the bounds on |Z̃^Q| and |Z̃^K|: a [6, PARTIALS] fp32 tensor whose rows hold the partial
    maxima of ‖q_t‖, ‖a^Q_r‖, |b^Q_r|, ‖k_t‖, ‖a^K_r‖, |b^K_r| (a side without a table: q or k not read, all 0).
    q, k: [B, H, N, d] or packed [total, H, d] tokens, read through their strides (no copy); aq, ak: a table's rows
    [rows, d]; bq, bk: vectors. One launch, no zeroing, no synchronisation."""
    out = torch.empty((6, PARTIALS.value), device=q.device, dtype=torch.float32)
    d = q.shape[-1]
    block_d = head_block(d)
    _projection_bounds_kernel[(PARTIALS.value,)](
        out, *_side(q, aq, bq, out), *_side(k, ak, bk, out),
        D=d, BD=block_d, BT=_BLOCK_ELEMENTS // block_d, BT_B=_BLOCK_ELEMENTS, num_warps=BOUND_WARPS,
    )  # fmt: skip
    return out


def _side(x: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """One side's arguments of _projection_bounds_kernel: no rows to read where the side has no table."""
    if a is None:
        return (dummy, 0, 0, 0, 1, 1, 0, dummy, 0, 0, dummy, 0)
    bias = (b, b.shape[0]) if b is not None else (dummy, 0)
    return (x, *token_rows(x), a, a.stride(0), a.shape[0], *bias)


def block_rows(head_dim: int) -> int:
    """Rows a program of a bound launch reads at a time, for rows of head_dim entries."""
    return _BLOCK_ELEMENTS // head_block(head_dim)


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
