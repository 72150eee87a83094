"""Masks, positions, dropout, LSE and memory options of the generated kernels, against the FP64 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_cases import LOG_QUERY_KEY, QUERY_KEY, assert_all_close, compare, load, make_inputs, spec_id
from tiers import SLOW, slow_values
from torch.utils._python_dispatch import TorchDispatchMode

import relgen
from relgen.testing import dropout_keep_mask

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SYMMETRIC = {
    "name": "sym",
    "terms": ["query", "key"],
    "map": {"kind": "expression", "expr": "Min(Abs(delta), 9)", "rows": 10},
}
FEATURE_SPECS = ["shaw", "txl", LOG_QUERY_KEY, "t5_decoder", SYMMETRIC]


@SLOW
@pytest.mark.parametrize("name", FEATURE_SPECS, ids=spec_id)
def test_key_padding_mask_with_a_fully_padded_row(name):
    spec = load(name)
    inputs = make_inputs(spec, b=3, h=2, nq=37, nk=37, d=16, device=DEVICE, seed=11)
    mask = torch.ones(3, 37, dtype=torch.bool, device=DEVICE)
    mask[1, 20:] = False
    mask[2, :] = False  # nothing to attend to: output 0 and gradient 0, never NaN
    assert_all_close(compare(spec, inputs, key_padding_mask=mask), f"{spec_id(name)} padding")
    out = relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables, key_padding_mask=mask)
    assert torch.all(out[2] == 0)


OFFSETS = [(1, 40, 39, 0), (16, 48, 32, 0), (20, 20, 0, 7), (33, 21, 5, 9)]


# the fast tier keeps one spec's KV-cache decoding step
@pytest.mark.parametrize("name", slow_values(FEATURE_SPECS, fast=["txl"]), ids=spec_id)
@pytest.mark.parametrize(("nq", "nk", "q_offset", "k_offset"), slow_values(OFFSETS, fast=[(1, 40, 39, 0)]))
def test_position_offsets(name, nq, nk, q_offset, k_offset):
    """KV-cache decoding (Nq = 1), chunked prefill, and keys that start later than the queries."""
    spec = load(name)
    length = max(q_offset + nq, k_offset + nk)
    inputs = make_inputs(spec, b=1, h=2, nq=nq, nk=nk, d=16, device=DEVICE, seed=nq, length=length)
    assert_all_close(
        compare(spec, inputs, q_offset=q_offset, k_offset=k_offset), f"{spec_id(name)} offsets {q_offset},{k_offset}"
    )


def test_causal_offset_leaving_no_key_gives_zero():
    spec = load("t5_decoder")
    inputs = make_inputs(spec, b=1, h=2, nq=10, nk=30, d=16, device=DEVICE)
    assert_all_close(compare(spec, inputs, k_offset=5), "rows 0..4 see no key")
    out = relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables, k_offset=5)
    assert torch.all(out[:, :, :5] == 0)


@SLOW
@pytest.mark.parametrize("name", [LOG_QUERY_KEY, "t5", SYMMETRIC], ids=spec_id)
def test_dropout_matches_reference_with_the_kernels_keep_mask(name):
    spec = load(name)
    b, h, n, p, seed = 2, 2, 45, 0.3, 1234
    inputs = make_inputs(spec, b=b, h=h, nq=n, d=16, device=DEVICE, seed=2)
    keep = dropout_keep_mask((b, h, n, n), p, seed, device=DEVICE)
    assert 0.6 < keep.float().mean().item() < 0.8
    results = compare(spec, inputs, dropout_p=p, dropout_seed=seed, keep_mask=keep)
    assert_all_close(results, f"{spec_id(name)} dropout")


@SLOW
def test_dropout_mask_is_one_in_every_tile_order():
    """The kernels draw a key's number from a Philox call shared by four consecutive keys, and list a tile's keys
    up (the forward's saturated tiles read through descriptors) or down (every other tile), query-major or, in the
    key pass, key-major: every order must read the same mask, the one the testing helper regenerates."""
    import dataclasses

    from relgen.runtime import descriptors
    from relgen.tiles.configs import INTERPRETER_CONFIG, AttnTiles
    from relgen.tiles.select import override_config

    spec = load("t5")  # saturates beyond ±128: saturated tiles at N = 200
    b, h, n, p, seed = 1, 2, 200, 0.3, 99
    inputs = make_inputs(spec, b=b, h=h, nq=n, d=16, device=DEVICE, seed=4)
    keep = dropout_keep_mask((b, h, n, n), p, seed, device=DEVICE)
    key_major = dataclasses.replace(INTERPRETER_CONFIG, backward_kv=AttnTiles(32, 16, key_major=True))
    with descriptors.forced(True), override_config(key_major):
        results = compare(spec, inputs, dropout_p=p, dropout_seed=seed, keep_mask=keep)
    assert_all_close(results, "t5 dropout, descriptors, key-major key pass")


def test_dropout_draws_four_independent_keys_per_call():
    """The four keys that share a Philox call get its four words, not one word four times: within a group the keep
    bits agree as often as independent draws would, and each of the four positions keeps 1 − p of its scores."""
    p = 0.5
    keep = dropout_keep_mask((1, 2, 64, 256), p, 12345, device=DEVICE).reshape(-1, 4).float()  # 8192 groups
    expected = torch.full((4,), 1 - p, device=keep.device)
    assert torch.allclose(keep.mean(0), expected, atol=0.03)  # ~5 standard deviations
    agree = ((keep.sum(1) == 0) | (keep.sum(1) == 4)).float().mean().item()
    assert abs(agree - (p**4 + (1 - p) ** 4)) < 0.025, agree  # 0.125 if independent (~7 s.d.), 1 if one word


@SLOW
def test_dropout_seed_none_follows_torch_generator():
    spec = load("shaw")
    inputs = make_inputs(spec, b=1, h=2, nq=33, d=16, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1])
    torch.manual_seed(8)
    assert not torch.equal(outs[0], fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.5))


def _output_and_gradients(fn, inputs, **options):
    leaves = list(inputs.leaves.values())
    out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    return [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]


@SLOW
@pytest.mark.parametrize("name", ["shaw", QUERY_KEY, "t5"], ids=spec_id)
def test_a_tensor_seed_draws_the_ints_mask(name):
    """dropout_seed as a one-element tensor (read by the kernels, for CUDA graphs) gives the bits an int seed
    gives, in every pass; the caller's tensor may change once the forward has been called."""
    spec = load(name)
    inputs = make_inputs(spec, b=1, h=2, nq=45, d=16, device=DEVICE, seed=3)
    fn = relgen.compile_mechanism(spec)
    expected = _output_and_gradients(fn, inputs, dropout_p=0.3, dropout_seed=2**31 + 5)
    leaves = list(inputs.leaves.values())
    for dtype in (torch.int64, torch.int32):
        seed = torch.tensor(2**31 + 5 if dtype == torch.int64 else 77, dtype=dtype, device=DEVICE)
        want = expected if dtype == torch.int64 else _output_and_gradients(fn, inputs, dropout_p=0.3, dropout_seed=77)
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.3, dropout_seed=seed)
        seed.fill_(9)  # the next step's seed, set before this step's backward
        got = [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b), dtype
    other = _output_and_gradients(fn, inputs, dropout_p=0.3, dropout_seed=torch.tensor([9], device=DEVICE))
    assert not torch.equal(other[0], expected[0])


