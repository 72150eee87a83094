"""The fp16 storage of the stored projections (relgen.runtime.scales): each buffer scaled by a power of two chosen on
the device (Z̃ from the largest entry its writers computed, dZ̃ from a bound), so that inputs whose relation products
or gradients leave fp16's range stay exact, and calls need no host check (CUDA graphs)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import assert_all_close, make_inputs

import relgen
from relgen import config, reference
from relgen.codegen import generator as codegen
from relgen.runtime import storage as projection_storage
from relgen.runtime.arguments import prepare_call
from relgen.runtime.scales import STORE_LIMIT, pow2_scales
from relgen.testing import check_close

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
FP16_MAX = 65504.0


@pytest.fixture
def storage(monkeypatch):
    """config.set_projection_storage for one test (the process's choice comes back after it)."""
    monkeypatch.setattr(projection_storage, "_storage", [])
    monkeypatch.delenv(config.PROJECTION_STORAGE_ENV, raising=False)
    return config.set_projection_storage


# -- the scale ----------------------------------------------------------------------------------------------------
@triton.jit
def _scales_kernel(BOUND, OUT, n, BLOCK: tl.constexpr):
    for i in range(0, n):
        down, up = pow2_scales(tl.load(BOUND + i))
        tl.store(OUT + 2 * i, down)
        tl.store(OUT + 2 * i + 1, up)


def _scales(bounds: list[float]) -> list[tuple[float, float]]:
    bound = torch.tensor(bounds, dtype=torch.float32, device=DEVICE)
    out = torch.empty(2 * len(bounds), dtype=torch.float32, device=DEVICE)
    _scales_kernel[(1,)](bound, out, len(bounds), BLOCK=1)
    return [tuple(pair) for pair in out.view(-1, 2).tolist()]


@given(st.floats(min_value=2.0**-84, max_value=3e38, allow_subnormal=False))
@settings(max_examples=40, deadline=None)
def test_the_scale_is_the_largest_power_of_two_that_keeps_the_bound_in_fp16(bound):
    """For every bound from 2^-84 (below 2^-85, the clamp s ≥ −100 holds): 2^-s is the largest power of two with
    bound·2^-s ≤ 65248 (fp16's largest number less 256), and 2^s its exact inverse."""
    bound = float(torch.tensor(bound, dtype=torch.float32))
    ((down, up),) = _scales([bound])
    mantissa, exponent = math.frexp(down)
    assert mantissa == 0.5 and down * up == 1.0
    assert STORE_LIMIT.value == 65504 - 256
    assert STORE_LIMIT.value / 2 < bound * down <= STORE_LIMIT.value, (bound, exponent)


def test_the_scale_of_extreme_bounds_stays_a_normal_fp32_power_of_two():
    """A zero (or subnormal) bound and one past fp32's range (inf: bf16 products that overflow fp32) give the
    clamped ends 2^±100 and 2^∓114 rather than 0 or inf."""
    for (down, up), want in zip(_scales([0.0, 1e-45, float("inf")]), (100, 100, -114), strict=True):
        assert (down, up) == (2.0**want, 2.0**-want)


@given(st.integers(0, 2**31 - 1), st.floats(min_value=2.0**-30, max_value=65248.0))
@settings(max_examples=25, deadline=None)
def test_a_scaled_store_is_never_less_exact_than_an_unscaled_one(seed, bound):
    """Entries |z| ≤ bound ≤ 65248 (which an unscaled fp16 store holds without overflow) come back from the scaled
    store at least as exactly as from the unscaled one, entry by entry; and entries beyond fp16's range come
    back finite, within fp16's relative rounding."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.rand(4096, generator=gen, dtype=torch.float64) * 2 - 1) * bound
    z = z * torch.pow(2.0, -torch.randint(0, 40, (4096,), generator=gen).double())  # also tiny entries
    z = z.float()
    ((down, up),) = _scales([float(z.abs().max())])
    scaled = (z * down).half().float() * up
    plain = z.half().float()
    assert torch.all((scaled.double() - z.double()).abs() <= (plain.double() - z.double()).abs())
    loud = z * 2.0**30  # up to 7·10^13
    ((down, up),) = _scales([float(loud.abs().max())])
    back = (loud * down).half().float() * up
    assert torch.isfinite(back).all()
    tiny = loud.abs() < float(loud.abs().max()) * 2.0**-25  # below fp16's normal range after the scale
    err = (back.double() - loud.double()).abs()
    assert torch.all(err[~tiny] <= 2.0**-11 * loud.double().abs()[~tiny])


def _projections(spec, inputs):
    """The generated module's stored projections for these inputs: (Z̃^Q, Z̃^K, their end columns, the maxima)."""
    module = relgen.compile_mechanism(spec).module
    tables = [inputs.tables.get(t) for t in ("aq", "ak", "bias")]
    call = prepare_call(module.PLAN, inputs.q, inputs.k, inputs.v, *tables)
    geo = call.geo
    return module._projections(call.q, call.k, geo.expand(call.aq, call.ak, call.bias), geo, geo.config)


@pytest.mark.parametrize("loud", [1.0, 300.0], ids=["ordinary", "beyond fp16"])
def test_the_writers_fold_each_sides_largest_entry(storage, loud):
    """Z̃^Q's and Z̃^K's writers fold the largest |entry| they computed (q_i·a^Q_r + b_r, k_j·a^K_r) into the [2]
    maxima, against float64: the loudest token is the middle one, whose window reaches every row of the map. Beyond
    fp16's range the buffers are written again at 2^-s, so that no stored entry overflows."""
    spec = relgen.load_spec({"name": "maxima", **HUGE["clipped"]})
    inputs = make_inputs(spec, b=1, h=2, nq=20, d=16, dtype=torch.float16, device=DEVICE, seed=4)
    with torch.no_grad():
        inputs.q[:, :, 10].mul_(3.0 * loud)
        inputs.k[:, :, 10].mul_(3.0 * loud)
        for table in inputs.tables.values():
            table.mul_(loud)
    zq, zk, zqe, zke, maxima = _projections(spec, inputs)
    q, k = inputs.q.double(), inputs.k.double()
    aq, ak, bias = (inputs.tables[name].double() for name in ("aq", "ak", "bias"))
    want_q = float((q @ aq.transpose(-1, -2) + bias[:, None, :]).abs().max())
    want_k = float((k @ ak.transpose(-1, -2)).abs().max())
    assert maxima.tolist() == pytest.approx([want_q, want_k], rel=1e-5)
    assert (want_q > FP16_MAX) == (loud > 1.0)
    for buffer in (zq, zk, zqe, zke):
        assert buffer.dtype == torch.float16 and torch.isfinite(buffer).all()


@pytest.mark.parametrize("where", ["first", "last"])
def test_one_loud_block_of_queries_is_exact(storage, where):
    """The forward writes Z̃^Q itself (gen.fused_zq), each program its block at the block's own scale, and the
    backward writes the buffer again at one scale before its passes read it: one block of queries whose products
    leave fp16's range (~10^5) among ordinary ones (~10^3), first or last in the order the blocks run. Each group
    of rows is judged at its own scale: a quiet row read at the loud block's scale is off by 2^s, which the loud
    rows' magnitudes would hide."""
    spec = relgen.load_spec({"name": "loud_block", "scale": 2e-4, **HUGE["clipped"]})
    assert codegen.GenerationFlags.from_plan(relgen.compile_mechanism(spec).plan).fused_zq
    inputs = make_inputs(spec, b=1, h=2, nq=70, d=16, dtype=torch.float16, device=DEVICE, seed=6)
    loud = torch.arange(0, 5) if where == "first" else torch.arange(65, 70)
    quiet = torch.tensor([i for i in range(70) if i not in loud.tolist()])
    with torch.no_grad():
        inputs.tables["aq"].mul_(1000)
        inputs.q[:, :, loud] *= 30
        products = inputs.q.double() @ inputs.tables["aq"].double().transpose(-1, -2)
        assert float(products[:, :, quiet].abs().max()) < STORE_LIMIT.value < float(products[:, :, loud].abs().max())
    _assert_exact(spec, inputs.leaves, _incoming(inputs.q.shape), f"one loud block of queries, {where}",
                  tokens=(loud, quiet))  # fmt: skip


def test_bound_tensors_start_from_zero(storage):
    """Z̃'s writers and the backward's preprocessing fold atomic maxima into the tensors they are given (Z̃'s largest
    entries, dZ̃'s bound), which must start at zero whatever memory they get: with every fp32 tensor torch.empty
    returns first filled with 10^30, the output and the gradients still match float64."""
    clipped = {"kind": "clipped", "min": -3, "max": 3}
    spec = relgen.load_spec({"name": "slots", "terms": ["query", "key"], "map": clipped})
    inputs = make_inputs(spec, b=1, h=2, nq=16, d=16, dtype=torch.float16, device=DEVICE, seed=2)
    real_empty = torch.empty

    def poisoned(*shape, **kw):
        out = real_empty(*shape, **kw)
        if out.dtype == torch.float32:
            out.fill_(1e30)  # a slot left unwritten would make its bound, and the scale 2^-s, absurd
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty", poisoned)
        _assert_exact(spec, inputs.leaves, _incoming(inputs.q.shape), "bound slots filled with 1e30 first")


def test_no_half_precision_call_checks_or_synchronises(storage):
    """The default storage is the scaled fp16 one, and its geometry has no host check left to run."""
    from relgen.runtime.geometry import Geometry

    assert config.projection_storage() == "fp16"
    assert not hasattr(Geometry, "check_stored") and not hasattr(Geometry, "check_gradient")


# -- exactness beyond fp16's range ---------------------------------------------------------------------------------
#: relation products far beyond fp16's range on a clipped map (bias folded into Z̃^Q), an identity map (query and
#: key terms) and the atomic path (±δ share rows), with τ small enough that the scores stay ordinary
HUGE = {
    "clipped": {"terms": ["query", "key", "bias"], "map": {"kind": "clipped", "min": -6, "max": 6}},
    "identity": {"terms": ["query", "key"], "map": {"kind": "identity"}},
    "atomic": {"terms": ["query", "bias"], "map": {"kind": "expression", "expr": "Min(Abs(delta), 4)", "rows": 5}},
}


def _huge_inputs(name: str, n: int = 24):
    spec = relgen.load_spec({"name": f"huge_{name}", "scale": 2e-6, **HUGE[name]})
    inputs = make_inputs(spec, b=1, h=2, nq=n, d=16, dtype=torch.float16, device=DEVICE, seed=5)
    with torch.no_grad():
        inputs.q.mul_(40)  # |q| ~ 40, |a| ~ 2000: |q·a| ~ 10^6
        for table in ("aq", "ak"):
            if table in inputs.tables:
                inputs.tables[table].mul_(4000)
        if "bias" in inputs.tables:
            inputs.tables["bias"].mul_(3e5)  # b̃ ~ 3·10^5, folded into Z̃^Q where the spec has a query term
    return spec, inputs


def _assert_exact(
    spec, leaves: dict[str, torch.Tensor], do: torch.Tensor, context: str, unit: bool = True, tokens=None
) -> None:
    """relgen's output and gradients of <do, O> against the FP64 reference's, by the fp16 criterion. With `unit`,
    each tensor (both sides) is multiplied first by the power of two that brings its expected max|e| into
    [0.5, 1): the criterion's absolute allowance (0.03) is meant for tensors of unit scale, and would pass any
    tiny one. `tokens`: groups of token positions (index tensors) whose rows of O, dq, dk and dv are also judged
    apart, each at its own scale."""
    names = list(leaves)
    wide = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    ref = reference.attention(spec, *(wide[n] for n in names[:3]), **{n: wide[n] for n in names[3:]})
    want = torch.autograd.grad(ref, list(wide.values()), do.double())
    out = relgen.compile_mechanism(spec)(*(leaves[n] for n in names[:3]), **{n: leaves[n] for n in names[3:]})
    got = torch.autograd.grad(out, list(leaves.values()), do)
    for name, a, e in zip(["out", *(f"d{n}" for n in names)], (out.detach(), *got), (ref.detach(), *want), strict=True):
        assert torch.isfinite(a).all(), f"{context}, {name}: not finite"
        parts = [("", a, e)]
        if tokens is not None and name in ("out", "dq", "dk", "dv"):
            parts += [(f" tokens {i}", a[:, :, i], e[:, :, i]) for i in tokens]
        for where, a_part, e_part in parts:
            top = float(e_part.abs().max())
            factor = 2.0 ** -math.frexp(top)[1] if unit and top > 0 else 1.0
            ok, message = check_close(a_part.double() * factor, e_part * factor, torch.float16)
            assert ok, f"{context}, {name}{where} (times {factor:g}): {message}"


def _incoming(shape, scale: float = 1.0, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).half().to(DEVICE)


@pytest.mark.parametrize("name", sorted(HUGE))
def test_relation_products_far_beyond_fp16_are_exact(storage, name):
    spec, inputs = _huge_inputs(name)
    plan = relgen.compile_mechanism(spec).plan
    assert plan.path == ("atomic" if name == "atomic" else "offset")
    with torch.no_grad():  # the premise: Z̃^Q is far beyond fp16's range
        products = inputs.q.double() @ inputs.tables["aq"].double().transpose(-1, -2)
        assert float(products.abs().max()) > 10 * FP16_MAX
    _assert_exact(spec, inputs.leaves, _incoming(inputs.q.shape), f"{name}: Z̃ far beyond fp16's range")


def test_key_gradients_beyond_fp16_are_exact(storage):
    """dZ̃^K's boundary columns sum ~24 queries' dS of ~4000 each (uniform attention over values at ±125, dO =
    100): ~10^5, beyond fp16, while each gradient stays inside it. A key term only: dZ̃^K is the buffer stored."""
    terms = {"terms": ["key"], "map": {"kind": "clipped", "min": -2, "max": 2}, "scale": 1}
    spec = relgen.load_spec({"name": "loud_key", **terms})
    n = 48
    gen = torch.Generator().manual_seed(0)

    def small(*shape):
        return (torch.randn(*shape, generator=gen) * 1e-3).half().to(DEVICE).requires_grad_()

    sign = torch.where(torch.arange(n) < n // 2, 1.0, -1.0)[:, None].expand(n, 16)
    v = (125 * sign).reshape(1, 1, n, 16).half().to(DEVICE).requires_grad_()
    leaves = {"q": small(1, 1, n, 16), "k": small(1, 1, n, 16), "v": v, "ak": small(1, 5, 16)}
    do = torch.full((1, 1, n, 16), 100.0, dtype=torch.float16, device=DEVICE)
    # at their own scale (O cancels: values at ±125 under uniform attention), as the criterion has them
    _assert_exact(spec, leaves, do, "dZ̃^K beyond fp16's range", unit=False)


def test_a_tiny_incoming_gradient_keeps_fp16s_precision(storage):
    """dO ~ 2^-14: the dZ̃ entries (~10^-6, fp16 subnormals unscaled) are stored scaled up (s < 0), and every
    gradient meets the criterion at its own scale."""
    terms = {"terms": ["query", "key"], "map": {"kind": "clipped", "min": -4, "max": 4}}
    spec = relgen.load_spec({"name": "tiny", **terms})
    inputs = make_inputs(spec, b=1, h=1, nq=40, d=16, dtype=torch.float16, device=DEVICE, seed=2)
    _assert_exact(spec, inputs.leaves, _incoming(inputs.q.shape, 2.0**-14), "dO ~ 2^-14")


# -- on a GPU: fp16 and bf16 at 1K-8K, and CUDA graphs ----------------------------------------------------------
GPU_SPECS = ("shaw", "txl", "deberta_v3", "t5")


def _shipped(name: str):
    from pathlib import Path

    return relgen.load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")


def _scaled(inputs, factor: float):
    """q and the tables times `factor` (their products grow by factor²), as new leaves."""
    with torch.no_grad():
        leaves = {n: (t * factor if n in ("q", "aq", "ak") else t).detach() for n, t in inputs.leaves.items()}
    leaves = {n: t.requires_grad_() for n, t in leaves.items()}
    return type(inputs)(leaves["q"], leaves["k"], leaves["v"], {n: leaves[n] for n in inputs.tables})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n", [1024, 4096, 8192])
@pytest.mark.parametrize("name", GPU_SPECS)
def test_shipped_specs_are_exact_under_the_fp16_storage(storage, name, n, dtype):
    """Ordinary inputs, and q and tables ×64 (|x·a| up to ~10^5 with τ = 1/8: scores of ~10^4 would saturate
    the softmax, so τ is scaled down alike, 1/(8·64²))."""
    from test_gpu import compare_large  # the decomposed FP64 reference: the pairwise one holds N² relation rows

    spec = _shipped(name)
    inputs = make_inputs(spec, b=1, h=2, nq=n, d=64, dtype=dtype, device="cuda", seed=n)
    assert_all_close(compare_large(spec, inputs, dtype), f"{name}, N={n}, {dtype}")
    loud = _scaled(inputs, 64.0)
    tau = 1.0 / (8 * 64.0**2)
    assert_all_close(compare_large(spec, loud, dtype, scale=tau), f"{name}, N={n}, {dtype}, q and tables ×64")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(HUGE))
def test_huge_relation_products_on_the_gpu(storage, name, dtype):
    spec, inputs = _huge_inputs(name, n=1024)
    leaves = {n: t.detach().to(dtype if t.dtype == torch.float16 else t.dtype) for n, t in inputs.leaves.items()}
    leaves = {n: t.requires_grad_() for n, t in leaves.items()}
    _assert_exact(spec, leaves, _incoming(inputs.q.shape).to(dtype), f"{name}, {dtype}: Z̃ far beyond fp16's range")


@pytest.mark.gpu
def test_the_fp16_storage_runs_under_cuda_graph_capture(storage):
    """Forward and backward captured in one CUDA graph and replayed on new inputs (huge ones, then ordinary
    ones): each replay gives the eager call's results bit for bit, and nothing in the call refuses capture."""
    spec, inputs = _huge_inputs("clipped", n=1024)
    fn = relgen.compile_mechanism(spec)
    ordinary = make_inputs(spec, b=1, h=2, nq=1024, d=16, dtype=torch.float16, device="cuda", seed=9)
    static = [t.detach().clone().requires_grad_() for t in ordinary.leaves.values()]
    do = _incoming(inputs.q.shape)

    def step():
        out = fn(*static[:3], aq=static[3], ak=static[4], bias=static[5])
        return (out, *torch.autograd.grad(out, static, do))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: every kernel compiled and cached outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for source in (inputs.leaves.values(), ordinary.leaves.values()):
        with torch.no_grad():
            for s, t in zip(static, source, strict=True):
                s.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for got, want in zip(captured, eager, strict=True):
            assert torch.equal(got, want)
