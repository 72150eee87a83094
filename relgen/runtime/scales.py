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

`row_norm_bounds` writes the maxima (fp32 atomic maxima, so the result does not depend on the programs' order)
into a small tensor that the kernels read; each kernel turns them into β and β into the scale with `pow2_scales`:
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

#: the most a scaled entry may reach: fp16's largest number 65504 less 256 (0.4 %)
STORE_LIMIT = tl.constexpr(65248.0)
#: rows each program of `_row_norm_kernel` reads at a time
_BLOCK_ROWS = 64
#: programs per tensor: enough to stream a large one at full bandwidth, each looping over its share of rows
_MAX_PROGRAMS = 1024


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
def _max_row_norm(
    X, s_b, s_h, s_n, H, N, rows, pid, programs, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr
):
    """max ‖x_t‖₂ over this program's share of the rows t = (b·H + h)·N + n of X [B, H, N, HEAD_DIM]. Each row is
    scaled by its largest entry before it is squared, so that no bf16 row's norm overflows fp32."""
    offs_d = tl.arange(0, BLOCK_D)
    best = tl.zeros([BLOCK_T], tl.float32)
    for r0 in range(pid * BLOCK_T, rows, programs * BLOCK_T):
        t = r0 + tl.arange(0, BLOCK_T)
        bh = t // N
        row = (bh // H).to(tl.int64) * s_b + (bh % H).to(tl.int64) * s_h + (t % N).to(tl.int64) * s_n
        ok = (t < rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
        x = tl.abs(tl.load(X + row[:, None] + offs_d[None, :], mask=ok, other=0.0).to(tl.float32))
        top = tl.max(x, 1)
        unit = x / tl.where(top > 0, top, 1.0)[:, None]
        best = tl.maximum(best, top * tl.sqrt(tl.sum(unit * unit, 1)))
    return tl.max(best, 0)


@triton.jit
def _row_norm_kernel(
    OUT,
    X0,
    s0_b,
    s0_h,
    s0_n,
    H0,
    N0,
    rows0,
    factor0,
    X1,
    s1_b,
    s1_h,
    s1_n,
    H1,
    N1,
    rows1,
    X2,
    rows2,
    PARTS: tl.constexpr,
    D0: tl.constexpr,
    BD0: tl.constexpr,
    D1: tl.constexpr,
    BD1: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """OUT[0] = max(OUT[0], factor0·max‖row of X0‖), OUT[1] alike for X1, OUT[2] for |X2| (a vector); PARTS of
    them (1 to 3)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    tl.atomic_max(OUT, factor0 * _max_row_norm(X0, s0_b, s0_h, s0_n, H0, N0, rows0, pid, programs, D0, BD0, BLOCK_T))
    if PARTS > 1:
        tl.atomic_max(OUT + 1, _max_row_norm(X1, s1_b, s1_h, s1_n, H1, N1, rows1, pid, programs, D1, BD1, BLOCK_T))
    if PARTS > 2:
        tl.atomic_max(OUT + 2, _max_row_norm(X2, 0, 0, 1, 1, rows2, rows2, pid, programs, 1, 1, BLOCK_T))


def row_norm_bounds(
    out: torch.Tensor, x: torch.Tensor, factor: float, y: torch.Tensor | None = None, z: torch.Tensor | None = None
) -> None:
    """out[0:3] = max(out[0:3], (factor·max‖x_t‖, max‖y_r‖, max|z_r|)) over the rows of x, y (each [B, H, N, d]
    tokens, packed [total, H, d] tokens or a table's rows [rows, d], read through their strides: no copy) and the
    vector z; `out` (fp32) holds zeros before its first call. One launch, no synchronisation."""
    parts = 1 if y is None else 2 if z is None else 3
    y = y if y is not None else x
    z = z if z is not None else out
    x_rows, y_rows = _token_rows(x), _token_rows(y)
    z_rows = z.numel() if parts > 2 else 0
    most = max(x_rows[-1], y_rows[-1], z_rows)
    grid = (max(1, min(_MAX_PROGRAMS, triton.cdiv(most, _BLOCK_ROWS))),)
    _row_norm_kernel[grid](
        out, x, *x_rows, float(factor), y, *y_rows, z, z_rows, PARTS=parts,
        D0=x.shape[-1], BD0=_block(x.shape[-1]), D1=y.shape[-1], BD1=_block(y.shape[-1]), BLOCK_T=_BLOCK_ROWS,
    )  # fmt: skip


def _token_rows(x: torch.Tensor) -> tuple[int, int, int, int, int, int]:
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


def _block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))
