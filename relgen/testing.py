"""The tolerance criterion, in one place: every test, benchmark check and `relgen verify` calls `check_close`.

A tensor `actual` computed in `dtype` (the kernels' input dtype) is compared with `expected` (the FP64 oracle of
`relgen.reference`). Both are cast to float64 (exact for every input dtype) and two errors are measured:

* relative ℓ2:  ‖a − e‖₂ / ‖e‖₂;
* elementwise:  |a − e| against a per-element allowance.

A tensor passes if EITHER criterion holds:

=================  =====================================================  ==========================================
dtype              elementwise (everywhere)                               relative ℓ2
=================  =====================================================  ==========================================
float16, bfloat16  |a − e| ≤ 0.05·|e| + 0.03   (paper §5.1, Correctness)  ≤ 8 rounding units: 8·2⁻¹⁰ = 0.78 % (fp16),
                                                                          8·2⁻⁷ = 6.25 % (bf16)
float32, float64   |a − e| ≤ 1e-5·|e| + 1e-5·max|e| + 2e-6                ≤ 2e-5
=================  =====================================================  ==========================================

The half-precision rule is the paper's ("within 5 % relative and 0.03 absolute error, or a relative ℓ2 error
within eight rounding units of the target data type (0.78 % for FP16)"; its rounding unit is the machine epsilon
2⁻ᵖ, p the stored mantissa bits). FP32 asks for ~1e-5 relative: an exact algorithm whose only error is the
FP32 rounding of long sums (reduction order differs from the oracle's), with an absolute part scaled by the
tensor's own magnitude so that tiny entries of a large tensor are not held to a relative bound, and a 2e-6 floor
(inputs of unit scale) for gradients that cancel exactly, e.g. a table whose one row every pair reads.

Special cases: a NaN anywhere in `actual` fails; an infinity passes only where `expected` holds the same infinity
(e.g. LSE = −inf of a row without keys), other non-finite values fail. If `expected` is zero, the tensor passes
iff max|a| ≤ 1e-5 (float32/64: the rounding noise of a gradient that cancels exactly, e.g. dQ with a single key)
or 0.03 (half types). Zero means max|e| ≤ 1e-12: the FP64 oracle sums a gradient that cancels exactly (dÃ of a
table row that every pair reads: Σ_j dS_ij = 0) to a residue of ~1e-15, not to 0, and that residue must not move
the tensor from this rule to the 2e-6 floor above (it did: a random spec's fp32 dÃ^Q of 2.03e-6 against an
expected −2.6e-15 failed, while an exact 0 would have passed). 1e-12 lies six orders of
magnitude below the smallest allowance, so no tensor the elementwise rule could tell from zero is taken for zero.
Shapes must match exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tolerance", "assert_as_close_as_own", "assert_close", "check_close", "dropout_keep_mask", "tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """Pass if |a − e| ≤ rel·|e| + abs_ + rel_to_max·max|e| everywhere, or ‖a − e‖/‖e‖ ≤ rel_l2."""

    rel: float
    abs_: float
    rel_to_max: float
    rel_l2: float
    zero_abs: float  # when `expected` is zero (max|e| ≤ ZERO): max|a| allowed

    def describe(self) -> str:
        parts = [f"{self.rel:g}·|e|"]
        if self.abs_:
            parts.append(f"{self.abs_:g}")
        if self.rel_to_max:
            parts.append(f"{self.rel_to_max:g}·max|e|")
        return f"|a−e| ≤ {' + '.join(parts)} everywhere, or rel ℓ2 ≤ {self.rel_l2:.4g}"


#: max|e| at or below which `expected` counts as zero: the FP64 oracle's residue of a sum that cancels exactly
ZERO = 1e-12

_FP32 = Tolerance(rel=1e-5, abs_=2e-6, rel_to_max=1e-5, rel_l2=2e-5, zero_abs=1e-5)
_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(rel=0.05, abs_=0.03, rel_to_max=0.0, rel_l2=8 * 2.0**-10, zero_abs=0.03),
    torch.bfloat16: Tolerance(rel=0.05, abs_=0.03, rel_to_max=0.0, rel_l2=8 * 2.0**-7, zero_abs=0.03),
    torch.float32: _FP32,
    torch.float64: _FP32,
}


def tolerance(dtype: torch.dtype | str) -> Tolerance:
    """The tolerance for outputs of kernels run in `dtype` (a torch dtype or its name, e.g. "float16")."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}
        dtype = getattr(torch, aliases.get(name, name), None)
    if dtype not in _TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}: expected one of {[str(d) for d in _TOLERANCES]}")
    return _TOLERANCES[dtype]


