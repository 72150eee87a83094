"""Shapes of real models: q, k, v as [B, N, H, d] (layout="bnhd"), against the FP64 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_cases import QUERY_KEY, Inputs, assert_all_close, compare, load, make_inputs, spec_id
from tiers import SLOW, slow_values
from torch.utils._python_dispatch import TorchDispatchMode

import relgen
from relgen import reference
from relgen.check.verify import gradient_runs
from relgen.runtime import descriptors
from relgen.testing import check_close, dropout_keep_mask

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: ±δ share a row: the atomic path
ATOMIC = {
    "name": "atomic17",
    "terms": ["query", "bias"],
    "map": {"kind": "expression", "expr": "Min(Abs(delta), 16)", "rows": 17},
}


def layout_inputs(spec, *, b=1, h=2, h_kv=None, nq=20, nk=None, d=16, layout="bhnd", seed=0, dtype=torch.float32):
    """make_inputs' q, k, v and tables, with k and v cut to their first h_kv heads and all three in `layout`, each
    a contiguous leaf in that layout (tables per query head)."""
    base = make_inputs(spec, b=b, h=h, nq=nq, nk=nk, d=d, device=DEVICE, seed=seed, dtype=dtype)
    h_kv = h if h_kv is None else h_kv
    q, k, v = (t.detach() for t in (base.q, base.k[:, :h_kv], base.v[:, :h_kv]))
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return Inputs(*(t.contiguous().requires_grad_() for t in (q, k, v)), base.tables)


# -- layout="bnhd" ------------------------------------------------------------------------------------------------
@SLOW
@pytest.mark.parametrize("name", ["shaw", QUERY_KEY, "t5_decoder", ATOMIC], ids=spec_id)
def test_bnhd_matches_the_reference(name):
    spec = load(name)
    inputs = layout_inputs(spec, b=2, h=2, nq=29, nk=21, layout="bnhd", seed=1)
    assert_all_close(compare(spec, inputs, layout="bnhd"), f"{spec_id(name)} bnhd")


@SLOW
def test_bnhd_reads_strided_views_of_a_fused_projection():
    """q, k, v as HF holds them after a fused qkv projection: views of one [B, N, 3, H, d] tensor, whose tokens lie
    3·H·d elements apart; also with Nq ≠ Nk and position offsets."""
    spec = load("txl")
    b, n, h, d = 2, 24, 2, 16
    fused = torch.randn(b, n, 3, h, d, generator=torch.Generator().manual_seed(3)).to(DEVICE).requires_grad_()
    q, k, v = fused[:, :20, 0], fused[:, :, 1], fused[:, :, 2]
    assert not q.is_contiguous() and q.stride(-1) == 1
    rows = spec.map.num_rows(20 + 4)
    aq = (0.5 * torch.randn(h, rows, d, generator=torch.Generator().manual_seed(4))).to(DEVICE).requires_grad_()
    fn = relgen.compile_mechanism(spec)
    out = fn(q, k, v, aq=aq, layout="bnhd", q_offset=4)
    ref = reference.attention(spec, q, k, v, aq=aq, layout="bnhd", q_offset=4)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got = torch.autograd.grad(out, (fused, aq), do)
    want = torch.autograd.grad(ref, (fused, aq), do.double())
    results = [("out", *check_close(out, ref, torch.float32))]
    results += [(n, *check_close(g, w, torch.float32)) for n, g, w in zip(("dqkv", "daq"), got, want, strict=True)]
    assert_all_close(results, "fused qkv views")


class _Copies(TorchDispatchMode):
    """Shapes of the tensors that aten copies (copy_, clone, _to_copy, contiguous) create while active."""

    COPIES = ("copy_", "clone", "_to_copy", "contiguous", "transpose_copy", "permute_copy")

    def __init__(self):
        super().__init__()
        self.copied: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.COPIES:
            self.copied.append(tuple(out.shape))
        return out


@SLOW
@pytest.mark.parametrize("name", ["shaw", QUERY_KEY], ids=spec_id)
def test_bnhd_copies_no_token_tensor(name):
    """q, k, v, O, dO and the gradients stay where they are: the kernels index [B, H, N, d] views of them. O and
    dq, dk, dv come back contiguous in [B, N, H, d]."""
    spec = load(name)
    inputs = layout_inputs(spec, b=2, h=2, nq=20, layout="bnhd", seed=2)
    fn = relgen.compile_mechanism(spec)
    token_shapes = {tuple(inputs.q.shape), (2, 2, 20, 16)}
    with _Copies() as forward:
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, layout="bnhd")
    do = torch.randn_like(out)
    with _Copies() as backward:
        grads = torch.autograd.grad(out, [inputs.q, inputs.k, inputs.v], do)
    assert not token_shapes & set(forward.copied + backward.copied), (forward.copied, backward.copied)
    assert out.shape == inputs.q.shape and out.is_contiguous()
    for g, t in zip(grads, (inputs.q, inputs.k, inputs.v), strict=True):
        assert g.shape == t.shape and g.is_contiguous()


@SLOW
def test_bnhd_equals_bhnd_bit_for_bit():
    """The same kernels read the same numbers through other strides: every output and gradient is the same bits."""
    spec = load(QUERY_KEY)
    runs = []
    for layout in ("bhnd", "bnhd"):
        inputs = layout_inputs(spec, b=1, h=2, nq=33, layout=layout, seed=6)
        out, lse = relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables, layout=layout,
                                                  return_lse=True)  # fmt: skip
        do = torch.randn(1, 2, 33, 16, generator=torch.Generator().manual_seed(1))  # [B, H, N, d]
        do = do.transpose(1, 2) if layout == "bnhd" else do
        grads = torch.autograd.grad(out, list(inputs.leaves.values()), do.to(out))
        heads_major = [t.transpose(1, 2) if layout == "bnhd" else t for t in (out, *grads[:3])]
        runs.append([*heads_major, lse, *grads[3:]])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_packed_calls_take_either_layout():
    """Packed q, k, v are [total, H, d] whatever the layout says."""
    spec = load("shaw")
    lengths = [7, 20]
    cu = torch.tensor([0, 7, 27], dtype=torch.int32, device=DEVICE)
    base = make_inputs(spec, b=1, h=2, nq=27, d=16, device=DEVICE, seed=8)
    q, k, v = (t.detach()[0].transpose(0, 1).contiguous() for t in (base.q, base.k, base.v))
    fn = relgen.compile_mechanism(spec)
    outs = [fn(q, k, v, **base.tables, cu_seqlens=cu, max_seqlen=max(lengths), layout=lay) for lay in ("bhnd", "bnhd")]
    assert outs[0].shape == q.shape and torch.equal(outs[0], outs[1])


@SLOW
def test_bnhd_and_grouped_query_attention_under_torch_compile_give_the_eager_bits():
    """The custom ops take `layout` and k, v with H_kv heads: a compiled call is the eager call, bit for bit."""
    from torch._dynamo.backends.debugging import aot_eager

    spec = load(QUERY_KEY)
    inputs = layout_inputs(spec, b=1, h=4, h_kv=2, nq=20, layout="bnhd", seed=9)
    leaves = list(inputs.leaves.values())
    fn = relgen.compile_mechanism(spec)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), backend=aot_eager, fullgraph=True)
    runs = []
    for f in (fn, compiled):
        out, lse = f(inputs.q, inputs.k, inputs.v, **inputs.tables, layout="bnhd", return_lse=True)
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
        runs.append([out, lse, *torch.autograd.grad(out, leaves, do)])
    torch._dynamo.reset()
    for a, b in zip(*runs, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


@SLOW
def test_bnhd_saturated_tiles_read_through_descriptors_with_the_views_strides():
    """The forward's saturated tiles load K and V through tensor descriptors over the [B, H_kv, N, d] views: for a
    'bnhd' call, descriptors with the view's strides (tokens H_kv·d apart), checked here in the interpreter's TMA
    emulation (the descriptors stay off below MIN_PAIRS unless forced)."""
    spec = load(QUERY_KEY)  # saturates beyond [-8, 6]: saturated key tiles at N = 48
    inputs = layout_inputs(spec, b=1, h=4, h_kv=2, nq=48, layout="bnhd", seed=4)
    k_view = inputs.k.detach().transpose(1, 2)  # [1, 2, 48, 16], the query heads reading head h // 2
    with descriptors.forced(True):
        k_desc, _ = descriptors.kv_descriptors(k_view, k_view, 16, varlen=False, pairs=1)
        assert list(k_desc.strides) == list(k_view.stride()) == [48 * 2 * 16, 16, 2 * 16, 1]
        assert_all_close(compare(spec, inputs, layout="bnhd"), "bnhd, descriptors")


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        ({"layout": "bshd"}, "layout"),
        ({"layout": None}, "layout"),
        ({"layout": ["bnhd"]}, "layout"),
        ({"k": torch.zeros(2, 9, 2, 17)}, "k"),  # d differs from q's
        ({"v": torch.zeros(2, 9, 2, 16)}, "v"),  # Nk differs from k's
        ({"q": torch.zeros(2, 8, 16)}, "q"),
    ],
)
def test_bad_layout_arguments_raise_value_error_naming_them(changes, argument):
    spec = load("shaw")
    inputs = layout_inputs(spec, b=2, h=2, nq=8, layout="bnhd")
    args = {"q": inputs.q, "k": inputs.k, "v": inputs.v, **inputs.tables, "layout": "bnhd", **changes}
    fn = relgen.compile_mechanism(spec)
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        fn(**args)
    if argument == "layout":  # the FP64 oracle refuses it too
        with pytest.raises(ValueError, match="layout"):
            reference.attention(spec, **args)


# -- head dims: every multiple of 8 up to 256, padded to a power of two inside the kernels --------------------------
@SLOW
@pytest.mark.parametrize(
    ("name", "d"),
    [("shaw", 24), (QUERY_KEY, 80), (ATOMIC, 96), ("t5_decoder", 256)],
    ids=lambda x: spec_id(x) if not isinstance(x, int) else f"d{x}",
)
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_padded_head_dims_match_the_reference(name, d, layout):
    spec = load(name)
    inputs = layout_inputs(spec, b=1, h=2, nq=21, nk=19, d=d, layout=layout, seed=d)
    assert_all_close(compare(spec, inputs, layout=layout), f"{spec_id(name)} d={d} {layout}")


@pytest.mark.parametrize("d", [8, 20, 100, 264, 512])
def test_unsupported_head_dims_raise_value_error_naming_q(d):
    spec = load("t5")
    q, k, v = (torch.zeros(1, 2, 8, d, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match=r"^q: head dim d must be a multiple of 8 from 16 to 256, got"):
        relgen.compile_mechanism(spec)(q, k, v, bias=torch.zeros(2, 32, device=DEVICE))


def test_descriptors_only_for_head_dims_that_fill_a_box():
    """A TMA box is a power of two wide: padded head dims keep the pointer loads, whose masks zero the padding."""
    with descriptors.forced(True):
        for d, described in ((16, True), (24, False), (96, False), (128, True), (192, False), (256, True)):
            k = torch.zeros(1, 2, 64, d, device=DEVICE)
            k_desc, v_desc = descriptors.kv_descriptors(k, k, 16, varlen=False, pairs=1)
            assert (k_desc is not None) == described and (v_desc is not None) == described, d


def test_wide_head_dims_get_tiles_that_fit_shared_memory(monkeypatch):
    """The resource heuristic's tiles (what a GPU runs without a tuned entry) keep the operand tiles a pipeline stage
    holds (K and V tiles per stage, plus the resident Q or K, V tile) inside the H200's 227 KB per block, for every
    supported head dim; d = 80 and 96 take d = 128's tiles (their padded width)."""
    from relgen.runtime.arguments import SUPPORTED_HEAD_DIMS
    from relgen.tiles import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        size = torch.finfo(dtype).bits // 8
        for d in SUPPORTED_HEAD_DIMS:
            for terms in (("query",), ("query", "key"), ("bias",)):
                cfg = configs.default_config(dtype, d, 8192, terms)
                cfg.check()
                width = configs.head_block(d) * size
                fwd, bwd, kv = cfg.forward, cfg.backward, cfg.key_pass
                operands = {
                    "forward": fwd.block_m * width + fwd.num_stages * 2 * fwd.block_n * width,
                    "query pass": 2 * bwd.block_m * width + bwd.num_stages * 2 * bwd.block_n * width,
                    "key pass": 2 * kv.block_n * width + kv.num_stages * 2 * kv.block_m * width,
                    "projection": (cfg.project.block_t + cfg.project.num_stages * cfg.project.block_w) * width,
                }
                over = {name: b for name, b in operands.items() if b > 227 * 1024}
                assert not over, (dtype, d, terms, over)
        for d in (80, 96):
            assert configs.default_config(dtype, d, 8192) == configs.default_config(dtype, 128, 8192)


