"""Every call argument is untrusted: a bad one is a ValueError naming it (NotImplementedError for what relgen does
not support) before it reaches torch or Triton, every shape the forward accepts has a backward, and no stored
buffer overflows or is clamped silently."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kernel_cases import assert_all_close, compare, load, make_inputs
from tiers import SLOW

import relgen
from relgen import backend, config, reference
from relgen.runtime import storage as projection_storage
from relgen.runtime.arguments import MAX_POSITION, SEED_LIMIT, prepare_call, reach
from relgen.runtime.mechanism import MAX_REPLANNED_WINDOW
from relgen.testing import check_close

ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
#: a map the analyzer cannot prove constant beyond its analysed window (interval arithmetic cannot cancel
#: delta - delta), which relgen re-plans for longer reaches
UNPROVEN = {
    "name": "unproven",
    "terms": ["bias"],
    "map": {"kind": "expression", "expr": "floor(Max(Min(delta, 5), -5) / 2) + 5 + delta - delta", "rows": 11},
}


def call(name, b=2, h=2, n=8, **options):
    spec = load(name)
    inputs = make_inputs(spec, b=b, h=h, nq=n, d=16, device=DEVICE)
    return relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)


@pytest.fixture
def storage(monkeypatch):
    """config.set_projection_storage for one test (the process's choice comes back after it)."""
    monkeypatch.setattr(projection_storage, "_storage", [])
    monkeypatch.delenv(config.PROJECTION_STORAGE_ENV, raising=False)
    return config.set_projection_storage


# -- scalar options ----------------------------------------------------------------------------------------------
BAD_OPTIONS = [
    ("q_offset", "3"),
    ("q_offset", None),
    ("q_offset", True),
    ("q_offset", 1.5),
    ("q_offset", -1),
    ("q_offset", 2**64),
    ("q_offset", torch.tensor(3)),
    ("k_offset", 2**63),
    ("k_offset", MAX_POSITION + 1),
    ("q_offset", MAX_POSITION - 3),  # q_offset + Nq beyond the largest position
    ("dropout_seed", -1),
    ("dropout_seed", SEED_LIMIT),
    ("dropout_seed", 2**64),
    ("dropout_seed", True),
    ("dropout_seed", 1.0),
    ("dropout_p", float("nan")),
    ("dropout_p", True),
    ("dropout_p", "0.1"),
    ("dropout_p", torch.tensor(0.1)),
    ("scale", float("nan")),
    ("scale", float("inf")),
    ("scale", -1.0),
    ("scale", 1e-40),  # 0 (or subnormal) in fp32
    ("scale", 1e39),  # inf in fp32
    ("scale", 3e38),  # finite in fp32, but τ·log2(e) is not
    ("scale", "0.5"),
    ("scale", True),
    ("key_padding_mask", [[True] * 8] * 2),
    ("return_lse", "yes"),
    ("recompute_projections", 1),
]


@pytest.mark.parametrize("name", ["t5", UNPROVEN], ids=["t5", "unproven"])
@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS, ids=[f"{o}={v!r}"[:40] for o, v in BAD_OPTIONS])
def test_a_bad_option_is_a_value_error_naming_it(name, option, value):
    with pytest.raises(ValueError, match=rf"^{option}\b"):
        call(name, **{option: value})


def test_integer_options_accept_numpy_integers():
    import numpy as np

    plan = relgen.compile_mechanism(load("shaw")).module.PLAN
    inputs = make_inputs(load("shaw"), b=1, h=2, nq=8, d=16, device=DEVICE)
    args = (inputs.q, inputs.k, inputs.v, inputs.tables["aq"], None, None)
    want = prepare_call(plan, *args, q_offset=3, k_offset=1).geo
    assert prepare_call(plan, *args, q_offset=np.int64(3), k_offset=np.int32(1)).geo == want


def test_the_largest_seed_draws_what_its_tensor_draws():
    """Seeds up to 2**63 − 1 reach the kernels (an int64 seed tensor holds the same values)."""
    spec = load("t5")
    inputs = make_inputs(spec, b=1, h=2, nq=24, d=16, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    seed = SEED_LIMIT - 1
    by_int = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.5, dropout_seed=seed)
    tensor = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
    by_tensor = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.5, dropout_seed=tensor)
    assert torch.equal(by_int, by_tensor)
    other = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.5, dropout_seed=seed - 1)
    assert not torch.equal(by_int, other)


