"""Local windows (`window: {left, right}` in the spec): the kernels against the FP64 reference, which applies the
window as a plain mask of its own; the spec's errors; and what the analyzer plans for a window."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import assert_all_close, compare, make_inputs
from test_layouts import layout_inputs
from tiers import SLOW, slow_values

import relgen
from relgen.runtime.arguments import reach
from relgen.spec.limits import MAX_SEQ_LEN
from relgen.testing import dropout_keep_mask

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: ±δ share a row: the atomic path
ATOMIC = {
    "name": "atomic",
    "terms": ["query", "bias"],
    "map": {"kind": "expression", "expr": "Min(Abs(delta), 9)", "rows": 10},
}


def windowed(base: str | dict, left: int | None, right: int | None, **changes) -> relgen.MechanismSpec:
    data = dict(base) if isinstance(base, dict) else yaml.safe_load((ROOT / "specs" / f"{base}.yaml").read_text())
    data.update(changes, window={"left": left, "right": right})
    data["name"] = f"{data['name']}_local"
    return relgen.load_spec(data)


def _id(case) -> str:
    return str(case if not isinstance(case, dict) else case["name"])


# -- the kernels against the reference ---------------------------------------------------------------------------
WINDOWED = [
    ("shaw", 5, 0, False, 40, 40, 0, 0),  # a window smaller than a tile
    ("shaw", 20, 7, True, 33, 21, 5, 9),  # causal bounds the right side; offsets
    ("txl", 2, 1, False, 40, 40, 0, 0),  # identity map: only the window's 4 offsets are expanded
    ("txl", None, 3, False, 33, 21, 5, 9),  # left unbounded
    ("txl_uv", 9, None, False, 37, 37, 0, 0),  # right unbounded
    ("t5_decoder", 9, None, None, 40, 40, 0, 0),  # bias only, causal spec
    ("wav2vec2_bert", 100, 100, None, 29, 29, 0, 0),  # a window wider than N: as without one
    (ATOMIC, 6, 4, False, 40, 40, 3, 0),  # the atomic path
]


@pytest.mark.parametrize(
    ("base", "left", "right", "causal", "nq", "nk", "q_offset", "k_offset"),
    slow_values(WINDOWED, slow=[WINDOWED[1], WINDOWED[4], WINDOWED[6]]),
    ids=lambda case: _id(case) if isinstance(case, str | dict) else None,
)
def test_window_matches_the_reference(base, left, right, causal, nq, nk, q_offset, k_offset):
    spec = windowed(base, left, right, **({} if causal is None else {"causal": causal}))
    length = max(q_offset + nq, k_offset + nk)
    inputs = make_inputs(
        spec, b=1, h=2, nq=nq, nk=nk, d=16, device=DEVICE, seed=nq + left if left else nq, length=length
    )
    results = compare(spec, inputs, q_offset=q_offset, k_offset=k_offset)
    assert_all_close(results, f"{_id(base)} window [{left}, {right}] causal={causal}")


@SLOW
def test_window_with_padding_dropout_and_a_row_without_keys():
    spec = windowed("deberta_v3", 3, 2)
    b, h, n, p, seed = 2, 2, 37, 0.25, 5
    inputs = make_inputs(spec, b=b, h=h, nq=n, d=16, device=DEVICE, seed=3)
    mask = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
    mask[1, 10:16] = False  # query 13 sees only padded keys inside its window (10 … 15)
    keep = dropout_keep_mask((b, h, n, n), p, seed, device=DEVICE)
    results = compare(spec, inputs, key_padding_mask=mask, dropout_p=p, dropout_seed=seed, keep_mask=keep)
    assert_all_close(results, "deberta_v3 window with padding and dropout")


@SLOW
def test_query_whose_window_holds_no_key_gives_zero():
    spec = windowed("shaw", 4, 0)
    inputs = make_inputs(spec, b=1, h=2, nq=20, nk=20, d=16, device=DEVICE, seed=1)
    assert_all_close(compare(spec, inputs, k_offset=10), "keys 10 past the first queries")
    out = relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables, k_offset=10)
    assert torch.all(out[:, :, :10] == 0)  # query i sees keys i − 4 … i, all before the first key (position 10)


@SLOW
def test_window_on_packed_sequences():
    spec = windowed("txl", 6, 2)
    lengths = [5, 33, 1, 20]
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    base = make_inputs(spec, b=1, h=2, nq=longest, d=16, device=DEVICE, seed=4)
    gen = torch.Generator().manual_seed(9)

    def packed(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_()

    inputs = type(base)(packed(total, 2, 16), packed(total, 2, 16), packed(total, 2, 16), base.tables)
    assert_all_close(compare(spec, inputs, cu_seqlens=cu, max_seqlen=longest), "txl window packed")


@SLOW
def test_window_with_grouped_query_attention_in_bnhd():
    spec = windowed({"name": "qk", "terms": ["query", "key"], "map": {"kind": "clipped", "min": -8, "max": 6}}, 7, 3)
    inputs = layout_inputs(spec, b=1, h=4, h_kv=2, nq=35, nk=35, layout="bnhd", seed=6)
    assert_all_close(compare(spec, inputs, layout="bnhd"), "window, GQA 2, bnhd")


@SLOW
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    left=st.one_of(st.none(), st.integers(0, 24)),
    right=st.one_of(st.none(), st.integers(0, 24)),
    causal=st.booleans(),
    nq=st.integers(1, 30),
    nk=st.integers(1, 30),
    q_offset=st.integers(0, 12),
    k_offset=st.integers(0, 12),
)
def test_small_windows_and_offsets(left, right, causal, nq, nk, q_offset, k_offset):
    spec = windowed("t5", left, right, causal=causal)
    inputs = make_inputs(spec, b=1, h=1, nq=nq, nk=nk, d=16, device=DEVICE, seed=nq * 31 + nk)
    results = compare(spec, inputs, q_offset=q_offset, k_offset=k_offset)
    assert_all_close(results, f"t5 window [{left}, {right}] causal={causal} {nq}x{nk} +{q_offset}/{k_offset}")


# -- the spec -------------------------------------------------------------------------------------------------
SPEC = "name: local\nterms: [query]\nmap: {kind: clipped, min: -8, max: 8}\n"


@pytest.mark.parametrize(
    ("window", "field", "expected"),
    [
        ("{left: -1, right: 0}", "window.left", "greater than or equal to 0"),
        ("{left: 4, right: -3}", "window.right", "greater than or equal to 0"),
        ("{left: '4', right: 0}", "window.left", "valid integer"),
        ("{left: true, right: 0}", "window.left", "valid integer"),
        ("{left: 4, right: 1.5}", "window.right", "valid integer"),
        (f"{{left: {MAX_SEQ_LEN + 1}, right: 0}}", "window.left", f"less than or equal to {MAX_SEQ_LEN}"),
        ("{left: 4}", "window.right", "Field required"),
        ("{left: 4, right: 0, size: 3}", "window.size", "allowed: left, right"),
        ("[4, 0]", "window", "valid dictionary"),
    ],
)
def test_bad_window_names_the_field(window, field, expected):
    with pytest.raises(relgen.SpecError, match=f"line 4: field '{field}': .*{expected}"):
        relgen.load_spec(SPEC + f"window: {window}\n")


def test_a_spec_without_a_window_keeps_its_canonical_form():
    plain = relgen.load_spec(SPEC)
    assert "window" not in plain.canonical_json()
    assert relgen.load_spec(SPEC + "window: null\n").spec_hash() == plain.spec_hash()
    local = relgen.load_spec(SPEC + "window: {left: 4, right: null}\n")
    assert '"window":{"left":4,"right":null}' in local.canonical_json()
    assert local.spec_hash() != plain.spec_hash()


# -- the plan -------------------------------------------------------------------------------------------------
def test_plan_expands_only_the_window_and_skips_the_tiles_outside_it():
    n = 4096
    full, local = relgen.plan.analyze(ROOT / "specs" / "txl.yaml", n), relgen.plan.analyze(windowed("txl", 64, 0), n)
    assert (local.saturation_low, local.saturation_high, local.expanded_rows) == (0, 64, 65)
    assert (local.local_left, local.local_right) == (64, 0)
    assert local.query_window == 65 < full.query_window
    assert local.cost["projection_flops"] * 50 < full.cost["projection_flops"]
    assert local.cost["score_tiles"] * 20 < full.cost["score_tiles"]
    assert "local_window=[0, 64]" in local.summary()


@SLOW
def test_a_window_inside_the_clipping_makes_no_tma_descriptors(monkeypatch):
    """Shaw's 32K benchmark call in small: a window [0, 5] inside the clipping at ±5 leaves no saturated tile, so the
    forward makes no K/V descriptors (host time per launch on the H200) even where they are forced; without the
    window the same call makes them. Both stay exact."""
    from relgen.runtime import descriptors, surface

    made = []
    real = surface.kv_descriptors
    monkeypatch.setattr(surface, "kv_descriptors", lambda *a, **kw: made.append(kw["pairs"]) or real(*a, **kw))
    clipped = {"name": "clip5", "terms": ["query"], "map": {"kind": "clipped", "min": -5, "max": 5}}
    for spec, expected in ((windowed(clipped, 5, 0), []), (relgen.load_spec(clipped), [40 * 40 * 2])):
        made.clear()
        inputs = make_inputs(spec, b=1, h=2, nq=40, d=16, device=DEVICE, seed=3)
        with descriptors.forced(True):
            assert_all_close(compare(spec, inputs), spec.name)
        assert made == expected, spec.name


def test_a_window_bounds_the_saturation_of_a_saturating_map():
    plan = relgen.plan.analyze(windowed("deberta_v3", 40, 3), 1024)
    assert (plan.saturation_low, plan.saturation_high) == (-3, 40)
    assert plan.saturation_proven


def test_explain_shows_the_window(capsys, tmp_path):
    from relgen.cli import main as cli

    path = tmp_path / "local.yaml"
    path.write_text(SPEC + "causal: true\nwindow: {left: 16, right: null}\n")
    assert cli.main(["explain", str(path)]) == 0
    assert "local window          keys 16 before, 0 after the query: δ ∈ [0, 16]" in capsys.readouterr().out


# -- an unproven map re-planned for the offsets a windowed call reaches ------------------------------------------
#: interval arithmetic cannot cancel delta - delta: unproven beyond its analysed window, re-planned for longer reaches
UNPROVEN = {
    "name": "unproven",
    "terms": ["bias"],
    "map": {"kind": "expression", "expr": "floor(Max(Min(delta, 5), -5) / 2) + 5 + delta - delta", "rows": 11},
}


@settings(max_examples=200, deadline=None)
@given(
    left=st.one_of(st.none(), st.integers(0, 12)),
    right=st.one_of(st.none(), st.integers(0, 12)),
    causal=st.booleans(),
    nq=st.integers(1, 9),
    nk=st.integers(1, 9),
    q_offset=st.integers(0, 12),
    k_offset=st.integers(0, 12),
)
def test_reach_is_clipped_to_the_window(left, right, causal, nq, nk, q_offset, k_offset):
    """1 + the largest |δ| over the pairs that causal and the window admit, counted pair by pair; 1 without any."""
    plan = dataclasses.replace(
        relgen.compile_mechanism(UNPROVEN).module.PLAN, causal=causal, local_left=left, local_right=right
    )
    q, k = torch.zeros(1, 1, nq, 16), torch.zeros(1, 1, nk, 16)
    offsets = [(i + q_offset) - (j + k_offset) for i in range(nq) for j in range(nk)]
    admitted = [
        d for d in offsets if (not causal or d >= 0) and (left is None or d <= left) and (right is None or d >= -right)
    ]
    expected = 1 + max((abs(d) for d in admitted), default=0)
    assert reach(plan, q, k, k, {"q_offset": q_offset, "k_offset": k_offset}) == expected


def test_a_windowed_unproven_map_is_planned_for_the_window_only():
    """40 tokens reach |δ| = 39 without the window and 20 inside [−5, 20]: the call is served by the module planned
    for 32 offsets (which hold the whole window, so its saturation is proven), exactly."""
    spec = windowed(UNPROVEN, 20, 5)
    fn = relgen.compile_mechanism(spec)
    inputs = make_inputs(spec, b=1, h=2, nq=40, nk=40, d=16, device=DEVICE, seed=8)
    assert fn.module.PLAN.valid_up_to == 16
    assert reach(fn.module.PLAN, inputs.q, inputs.k, inputs.v, {}) == 21
    assert fn.module_for(21).PLAN.valid_up_to is None
    assert_all_close(compare(spec, inputs), "unproven map, window [−5, 20]")
    packed = {"cu_seqlens": torch.tensor([0, 40], dtype=torch.int32), "max_seqlen": 40}
    q = inputs.q[0].transpose(0, 1)
    assert reach(fn.module.PLAN, q, q, q, packed) == 21


# -- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1000, 8192])
@pytest.mark.parametrize(("base", "left", "right"), [("shaw", 256, 0), ("txl_uv", 128, 128), ("t5", None, 300)])
def test_window_in_half_precision_on_gpu(base, left, right, n, dtype):
    from test_gpu import compare_large

    spec = windowed(base, left, right)
    inputs = make_inputs(spec, b=1, h=2, nq=n, d=64, dtype=dtype, device="cuda", seed=n)
    assert_all_close(compare_large(spec, inputs, dtype), f"{base} window [{left}, {right}] N={n} {dtype}")