# -- grouped-query attention: k and v with H_kv heads, query head h reading key/value head h // (H / H_kv) ----------
@pytest.mark.parametrize(
    ("name", "h", "h_kv", "layout", "d"),
    slow_values(
        [
            ("shaw", 4, 2, "bhnd", 16),
            ("shaw", 4, 1, "bnhd", 16),
            (QUERY_KEY, 4, 2, "bnhd", 16),
            (QUERY_KEY, 4, 1, "bhnd", 16),
            (QUERY_KEY, 4, 2, "bhnd", 80),
            (ATOMIC, 4, 2, "bhnd", 16),
            (ATOMIC, 2, 1, "bnhd", 24),
            ("t5_decoder", 4, 1, "bnhd", 16),
            ("wav2vec2_bert", 4, 2, "bhnd", 16),  # tables shared by all heads
        ],
        fast=[(ATOMIC, 2, 1, "bnhd", 24)],
    ),
    ids=lambda x: spec_id(x) if isinstance(x, dict) else str(x),
)
def test_grouped_query_attention_matches_the_reference(name, h, h_kv, layout, d):
    spec = load(name)
    inputs = layout_inputs(spec, b=1, h=h, h_kv=h_kv, nq=23, nk=18, d=d, layout=layout, seed=h_kv)
    assert_all_close(compare(spec, inputs, layout=layout), f"{spec_id(name)} H={h} H_kv={h_kv} {layout} d={d}")