@pytest.mark.parametrize("name", ["txl", "t5_decoder"])
def test_return_lse(name):
    spec = load(name)
    inputs = make_inputs(spec, b=1, h=2, nq=30, nk=26, d=16, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    _, lse = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, return_lse=True, k_offset=4)
    _, ref_lse = relgen.reference.attention(
        spec, inputs.q, inputs.k, inputs.v, **inputs.tables, return_lse=True, k_offset=4
    )
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 30)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)


@SLOW
@pytest.mark.parametrize("name", ["shaw", LOG_QUERY_KEY, SYMMETRIC], ids=spec_id)
def test_recompute_projections_gives_the_same_gradients(name):
    spec = load(name)
    inputs = make_inputs(spec, b=1, h=2, nq=40, d=16, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    leaves = list(inputs.leaves.values())
    grads = []
    for recompute in (False, True):
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, recompute_projections=recompute)
        grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out)))
    # the atomic path sums relation gradients in arrival order, so on a GPU only the offset path repeats bitwise
    deterministic = relgen.plan.analyze(spec).path == "offset"
    for a, b in zip(*grads, strict=True):
        if deterministic:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@SLOW
def test_scale_override():
    spec = load(LOG_QUERY_KEY)
    inputs = make_inputs(spec, b=1, h=2, nq=20, d=16, device=DEVICE)
    assert_all_close(compare(spec, inputs, scale=0.7), "scale=0.7")


