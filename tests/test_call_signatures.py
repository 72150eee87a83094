"""prepare_call's kept signatures: a repeated call skips the checks and reuses its Geometry, and nothing a check
or the Geometry depends on can be changed without the call being checked again."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import make_inputs
from tiers import SLOW

import relgen
from relgen.runtime import arguments
from relgen.runtime.arguments import check_call, prepare_call
from relgen.tiles.select import override_config

ROOT = Path(__file__).resolve().parent.parent


def spec(name: str):
    return relgen.load_spec(ROOT / "specs" / f"{name}.yaml")


def plan_of(name: str):
    return relgen.compile_mechanism(spec(name)).module.PLAN


@pytest.fixture
def checks(monkeypatch):
    """Counts the calls checked in full."""
    counted = []

    def counting(*args, **kwargs):
        counted.append(1)
        return check_call(*args, **kwargs)

    monkeypatch.setattr(arguments, "check_call", counting)
    return counted


def call(plan, inputs, **options):
    return prepare_call(
        plan, inputs.q, inputs.k, inputs.v, *(inputs.tables.get(n) for n in ("aq", "ak", "bias")), **options
    )


def test_a_repeated_call_is_checked_once(checks):
    plan = plan_of("t5")
    plan.calls.clear()
    inputs = make_inputs(spec("t5"), b=2, h=3, nq=40, d=16)
    first = call(plan, inputs, q_offset=0, scale=None)
    again = call(plan, inputs, q_offset=0, scale=None)
    assert len(checks) == 1
    assert again.geo is first.geo
    assert again.q is inputs.q and again.bias is inputs.tables["bias"]


def test_every_part_of_the_signature_is_checked_again(checks):
    plan = plan_of("shaw")
    plan.calls.clear()
    base = make_inputs(spec("shaw"), b=1, h=2, nq=30, d=16)
    call(plan, base)
    variants = [
        (make_inputs(spec("shaw"), b=1, h=2, nq=31, d=16), {}),  # length
        (make_inputs(spec("shaw"), b=2, h=2, nq=30, d=16), {}),  # batch
        (make_inputs(spec("shaw"), b=1, h=2, nq=30, d=16, dtype=torch.float16), {}),  # dtype
        (base, {"q_offset": 3}),
        (base, {"scale": 0.5}),
        (base, {"scale": 1}),
        (base, {"ablation": "no_reachable_ranges"}),
    ]
    for inputs, options in variants:
        before = len(checks)
        call(plan, inputs, **options)
        assert len(checks) == before + 1, options
    # and each is kept in turn
    before = len(checks)
    for inputs, options in variants:
        call(plan, inputs, **options)
    assert len(checks) == before


@pytest.mark.parametrize(
    "options, error",
    [
        ({"q_offset": True}, "q_offset"),  # True == 1 and hashes like it: the kept q_offset=1 must not pass it
        ({"scale": True}, "scale"),
        ({"q_offset": -1}, "q_offset"),
    ],
)
def test_bad_options_are_refused_after_a_kept_call(options, error):
    plan = plan_of("shaw")
    inputs = make_inputs(spec("shaw"), b=1, h=2, nq=20, d=16)
    call(plan, inputs, q_offset=1, scale=1)
    with pytest.raises(ValueError, match=error):
        call(plan, inputs, **options)


def test_bad_tables_are_refused_after_a_kept_call():
    plan = plan_of("t5")
    inputs = make_inputs(spec("t5"), b=1, h=2, nq=20, d=16)
    call(plan, inputs)
    bias = inputs.tables["bias"]
    for bad, error in ((bias.to(torch.int32), "floating-point"), (bias[:, :-1], "shape"), (None, "required")):
        with pytest.raises(ValueError, match=error):
            prepare_call(plan, inputs.q, inputs.k, inputs.v, None, None, bad)


def test_strided_tables_are_kept_and_read_contiguous(checks):
    """A model's tables are views ([R, H·d] projections seen as [H, R, d]): such a call is kept like any other, and
    its kept calls hand the kernels contiguous tables with the caller's values, as the checks do."""
    plan = plan_of("deberta_v3")
    plan.calls.clear()
    inputs = make_inputs(spec("deberta_v3"), b=1, h=2, nq=20, d=16)
    aq, ak = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (inputs.tables["aq"], inputs.tables["ak"]))
    assert not aq.is_contiguous()
    first = prepare_call(plan, inputs.q, inputs.k, inputs.v, aq, ak, None)
    again = prepare_call(plan, inputs.q, inputs.k, inputs.v, aq, ak, None)
    assert len(checks) == 1 and again.geo is first.geo
    for kept, checked, passed in ((again.aq, first.aq, aq), (again.ak, first.ak, ak)):
        assert kept.is_contiguous() and torch.equal(kept, passed) and torch.equal(kept, checked)


