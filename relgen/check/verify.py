"""Kernels against the FP64 reference: random inputs for a spec and one comparison, shared by the tests and
`relgen check` (relgen.cli.commands).

The test suite (tests/kernel_cases.py re-exports this module) and `relgen check` share this one implementation;
the tolerance criterion itself is `relgen.testing.check_close`.

    make_inputs(spec, ...)        random q, k, v and the spec's tables (leaf tensors that require grad)
    compare(spec, inputs, ...)    relgen's output and every gradient against relgen.reference.attention
    check_spec(spec, ...)         compare() at a few sequence lengths, as CheckResult rows

`relgen check` exits 0 when every tensor passed, 1 when a tensor failed or a run raised, and otherwise 2 when a
spec could not be loaded or a check was not run: a combination relgen does not support here (NotImplementedError,
e.g. bf16 in Triton's interpreter, whose bf16 dot products are wrong) is reported as NOT RUN with its reason (the
spec's verdict NOT RUN, or INCOMPLETE when other lengths passed), never as a failure or a pass.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from relgen.spec.model import MechanismSpec, load_spec
from relgen.testing import check_close

__all__ = [
    "DEFAULT_SEQ_LENS",
    "CheckResult",
    "Inputs",
    "assert_all_close",
    "check_spec",
    "compare",
    "gradient_runs",
    "make_inputs",
]

#: `relgen check`'s default sequence lengths: one query, an odd length inside one tile, several groups.
DEFAULT_SEQ_LENS = (1, 17, 130)
#: Longest length `relgen check` accepts: the FP64 reference holds B·H·N² scores and their gradients (at 8192,
#: 2 heads: 1 GiB each).
MAX_CHECK_SEQ_LEN = 8192


# ------------------------------------------------------------------------------------------------------------
# inputs and one comparison
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tables: dict[str, torch.Tensor]

    @property
    def leaves(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "k": self.k, "v": self.v, **self.tables}


def make_inputs(
    spec,
    b=1,
    h=2,
    nq=17,
    nk=None,
    d=16,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    length=None,
    bias_dtype=torch.float32,
) -> Inputs:
    """Random inputs (leaves that require grad): q [b, h, nq, d], k, v [b, h, nk, d] and the spec's tables
    (aq, ak scaled by 0.5; bias in `bias_dtype`), sized for the identity map's L = `length` (default max(nq, nk))."""
    spec = load_spec(spec)
    nk = nq if nk is None else nk
    rows = spec.map.num_rows(length or max(nq, nk))
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen, dtype=torch.float32) * scale
        return t.to(device=device, dtype=dtype).requires_grad_()

    shape = (rows, d) if spec.heads_share_tables else (h, rows, d)
    tables = {}
    if spec.has_query:
        tables["aq"] = rand(*shape, scale=0.5)
    if spec.has_key:
        tables["ak"] = rand(*shape, scale=0.5)
    if spec.has_bias:
        tables["bias"] = rand(*shape[:-1]).detach().to(bias_dtype).requires_grad_()
    return Inputs(rand(b, h, nq, d), rand(b, h, nk, d), rand(b, h, nk, d), tables)


#: call options that choose how relgen computes, not what: the reference takes none of them
_RELGEN_ONLY = ("recompute_projections", "dropout_seed", "ablation", "projections", "layers")