# -- bad input ---------------------------------------------------------------------------------------------------
def _bad_call(**changes):
    spec = load("deberta_v3")
    inputs = make_inputs(spec, b=2, h=2, nq=8, d=16, device=DEVICE)
    args = {"q": inputs.q, "k": inputs.k, "v": inputs.v, **inputs.tables}
    args.update(changes)
    return relgen.compile_mechanism(spec), args


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        ({"q": torch.zeros(2, 2, 8)}, "q"),
        ({"q": torch.zeros(2, 2, 8, 20)}, "q"),  # d not a multiple of 8
        ({"k": torch.zeros(2, 3, 8, 16)}, "k"),
        ({"v": torch.zeros(2, 2, 9, 16)}, "v"),
        ({"q": torch.zeros(2, 2, 8, 16, dtype=torch.float64)}, "q"),
        ({"k": torch.zeros(2, 2, 8, 16, dtype=torch.float16)}, "k"),
        ({"aq": None}, "aq"),
        ({"aq": torch.zeros(2, 7, 16)}, "aq"),
        ({"ak": torch.zeros(512, 16)}, "ak"),
        ({"bias": torch.zeros(2, 512)}, "bias"),
        ({"key_padding_mask": torch.ones(2, 7, dtype=torch.bool)}, "key_padding_mask"),
        ({"key_padding_mask": torch.ones(2, 8)}, "key_padding_mask"),
        ({"q_offset": -1}, "q_offset"),
        ({"k_offset": 1.5}, "k_offset"),
        ({"dropout_p": 1.0}, "dropout_p"),
        ({"dropout_p": -0.1}, "dropout_p"),
        ({"scale": 0.0}, "scale"),
        ({"dropout_seed": -3}, "dropout_seed"),
        ({"dropout_seed": torch.tensor([1.0])}, "dropout_seed"),
        ({"dropout_seed": torch.tensor([1, 2])}, "dropout_seed"),
        ({"dropout_seed": "7"}, "dropout_seed"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(changes, argument):
    fn, args = _bad_call(**changes)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    tables = {name: args.pop(name) for name in ("aq", "ak", "bias") if name in args}
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        fn(q, k, v, **tables, **args)


@SLOW
@pytest.mark.parametrize("name", ["txl", LOG_QUERY_KEY, "t5_decoder", SYMMETRIC], ids=spec_id)
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_packed_sequences(name, dropout):
    """Each packed sequence attends only within itself; identity tables have R = 2·max_seqlen − 1."""
    spec = load(name)
    lengths = [5, 33, 1, 20]
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    base = make_inputs(spec, b=1, h=2, nq=longest, d=16, device=DEVICE, seed=4)
    gen = torch.Generator().manual_seed(9)

    def packed(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_()

    inputs = type(base)(packed(total, 2, 16), packed(total, 2, 16), packed(total, 2, 16), base.tables)
    options = {"cu_seqlens": cu, "max_seqlen": longest}
    if dropout:
        seed = 77
        keep = dropout_keep_mask((len(lengths), 2, longest, longest), dropout, seed, device=DEVICE)
        options.update(dropout_p=dropout, dropout_seed=seed, keep_mask=keep)
    assert_all_close(compare(spec, inputs, **options), f"{spec_id(name)} packed dropout={dropout}")


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        ({"cu_seqlens": torch.tensor([0, 5, 3, 9], dtype=torch.int32)}, "cu_seqlens"),
        ({"cu_seqlens": torch.tensor([0, 4, 8], dtype=torch.int32)}, "cu_seqlens"),
        ({"cu_seqlens": torch.tensor([0, 4, 9], dtype=torch.int64)}, "cu_seqlens"),
        ({"max_seqlen": 3}, "max_seqlen"),
        ({"max_seqlen": 10}, "max_seqlen"),  # more than the 9 tokens present
    ],
)
def test_bad_packed_input(changes, argument):
    spec = load("t5")
    fn = relgen.compile_mechanism(spec)
    q, k, v = (torch.randn(9, 2, 16, device=DEVICE) for _ in range(3))
    args = {"cu_seqlens": torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE), "max_seqlen": 5, **changes}
    if isinstance(args["cu_seqlens"], torch.Tensor):
        args["cu_seqlens"] = args["cu_seqlens"].to(DEVICE)
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        fn(q, k, v, bias=torch.randn(2, 32, device=DEVICE), **args)


class _Allocations(TorchDispatchMode):
    """(shape, dtype) of every tensor an aten factory creates while the mode is active."""

    FACTORIES = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "new_empty", "new_zeros")

    def __init__(self):
        super().__init__()
        self.created: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.FACTORIES:
            self.created.append((tuple(out.shape), out.dtype))
        return out


@SLOW
@pytest.mark.parametrize("name", ["shaw", LOG_QUERY_KEY], ids=spec_id)
def test_backward_keeps_no_fp32_copy_of_a_token_tensor(name):
    """dQ and dK are completed in place by the token reductions: an fp32 partial the size of q (k) would add
    B·H·N·d·4 bytes to the backward's peak (48 MiB at 8K, the gap to the paper's figures)."""
    spec = load(name)
    inputs = make_inputs(spec, b=1, h=2, nq=40, d=16, dtype=torch.float16, device=DEVICE, seed=3)
    leaves = [inputs.q, inputs.k, inputs.v, *inputs.tables.values()]
    out = relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables)
    with _Allocations() as allocations:
        grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert all(g is not None for g in grads)
    token_shapes = {tuple(inputs.q.shape), tuple(inputs.k.shape)}
    created = allocations.created
    assert any(shape in token_shapes and dtype == torch.float16 for shape, dtype in created), created  # dQ itself
    assert not [(s, d) for s, d in created if s in token_shapes and d == torch.float32], created