@SLOW
def test_grouped_query_attention_expands_no_key_or_value_head():
    """dK and dV are summed over each group inside the kernels: no tensor of K's shape with H heads (a
    repeat_interleave of k or v, or an fp32 partial per query head) is ever made, forward or backward."""
    spec = load(QUERY_KEY)
    inputs = layout_inputs(spec, b=1, h=4, h_kv=1, nq=20, nk=24, layout="bnhd", seed=5)
    expanded = {(1, 24, 4, 16), (1, 4, 24, 16)}

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made: set[tuple[int, ...]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.made.add(tuple(t.shape))
            return out

    fn = relgen.compile_mechanism(spec)
    with Shapes() as shapes:
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, layout="bnhd")
        grads = torch.autograd.grad(out, [inputs.k, inputs.v], torch.randn_like(out))
    assert not expanded & shapes.made, expanded & shapes.made
    assert all(g.shape == (1, 24, 1, 16) for g in grads)


@SLOW
def test_grouped_query_attention_is_deterministic_and_drops_out_per_query_head():
    """Two identical backward passes give the same bits (dK, dV summed over the group in a fixed order), and
    dropout draws each query head's own mask, the one the testing helper regenerates for [B, H, Nq, Nk]."""
    spec = load(QUERY_KEY)
    inputs = layout_inputs(spec, b=1, h=4, h_kv=2, nq=30, layout="bnhd", seed=7)
    first, second = gradient_runs(spec, inputs, layout="bnhd", dropout_p=0.3, dropout_seed=11)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    keep = dropout_keep_mask((1, 4, 30, 30), 0.3, 11, device=DEVICE)
    results = compare(spec, inputs, layout="bnhd", dropout_p=0.3, dropout_seed=11, keep_mask=keep)
    assert_all_close(results, "dropout, H=4, H_kv=2")