def _pairs(spec, inputs: Inputs, check_grads: bool, options: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, relgen's tensor, the FP64 reference's tensor) for the output and, with check_grads, every gradient
    (of <dO, O> for a fixed random dO)."""
    from relgen import reference
    from relgen.runtime.mechanism import compile_mechanism

    fn = compile_mechanism(spec)
    keep_mask = options.pop("keep_mask", None)  # the reference's explicit dropout mask
    out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    ref_options = {k: v for k, v in options.items() if k not in _RELGEN_ONLY}
    if keep_mask is not None:
        ref_options["keep_mask"] = keep_mask
    ref = reference.attention(spec, inputs.q, inputs.k, inputs.v, **inputs.tables, **ref_options)
    pairs = [("out", out, ref)]
    if check_grads:
        gen = torch.Generator(device="cpu").manual_seed(1)
        do = torch.randn(out.shape, generator=gen).to(out.device)
        names, leaves = zip(*inputs.leaves.items(), strict=True)
        got = torch.autograd.grad(out, leaves, do.to(out.dtype), allow_unused=True)
        want = torch.autograd.grad(ref, leaves, do.double(), allow_unused=True)
        for name, g, w in zip(names, got, want, strict=True):
            w = torch.zeros_like(inputs.leaves[name], dtype=torch.float64) if w is None else w
            pairs.append((f"d{name}", g, w))
    return pairs


def compare(spec, inputs: Inputs, dtype=None, check_grads=True, **options) -> list[tuple[str, bool, str]]:
    """Run relgen and the reference; return (name, ok, message) for the output and every gradient.

    `dtype` is the compute dtype whose tolerance judges every tensor (gradients included, also those of fp32
    bias tables): by default the dtype of q."""
    dtype = inputs.q.dtype if dtype is None else dtype
    results = []
    for name, got, want in _pairs(spec, inputs, check_grads, dict(options)):
        if got is None:
            results.append((name, False, "no gradient"))
        else:
            results.append((name, *check_close(got, want, dtype)))
    return results


def assert_all_close(results, context=""):
    failed = [f"{name}: {msg}" for name, ok, msg in results if not ok]
    assert not failed, f"{context}\n" + "\n".join(failed)


def gradient_runs(spec, inputs: Inputs, runs: int = 2, **options) -> list[tuple[torch.Tensor, ...]]:
    """The gradients of every input from `runs` identical forward + backward passes (to compare bitwise)."""
    import relgen

    fn = relgen.compile_mechanism(spec)
    leaves = list(inputs.leaves.values())
    grads = []
    for _ in range(runs):
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
        grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out)))
    return grads


# ------------------------------------------------------------------------------------------------------------
# check_spec: a spec at a few sequence lengths
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckResult:
    """One tensor of one check: the output ("out") or a gradient ("dq", "dk", "dv", "daq", "dak", "dbias")."""

    spec: str  # the spec's name
    seq_len: int
    tensor: str
    ok: bool
    rel_l2: float  # ‖a − e‖₂ / ‖e‖₂; when ‖e‖ = 0 (e.g. dq with one key): max|a| (see `zero_expected`)
    zero_expected: bool
    message: str  # check_close's message
    dtype: str
    head_dim: int
    device: str

    @property
    def error_text(self) -> str:
        if math.isnan(self.rel_l2):
            return "n/a"
        return f"|a|={self.rel_l2:.1e}" if self.zero_expected else f"{self.rel_l2:.2e}"


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, bool]:
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    e = expected.detach().to(device="cpu", dtype=torch.float64)
    if a.shape != e.shape or a.numel() == 0:
        return math.nan, False
    finite = torch.isfinite(e)
    if not finite.all():  # matching infinities are check_close's business; measure the finite part
        a, e = a[finite], e[finite]
        if a.numel() == 0:
            return 0.0, False
    e_norm = float(torch.linalg.vector_norm(e))
    if e_norm == 0.0:
        return float(a.abs().max()), True
    return float(torch.linalg.vector_norm(a - e)) / e_norm, False


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _use_interpreter_on_cpu(device: torch.device) -> None:
    """Kernels on CPU tensors run in Triton's interpreter (must be on before the generated modules load)."""
    from relgen.backend import interpreting

    if device.type == "cpu" and not interpreting():
        os.environ["TRITON_INTERPRET"] = "1"


def check_spec(
    spec: MechanismSpec | dict | str | Path,
    seq_lens: Iterable[int] = DEFAULT_SEQ_LENS,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
) -> list[CheckResult]:
    """Compare the spec's kernels (compile_mechanism) with the FP64 reference at each sequence length N.

    Random inputs, batch 1, 2 heads, seeded by N. Defaults: on the CPU (Triton's interpreter) fp32 and d = 16, on
    a CUDA device fp16 and d = 64. Each tensor is judged by `relgen.testing.check_close` under the tolerance of
    the compute dtype (gradients too). Exceptions (e.g. a kernel that fails to compile) propagate.
    """
    spec = load_spec(spec)
    device = default_device() if device is None else torch.device(device)
    cuda = device.type == "cuda"
    dtype = (torch.float16 if cuda else torch.float32) if dtype is None else dtype
    head_dim = (64 if cuda else 16) if head_dim is None else head_dim
    _use_interpreter_on_cpu(device)
    results = []
    for n in seq_lens:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"seq_lens: expected positive integers, got {n!r}")
        inputs = make_inputs(spec, b=1, h=2, nq=n, d=head_dim, dtype=dtype, device=device, seed=n)
        for name, got, want in _pairs(spec, inputs, True, {}):
            if got is None:
                ok, message, err, zero = False, "no gradient", math.nan, False
            else:
                ok, message = check_close(got, want, dtype)
                err, zero = _errors(got, want)
            results.append(
                CheckResult(
                    spec=spec.name,
                    seq_len=n,
                    tensor=name,
                    ok=ok,
                    rel_l2=err,
                    zero_expected=zero,
                    message=message,
                    dtype=str(dtype).removeprefix("torch."),
                    head_dim=head_dim,
                    device=str(device),
                )
            )
    return results


# ------------------------------------------------------------------------------------------------------------
# relgen check
# ------------------------------------------------------------------------------------------------------------
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def format_table(results: Sequence[CheckResult]) -> list[str]:
    """One row per N, one column per tensor: 'ok 1.23e-07' or 'FAIL 4.56e-02' (rel ℓ2 error)."""
    tensors: list[str] = []
    for r in results:
        if r.tensor not in tensors:
            tensors.append(r.tensor)
    width = 16
    lines = [(f"  {'N':>6}  " + "".join(f"{t:<{width}}" for t in tensors)).rstrip()]
    by_n: dict[int, dict[str, CheckResult]] = {}
    for r in results:
        by_n.setdefault(r.seq_len, {})[r.tensor] = r
    for n, row in by_n.items():
        cells = []
        for t in tensors:
            r = row.get(t)
            cells.append("-" if r is None else f"{'ok' if r.ok else 'FAIL'} {r.error_text}")
        lines.append(f"  {n:>6}  " + "".join(f"{c:<{width}}" for c in cells).rstrip())
    return lines