def check_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | str, name: str = "", device=None
) -> tuple[bool, str]:
    """(passed, message) for `actual` against `expected` under the tolerance of `dtype`; the message gives both
    errors and, on failure, the worst element. Evaluated in float64 on `device` (default: `actual`'s own, so a
    GPU tensor is judged on the GPU without a copy to the host)."""
    tol = tolerance(dtype)
    label = f"{name}: " if name else ""
    a = torch.as_tensor(actual).detach()
    a = a.to(device=device if device is not None else a.device, dtype=torch.float64)
    e = torch.as_tensor(expected).detach().to(device=a.device, dtype=torch.float64)
    if a.shape != e.shape:
        return False, f"{label}shape mismatch: actual {list(a.shape)} vs expected {list(e.shape)}"
    if a.numel() == 0:
        return True, f"{label}empty tensors"

    if torch.isnan(e).any():
        return False, f"{label}expected holds NaN at {_index(torch.isnan(e), e.shape)}"
    if torch.isnan(a).any():
        return False, f"{label}actual holds NaN at {_index(torch.isnan(a), a.shape)} ({int(torch.isnan(a).sum())} NaN)"
    same_inf = torch.isinf(a) & torch.isinf(e) & (a == e)
    bad_inf = (torch.isinf(a) | torch.isinf(e)) & ~same_inf
    if bad_inf.any():
        at = _index(bad_inf, a.shape)
        flat = bad_inf.flatten().nonzero()[0, 0]
        return False, (
            f"{label}non-finite mismatch at {at}: actual {a.flatten()[flat].item()!r}, "
            f"expected {e.flatten()[flat].item()!r}"
        )
    finite = ~same_inf
    a, e = a[finite], e[finite]
    if a.numel() == 0:
        return True, f"{label}all entries are matching infinities"

    e_max = float(e.abs().max())
    if e_max <= ZERO:
        a_max = float(a.abs().max())
        kind = "all zero" if e_max == 0.0 else f"zero up to FP64 rounding (max|e| = {e_max:.1e})"
        return a_max <= tol.zero_abs, f"{label}expected is {kind}: max|a| = {a_max:.3e} (limit {tol.zero_abs:g})"

    diff = (a - e).abs()
    err_max = float(diff.max())
    rel_l2 = float(torch.linalg.vector_norm(diff)) / float(torch.linalg.vector_norm(e))
    allowed = tol.rel * e.abs() + tol.abs_ + tol.rel_to_max * e_max
    excess = diff / allowed
    worst = int(torch.argmax(excess))
    over = diff > allowed  # NaN is handled above, so "not over" is "within the allowance"
    elementwise_ok = not bool(over.any())
    l2_ok = rel_l2 <= tol.rel_l2
    ok = elementwise_ok or l2_ok
    message = (
        f"{label}{'ok' if ok else 'FAILED'} ({dtype_name(dtype)}): rel ℓ2 = {rel_l2:.3e} "
        f"(limit {tol.rel_l2:.3e}, {'ok' if l2_ok else 'over'}); max |a−e| = {err_max:.3e}, "
        f"worst element uses {float(excess[worst]):.3g}× its allowance "
        f"(actual {float(a[worst]):.6g}, expected {float(e[worst]):.6g}; "
        f"{int(over.sum())}/{diff.numel()} over); criterion: {tol.describe()}"
    )
    return ok, message


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | str, name: str = "") -> None:
    """Raise AssertionError with `check_close`'s message if `actual` is not close to `expected`."""
    ok, message = check_close(actual, expected, dtype, name)
    if not ok:
        raise AssertionError(message)


def assert_as_close_as_own(
    actual: torch.Tensor,
    own: torch.Tensor,
    expected: torch.Tensor,
    name: str = "",
    factor: float = 1.5,
    floor: float = 1e-3,
) -> None:
    """Raise AssertionError unless `actual`, a patched model's result under autocast, is at most `factor` times as
    far from `expected` (the same model in float64) as `own` (the unpatched model under the same autocast) is, plus
    `floor`, both as relative ℓ2 errors. Under autocast the model's own layers round in half precision as well, so
    a whole model drifts further than one attention call may (`check_close`): the unpatched model's own error is
    the bound that "matches the unpatched model" sets."""
    if actual.shape != expected.shape or own.shape != expected.shape:
        shapes = [list(x.shape) for x in (actual, own, expected)]
        raise AssertionError(f"{name}: shape mismatch: actual, own and expected are {shapes}")
    e = expected.detach().to(torch.float64)
    norm = float(torch.linalg.vector_norm(e))
    if norm == 0.0 or not torch.isfinite(e).all():
        raise AssertionError(f"{name}: expected must be finite and not all zero")
    error, own_error = (
        float(torch.linalg.vector_norm(x.detach().to(e.device, torch.float64) - e)) / norm for x in (actual, own)
    )
    bound = factor * own_error + floor
    if not error <= bound:  # also NaN
        raise AssertionError(
            f"{name}: FAILED: rel ℓ2 against float64 {error:.3e}, the unpatched model's own {own_error:.3e} "
            f"(limit {factor:g}× own + {floor:g} = {bound:.3e})"
        )


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _index(mask: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    flat = int(mask.flatten().nonzero()[0, 0])
    return tuple(int(x) for x in _unravel(flat, shape))


def _unravel(flat: int, shape: torch.Size) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return out[::-1] if out else [0]


def dropout_keep_mask(
    shape: tuple[int, int, int, int],
    p: float,
    seed: int | torch.Tensor,
    device="cpu",
    *,
    q_offset: int = 0,
    k_offset: int = 0,
) -> torch.Tensor:
    """The bool keep mask [B, H, Nq, Nk] (True = kept) that a call with `dropout_p=p, dropout_seed=seed` and these
    `q_offset`, `k_offset` draws inside the kernels: the same counter-based stream (relgen.runtime.dropout), regenerated
    by torch code, never stored. It depends on the absolute positions only, so the mask of a part of a sequence
    (a chunk at its offsets) is that part of the whole sequence's mask. Packed sequences: [S, H, max_seqlen,
    max_seqlen], offsets 0. A tensor seed is read once on the host."""
    from relgen.runtime.dropout_stream import keep_mask

    if len(shape) != 4:
        raise ValueError(f"shape: expected (B, H, Nq, Nk), got {shape!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p: expected a number in [0, 1), got {p!r}")
    for name, offset in (("q_offset", q_offset), ("k_offset", k_offset)):
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {offset!r}")
    return keep_mask(tuple(int(s) for s in shape), p, int(seed), device, q_offset, k_offset)