@pytest.mark.parametrize("name", ["t5", UNPROVEN], ids=["t5", "unproven"])
def test_bad_tensors_are_value_errors_naming_them(name):
    spec = load(name)
    inputs = make_inputs(spec, b=1, h=2, nq=8, d=16, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    bad = {
        "q": [inputs.q.tolist(), inputs.q.detach().to("meta"), inputs.q.detach().numpy(force=True)],
        "k": [None, inputs.k.detach().to(torch.int32)],
    }
    for which, values in bad.items():
        for value in values:
            args = {"q": inputs.q, "k": inputs.k, "v": inputs.v, which: value}
            with pytest.raises(ValueError, match=rf"^{which}\b"):
                fn(args["q"], args["k"], args["v"], **inputs.tables)
    with pytest.raises(ValueError, match=r"^q, k: sequence lengths"):  # N = 0 is refused
        fn(inputs.q[:, :, :0], inputs.k, inputs.v, **inputs.tables)


# -- packed sequences -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["t5", UNPROVEN], ids=["t5", "unproven"])
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("cu_seqlens", torch.tensor([[0, 4, 10]], dtype=torch.int32)),  # 2-D
        ("cu_seqlens", [0, 4, 10]),
        ("cu_seqlens", torch.tensor([0.0, 4.0, 10.0])),
        ("cu_seqlens", torch.tensor([0], dtype=torch.int32)),
        ("max_seqlen", 10**9),  # beyond the 10 tokens present
        ("max_seqlen", True),
        ("max_seqlen", "6"),
        ("max_seqlen", 5),  # below the longest sequence
    ],
    ids=lambda value: repr(value)[:24] if not isinstance(value, str) else value,
)
def test_bad_packing_is_a_value_error_naming_it(name, option, value):
    spec = load(name)
    fn = relgen.compile_mechanism(spec)
    q, k, v = (torch.randn(10, 2, 16, device=DEVICE) for _ in range(3))
    options = {"cu_seqlens": torch.tensor([0, 4, 10], dtype=torch.int32), "max_seqlen": 6, option: value}
    if isinstance(options["cu_seqlens"], torch.Tensor):
        options["cu_seqlens"] = options["cu_seqlens"].to(DEVICE)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=rf"^{option}\b"):
        fn(q, k, v, bias=torch.randn(2, 11 if name == UNPROVEN else 32, device=DEVICE), **options)
    assert time.perf_counter() - started < 5  # refused, not run over a window of 10**9


def test_max_seqlen_may_be_every_token():
    spec = load("txl")
    lengths = [4, 6]
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    base = make_inputs(spec, b=1, h=2, nq=10, d=16, device=DEVICE)  # tables for L = max_seqlen = 10
    gen = torch.Generator().manual_seed(1)
    packed = [torch.randn(sum(lengths), 2, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(3)]
    inputs = type(base)(*packed, base.tables)
    assert_all_close(compare(spec, inputs, cu_seqlens=cu, max_seqlen=10), "max_seqlen = total")


# -- every shape the forward accepts has a backward -------------------------------------------------------------
@pytest.mark.parametrize("name", ["shaw", "t5", "txl", "wav2vec2_bert"])
@pytest.mark.parametrize(("b", "h"), [(0, 2), (2, 0)])
def test_an_empty_batch_runs_forward_and_backward(name, b, h):
    spec = load(name)
    inputs = make_inputs(spec, b=b, h=h, nq=8, d=16, device=DEVICE)
    out = relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables)
    assert out.shape == (b, h, 8, 16)
    leaves = list(inputs.leaves.values())
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    for leaf, grad in zip(leaves, grads, strict=True):
        assert grad.shape == leaf.shape and torch.all(grad == 0)  # no token: nothing reaches a table either