def test_unkept_calls_are_checked_every_time(checks):
    plan = plan_of("t5")
    plan.calls.clear()
    inputs = make_inputs(spec("t5"), b=2, h=2, nq=24, d=16)
    q_strided = inputs.q.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1: copied by the checks
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    packed = [t[0].transpose(0, 1).contiguous() for t in (inputs.q, inputs.k, inputs.v)]
    for _ in range(2):
        prepare_call(plan, q_strided, inputs.k, inputs.v, None, None, inputs.tables["bias"])
        prepare_call(plan, *packed, None, None, inputs.tables["bias"], cu_seqlens=cu, max_seqlen=14)
    assert len(checks) == 4
    assert not plan.calls


def test_dropout_calls_are_kept_with_each_calls_own_seed(checks):
    """A training step's calls (dropout on) reuse the Geometry; only its seed is each call's: drawn anew for
    dropout_seed=None, the caller's int or tensor otherwise. The rest equals what check_call derives."""
    plan = plan_of("t5")
    plan.calls.clear()
    inputs = make_inputs(spec("t5"), b=2, h=2, nq=24, d=16)
    bias = inputs.tables["bias"]
    drawn = [call(plan, inputs, dropout_p=0.1).geo for _ in range(3)]
    assert len(checks) == 1
    assert len({geo.seed for geo in drawn}) == 3  # three draws from [0, 2^31 − 1) (equal ones: p < 2^-29)
    want = check_call(plan, inputs.q, inputs.k, inputs.v, None, None, bias, dropout_p=0.1).geo
    assert all(geo == replace(want, seed=geo.seed) for geo in drawn)

    assert call(plan, inputs, dropout_p=0.1, dropout_seed=5).geo.seed == 5
    assert call(plan, inputs, dropout_p=0.1, dropout_seed=9).geo.seed == 9
    tensor_seed = torch.tensor([4], dtype=torch.int64)
    other_seed = torch.tensor([6], dtype=torch.int64)
    assert torch.equal(call(plan, inputs, dropout_p=0.1, dropout_seed=tensor_seed).geo.seed, tensor_seed)
    assert torch.equal(call(plan, inputs, dropout_p=0.1, dropout_seed=other_seed).geo.seed, other_seed)
    assert len(checks) == 3  # one per kind of seed: None, an int, a tensor
    call(plan, inputs, dropout_p=0.2)  # another rate: a signature of its own
    assert len(checks) == 4
    bad_seeds = [
        (-1, "dropout_seed"),
        (2**63, "dropout_seed"),
        (torch.tensor([4.0]), "dropout_seed: a tensor seed must be one int64 or int32 element"),
        (torch.tensor([4, 5]), "dropout_seed: a tensor seed must be one int64 or int32 element"),
    ]
    for bad, error in bad_seeds:
        with pytest.raises(ValueError, match=error):
            call(plan, inputs, dropout_p=0.1, dropout_seed=bad)


def test_kept_dropout_calls_draw_their_own_masks(checks):
    """Through the kept Geometry the kernels read each call's seed: calls with the same seed give the same bits,
    two drawn seeds (or two given ones) other masks."""
    fn = relgen.compile_mechanism(spec("t5"))
    fn.module.PLAN.calls.clear()
    inputs = make_inputs(spec("t5"), b=1, h=2, nq=32, d=16)

    def out(seed):
        return fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.5, dropout_seed=seed)

    first, same, other = out(11), out(11), out(12)
    drawn, drawn_again = out(None), out(None)
    assert len(checks) == 2  # one per kind of seed
    assert torch.equal(first, same)
    assert not torch.equal(first, other)
    assert not torch.equal(drawn, drawn_again)