@SLOW
def test_grouped_query_attention_with_packed_sequences():
    """Packed q [total, H, d] with k, v [total, H_kv, d]; each sequence attends within itself."""
    spec = load(QUERY_KEY)
    cu = torch.tensor([0, 9, 30], dtype=torch.int32, device=DEVICE)
    base = layout_inputs(spec, b=1, h=4, h_kv=2, nq=30, seed=12)
    q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (base.q, base.k, base.v))
    packed = Inputs(q, k, v, base.tables)
    assert_all_close(compare(spec, packed, cu_seqlens=cu, max_seqlen=21), "packed, H=4, H_kv=2")


@SLOW
@pytest.mark.parametrize("split", [1, 2, 4])
def test_grouped_query_key_pass_split_over_programs(split):
    """A group's heads over `split` key-pass programs (AttnTiles.group_split; their fp32 dK and dV added by the
    host), packed and with dropout: the reference's gradients, the same bits on a second backward, and one
    group's split the same dK, dV within fp32 rounding as the whole group in one program."""
    from dataclasses import replace

    from relgen.tiles.configs import INTERPRETER_CONFIG
    from relgen.tiles.select import override_config

    spec = load(QUERY_KEY)
    config = replace(INTERPRETER_CONFIG, backward_kv=replace(INTERPRETER_CONFIG.key_pass, group_split=split))
    cu = torch.tensor([0, 9, 30], dtype=torch.int32, device=DEVICE)
    base = layout_inputs(spec, b=1, h=4, h_kv=1, nq=30, seed=13)
    q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (base.q, base.k, base.v))
    packed = Inputs(q, k, v, base.tables)
    bnhd = layout_inputs(spec, b=1, h=4, h_kv=1, nq=30, layout="bnhd", seed=14)
    keep = dropout_keep_mask((1, 4, 30, 30), 0.3, 11, device=DEVICE)
    with override_config(config):
        assert_all_close(compare(spec, packed, cu_seqlens=cu, max_seqlen=21), f"packed, H_kv=1, split {split}")
        dropped = dict(layout="bnhd", dropout_p=0.3, dropout_seed=11)
        assert_all_close(compare(spec, bnhd, keep_mask=keep, **dropped), f"dropout, H_kv=1, split {split}")
        first, second = gradient_runs(spec, bnhd, **dropped)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    whole = replace(config, backward_kv=replace(config.key_pass, group_split=1))
    with override_config(whole):
        (unsplit,) = gradient_runs(spec, bnhd, runs=1, **dropped)
    for a, b in zip(first, unsplit, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("shapes", "argument"),
    [
        ({"k": (1, 3, 8, 16), "v": (1, 3, 8, 16)}, "k"),  # 4 query heads are not a multiple of 3
        ({"k": (1, 8, 2, 16), "v": (1, 8, 2, 16)}, "k"),  # [B, N, H, d] given to a 'bhnd' call: H_kv = 8
        ({"v": (1, 1, 8, 16)}, "v"),  # v's heads differ from k's
    ],
)
def test_bad_key_value_heads_raise_value_error_naming_them(shapes, argument):
    spec = load("shaw")
    fn = relgen.compile_mechanism(spec)
    tensors = {"q": (1, 4, 8, 16), "k": (1, 2, 8, 16), "v": (1, 2, 8, 16), **shapes}
    args = {name: torch.zeros(shape, device=DEVICE) for name, shape in tensors.items()}
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        fn(**args, aq=torch.zeros(4, 513, 16, device=DEVICE))
    packed = {name: t[0].transpose(0, 1) for name, t in args.items()}  # [8, H, 16]
    if argument == "k" and packed["k"].shape[1] == 3:
        cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match=r"^k\b"):
            fn(**packed, aq=torch.zeros(4, 513, 16, device=DEVICE), cu_seqlens=cu)