def test_packed_sequences_without_tokens_run_forward_and_backward():
    spec = load("shaw")
    fn = relgen.compile_mechanism(spec)
    q, k, v = (torch.randn(0, 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    aq = torch.randn(2, 513, 16, device=DEVICE, requires_grad=True)
    out = fn(q, k, v, aq=aq, cu_seqlens=torch.tensor([0, 0], dtype=torch.int32, device=DEVICE))
    grads = torch.autograd.grad(out, [q, k, v, aq], torch.ones_like(out))
    assert out.shape == (0, 2, 16) and torch.all(grads[-1] == 0)


# -- maps whose saturation is unproven: planned for the offsets' difference ------------------------------------
def test_an_unproven_map_is_planned_for_what_the_offsets_reach():
    """A KV cache far along (offsets near 2^24) reaches only |δ| < Nq + Nk: no window of 2^24 is analysed."""
    spec = load(UNPROVEN)
    fn = relgen.compile_mechanism(spec)
    far = 1 << 24
    inputs = make_inputs(spec, b=1, h=2, nq=12, nk=20, d=16, device=DEVICE)
    options = {"q_offset": far + 8, "k_offset": far}
    assert reach(fn.module.PLAN, inputs.q, inputs.k, inputs.v, options) == 20  # δ ∈ [8 − 19, 8 + 11]
    assert fn.module_for(20).PLAN.valid_up_to == 32  # the next power of two: planned for 32 offsets, not 2^24
    assert_all_close(compare(spec, inputs, **options), "offsets near 2^24")


def test_an_unproven_map_refuses_a_reach_beyond_the_replanning_limit():
    spec = load(UNPROVEN)
    inputs = make_inputs(spec, b=1, h=2, nq=8, d=16, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"^q_offset, k_offset: .*MAX_REPLANNED_WINDOW"):
        fn(inputs.q, inputs.k, inputs.v, **inputs.tables, q_offset=MAX_REPLANNED_WINDOW + 1)
    assert time.perf_counter() - started < 5


# -- the spec's τ at the call's head dimension ------------------------------------------------------------------
@pytest.mark.parametrize(("scale", "d"), [("1/(d-16)", 16), ("1/(d-32)", 16), ("sqrt(d-32)", 16), ("exp(d)", 128)])
def test_the_specs_scale_is_checked_at_the_calls_head_dim(scale, d):
    """Each is positive and finite at d = 64 (where a spec's scale is checked when loaded), not at this d; a spec
    loader that checks every head dimension may refuse it earlier: either way the error names `scale`."""
    spec = {"name": "per_d", "terms": ["bias"], "map": {"kind": "clipped", "min": -4, "max": 4}, "scale": scale}
    q = torch.randn(1, 2, 8, d, device=DEVICE)
    with pytest.raises(ValueError, match=r"scale"):
        relgen.compile_mechanism(spec)(q, q, q, bias=torch.randn(2, 9, device=DEVICE))


# -- stored projections never overflow silently --------------------------------------------------------------
LOUD = {"name": "loud", "terms": ["query", "bias"], "map": {"kind": "clipped", "min": -8, "max": 8}, "scale": 1e-4}


def _loud_inputs(dtype):
    """|q·a^Q| up to 72000, beyond fp16's 65504, while τ = 1e-4 keeps the scores ordinary (q·k alone is fine)."""
    spec = load(LOUD)
    inputs = make_inputs(spec, b=1, h=2, nq=24, d=16, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        inputs.tables["aq"].copy_(300 * torch.sign(inputs.tables["aq"]))
        inputs.q.copy_(20 * torch.sign(inputs.q))
    return spec, inputs


@pytest.mark.parametrize("mode", config.PROJECTION_STORAGES)
def test_relation_terms_beyond_fp16_are_exact(storage, mode):
    storage(mode)
    spec, inputs = _loud_inputs(torch.float16)
    assert_all_close(compare(spec, inputs), f"Z̃ beyond fp16's range, {mode} storage")


def _loud_gradient():
    """dZ̃^Q's boundary columns sum ~24 scores' dS of ~4200 each (keys of one half of v at +125, the other at
    −125, under uniform attention): ~10^5, beyond fp16, while every gradient and each dS stays inside it."""
    spec = load({"name": "loud_grad", "terms": ["query"], "map": {"kind": "clipped", "min": -2, "max": 2}, "scale": 1})
    n = 48
    gen = torch.Generator().manual_seed(0)

    def small(*shape):
        return (torch.randn(*shape, generator=gen) * 1e-3).half().to(DEVICE).requires_grad_()

    sign = torch.where(torch.arange(n) < n // 2, 1.0, -1.0)[:, None].expand(n, 16)
    v = (125 * sign).reshape(1, 1, n, 16).half().to(DEVICE).requires_grad_()
    leaves = [small(1, 1, n, 16), small(1, 1, n, 16), v, small(1, 5, 16)]
    do = torch.full((1, 1, n, 16), 100.0, dtype=torch.float16, device=DEVICE)
    return spec, leaves, do


@pytest.mark.parametrize("mode", config.PROJECTION_STORAGES)
def test_gradient_buffers_beyond_fp16_are_exact(storage, mode):
    storage(mode)
    spec, leaves, do = _loud_gradient()
    wide = [t.detach().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(reference.attention(spec, *wide[:3], aq=wide[3]), wide, do.double())
    out = relgen.compile_mechanism(spec)(*leaves[:3], aq=leaves[3])
    got = torch.autograd.grad(out, leaves, do)
    for name, a, e in zip(("dq", "dk", "dv", "daq"), got, want, strict=True):
        ok, message = check_close(a, e, torch.float16)
        assert ok, f"{name}: {message}"


@SLOW
@pytest.mark.parametrize("mode", config.PROJECTION_STORAGES)
def test_each_storage_is_exact_on_ordinary_inputs(storage, mode):
    storage(mode)
    spec = load("shaw")
    inputs = make_inputs(spec, b=1, h=2, nq=20, d=16, dtype=torch.float16, device=DEVICE)
    assert_all_close(compare(spec, inputs), f"{mode} storage")


@pytest.mark.parametrize(
    ("mode", "dtype", "z", "dz"),
    [
        ("fp32", torch.float16, torch.float32, torch.float32),
        ("fp32", torch.bfloat16, torch.float32, torch.float32),
        ("fp16", torch.float16, torch.float16, torch.float16),
        ("fp16", torch.bfloat16, torch.float16, torch.float32),
        ("fp16", torch.float32, torch.float32, torch.float32),
    ],
)
def test_storage_dtypes(storage, mode, dtype, z, dz):
    """Switching the storage reaches calls whose signature was kept before. (The inputs' dtype is the Geometry's
    only: the interpreter refuses bf16 calls.)"""
    spec = load("shaw")
    plan = relgen.compile_mechanism(spec).module.PLAN
    inputs = make_inputs(spec, b=1, h=2, nq=20, d=16, device=DEVICE)
    args = (inputs.q, inputs.k, inputs.v, inputs.tables["aq"], None, None)
    prepare_call(plan, *args)  # kept under the default storage
    storage(mode)
    geo = replace(prepare_call(plan, *args).geo, dtype=dtype)
    assert (geo.z_dtype, geo.dz_dtype, geo.gradient_buffer(torch.device(DEVICE)).dtype) == (z, dz, dz)


def test_the_storage_setting_is_checked(storage, monkeypatch):
    with pytest.raises(ValueError, match=r"^mode: "):
        storage("bf16")
    monkeypatch.setenv(config.PROJECTION_STORAGE_ENV, "fp8")
    with pytest.raises(ValueError, match=rf"^{config.PROJECTION_STORAGE_ENV}: "):
        config.projection_storage()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", config.PROJECTION_STORAGES)
def test_bf16_relation_terms_beyond_fp16_are_exact(storage, mode):
    """bf16 inputs whose relation products exceed fp16's range: scaled into it (fp16 storage), or kept in fp32."""
    storage(mode)
    spec, inputs = _loud_inputs(torch.bfloat16)
    assert_all_close(compare(spec, inputs), f"bf16, Z̃ beyond fp16's range, {mode} storage")


# -- Triton's interpreter -----------------------------------------------------------------------------------------
@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's bf16 refusal (CPU only)")
def test_bf16_is_refused_in_the_interpreter():
    spec = load("shaw")
    inputs = make_inputs(spec, b=1, h=2, nq=8, d=16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"^q: bfloat16 .* interpreter"):
        relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables)


@pytest.mark.parametrize(
    ("version", "refused"), [("2.3.5", False), ("1.26.4", False), ("2.4.0", True), ("2.10.1", True)]
)
def test_the_interpreter_needs_numpy_below_2_4(version, refused):
    if not refused:
        backend.check_interpreter_numpy(version)
        return
    with pytest.raises(RuntimeError, match=r"install numpy<2.4") as info:
        backend.check_interpreter_numpy(version)
    assert "\n" not in str(info.value)


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["RELGEN_CACHE_DIR"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )


@SLOW
@pytest.mark.skipif(HAS_CUDA, reason="a machine without a CUDA device")
def test_the_python_api_sets_up_the_interpreter_itself(tmp_path):
    code = (
        "import os, torch, relgen\n"
        "fn = relgen.compile_mechanism('specs/t5.yaml')\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "print(os.environ['TRITON_INTERPRET'], tuple(fn(q, q, q, bias=torch.randn(2, 32)).shape))\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "1 (1, 2, 8, 16)"


@SLOW
@pytest.mark.skipif(HAS_CUDA, reason="a machine without a CUDA device")
def test_kernels_defined_before_the_set_up_fail_in_one_line(tmp_path):
    done = _python("import relgen.runtime.dropout, relgen\nrelgen.compile_mechanism('specs/t5.yaml')\n", tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().split("\n")[-1]
    assert last.startswith("RuntimeError: relgen: no CUDA device") and "TRITON_INTERPRET=1" in last