def test_a_padding_mask_is_kept_by_its_shape_and_read_anew(checks):
    """A call with a key padding mask of the kept shape, dtype and device (a model's layers, each handed its batch's
    mask) reuses the Geometry; the kernels get that call's own mask, and a mask check_call would refuse is checked
    (and refused) again."""
    plan = plan_of("t5")
    plan.calls.clear()
    inputs = make_inputs(spec("t5"), b=2, h=2, nq=24, d=16)
    first_mask = torch.ones(2, 24, dtype=torch.bool)
    first = call(plan, inputs, key_padding_mask=first_mask)
    mask = torch.rand(2, 24, generator=torch.Generator().manual_seed(0)) > 0.5
    again = call(plan, inputs, key_padding_mask=mask)
    assert len(checks) == 1 and again.geo is first.geo
    assert torch.equal(again.kpm, mask.to(torch.int8)) and torch.equal(first.kpm, first_mask.to(torch.int8))
    call(plan, inputs)  # no mask: a signature of its own
    assert len(checks) == 2
    bad_masks = [
        (mask.to(torch.int8), "key_padding_mask: expected a bool tensor"),
        (mask[:, :-1], "key_padding_mask: expected a bool tensor of shape \\[2, 24\\]"),
        (mask.to_sparse(), "key_padding_mask"),
        ("mask", "key_padding_mask"),
    ]
    for bad, error in bad_masks:
        with pytest.raises(ValueError, match=error):
            call(plan, inputs, key_padding_mask=bad)


def test_an_override_bypasses_the_kept_signatures(checks):
    plan = plan_of("t5")
    inputs = make_inputs(spec("t5"), b=1, h=2, nq=24, d=16)
    kept = call(plan, inputs).geo
    forced = replace(kept.config, group=2 * kept.config.group)
    with override_config(forced):
        geo = call(plan, inputs).geo
    assert geo.config == forced and geo.config != kept.config
    assert call(plan, inputs).geo is kept


def test_the_kept_signatures_are_bounded():
    plan = plan_of("txl")
    plan.calls.clear()
    for n in range(1, arguments.KEPT_CALLS + 6):
        call(plan, make_inputs(spec("txl"), b=1, h=1, nq=n, d=16))
    assert len(plan.calls) == arguments.KEPT_CALLS


@SLOW
@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["shaw", "txl", "deberta_v3", "t5", "t5_decoder"]),
    nq=st.integers(1, 200),
    nk=st.integers(1, 200),
    q_offset=st.sampled_from([0, 7]),
    k_offset=st.sampled_from([0, 16]),
    repeats=st.integers(1, 3),
)
def test_a_kept_geometry_equals_a_checked_one(name, nq, nk, q_offset, k_offset, repeats):
    plan = plan_of(name)
    inputs = make_inputs(spec(name), b=1, h=2, nq=nq, nk=nk, d=16, length=max(q_offset + nq, k_offset + nk))
    tables = [inputs.tables.get(n) for n in ("aq", "ak", "bias")]
    for _ in range(repeats):
        got = prepare_call(plan, inputs.q, inputs.k, inputs.v, *tables, q_offset=q_offset, k_offset=k_offset).geo
    want = check_call(plan, inputs.q, inputs.k, inputs.v, *tables, q_offset=q_offset, k_offset=k_offset).geo
    assert got == want


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_a_scalar_tensor_is_refused_by_name(which):
    """A 0-dimensional tensor has no last stride: the signature must not be what fails on it."""
    plan = plan_of("t5")
    inputs = make_inputs(spec("t5"), b=1, h=2, nq=20, d=16)
    args = {"q": inputs.q, "k": inputs.k, "v": inputs.v, which: torch.tensor(1.0)}
    with pytest.raises(ValueError, match=f"^{which}: "):
        prepare_call(plan, args["q"], args["k"], args["v"], None, None, inputs.tables["bias"])


def test_a_sparse_tensor_is_refused_by_name():
    plan = plan_of("t5")
    inputs = make_inputs(spec("t5"), b=1, h=2, nq=20, d=16)
    with pytest.raises(ValueError, match=r"^k: expected a dense"):
        prepare_call(plan, inputs.q, inputs.k.detach().to_sparse(), inputs.v, None, None, inputs.tables["bias"])
    with pytest.raises(ValueError, match=r"^bias: expected a dense"):
        prepare_call(plan, inputs.q, inputs.k, inputs.v, None, None, inputs.tables["bias"].detach().to_sparse())