# -- on a GPU (run on the H200): fp16 and bf16 up to N = 8K by the paper's criterion ---------------------------------
GPU_CASES = [  # (spec, layout, H, H_kv, d)
    ("shaw", "bnhd", 4, 1, 128),
    ("deberta_v3", "bnhd", 4, 2, 64),
    ("t5", "bhnd", 4, 2, 96),
    ("txl", "bnhd", 2, 2, 256),
    (ATOMIC, "bnhd", 4, 2, 80),
]


def _compare_long(spec, inputs, dtype, layout):
    """Output and every gradient against test_gpu's decomposed FP64 reference ([B, H, N, N] scores, which fits at
    8K), given [B, H, N, d] views of the inputs with k and v repeated to H heads: what the kernels must equal."""
    from test_gpu import decomposed_reference

    def heads_major(t):
        return t.transpose(1, 2) if layout == "bnhd" else t

    q, k, v = (heads_major(t) for t in (inputs.q, inputs.k, inputs.v))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    out = relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables, layout=layout)
    ref = heads_major(decomposed_reference(spec, q, k, v, **inputs.tables))
    results = [("out", *check_close(out, ref, dtype))]
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    names, leaves = zip(*inputs.leaves.items(), strict=True)
    got = torch.autograd.grad(out, leaves, do)
    want = torch.autograd.grad(ref, leaves, do.double())
    return results + [(f"d{n}", *check_close(g, w, dtype)) for n, g, w in zip(names, got, want, strict=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1000, 4096, 8192])
@pytest.mark.parametrize(
    ("name", "layout", "h", "h_kv", "d"), GPU_CASES, ids=lambda x: spec_id(x) if isinstance(x, dict) else str(x)
)
def test_layouts_and_grouped_query_attention_on_gpu(name, layout, h, h_kv, d, n, dtype):
    spec = load(name)
    inputs = layout_inputs(spec, b=1, h=h, h_kv=h_kv, nq=n, d=d, layout=layout, seed=n + d, dtype=dtype)
    results = _compare_long(spec, inputs, dtype, layout)
    assert_all_close(results, f"{spec_id(name)} {layout} H={h} H_kv={h_kv} d={d} N={n} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [24, 40, 80, 96, 160, 192, 256])
@pytest.mark.parametrize("name", ["shaw", "deberta_v3", "t5_decoder"])
def test_head_dims_on_gpu(name, d, dtype):
    """Every kind of padding (to 32, 64, 128, 256) in the compiled kernels, fp32 exact like the others."""
    spec = load(name)
    inputs = layout_inputs(spec, b=2, h=2, nq=700, nk=611, d=d, layout="bnhd", seed=d, dtype=dtype)
    assert_all_close(compare(spec, inputs, dtype=dtype, layout="bnhd"), f"{name} d={d} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize(("h", "h_kv"), [(4, 1), (4, 2), (8, 2)])
def test_bnhd_and_grouped_query_attention_through_descriptors_on_gpu(h, h_kv):
    """The saturated tiles' TMA loads over [B, H_kv, N, d] views with a 'bnhd' call's strides, on Hopper."""
    spec = load("shaw")  # saturates beyond ±256: saturated tiles from N = 512 on
    inputs = layout_inputs(spec, b=1, h=h, h_kv=h_kv, nq=2048, d=64, layout="bnhd", seed=h, dtype=torch.float16)
    with descriptors.forced(True):
        results = compare(spec, inputs, dtype=torch.float16, layout="bnhd")
    assert_all_close(results, f"shaw bnhd H={h} H_kv={h_kv} descriptors")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["shaw", "deberta_v3", "t5"])
def test_grouped_query_attention_is_bitwise_deterministic_on_gpu(name):
    spec = load(name)
    inputs = layout_inputs(spec, b=2, h=8, h_kv=2, nq=2048, d=128, layout="bnhd", seed=3, dtype=torch.float16)
    runs = gradient_runs(spec, inputs, runs=3, layout="bnhd")
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))
