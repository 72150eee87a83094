"""Packed sequences with separate query and key packing (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
outputs, LSE and every gradient against the FP64 reference; FlashAttention's bottom-right alignment (query i of
a sequence with Lq queries and Lk keys at q_offset + Lk − Lq + i) checked against dense attention; the errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import Inputs, assert_all_close, compare, load
from tiers import SLOW

import relgen
from relgen import reference
from relgen.check.verify import gradient_runs
from relgen.runtime import arguments
from relgen.runtime.custom_ops import compiled_packing
from relgen.testing import check_close, dropout_keep_mask

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: ±δ share a row: the atomic path
ATOMIC = {
    "name": "atomic17_varlen",
    "terms": ["query", "bias"],
    "map": {"kind": "expression", "expr": "Min(Abs(delta), 16)", "rows": 17},
}
#: a causal spec with query and key terms on a clipped map
CAUSAL_QK = {
    "name": "qk_causal",
    "terms": ["query", "key"],
    "map": {"kind": "clipped", "min": -6, "max": 5},
    "causal": True,
}


def starts(lengths, device=DEVICE):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed_length(lq, lk, q_offset=0, k_offset=0):
    """The identity map's L of a packed call, as the README states it."""
    return max(q_offset, k_offset) + max(max(lq), max(lk))


def packed_inputs(spec, lq, lk, *, h=2, h_kv=None, d=16, length=None, seed=0, dtype=torch.float32):
    """Leaves q [Σ lq, H, d], k, v [Σ lk, H_kv, d] and the spec's tables (per query head) for identity maps' L =
    `length`."""
    h_kv = h if h_kv is None else h_kv
    rows = spec.map.num_rows(length or max(max(lq), max(lk)))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype).requires_grad_()

    shape = (rows, d) if spec.heads_share_tables else (h, rows, d)
    tables = {}
    if spec.has_query:
        tables["aq"] = rand(*shape, scale=0.5)
    if spec.has_key:
        tables["ak"] = rand(*shape, scale=0.5)
    if spec.has_bias:
        tables["bias"] = (torch.randn(*shape[:-1], generator=gen)).to(DEVICE).requires_grad_()
    return Inputs(rand(sum(lq), h, d), rand(sum(lk), h_kv, d), rand(sum(lk), h_kv, d), tables)


def packed_call(spec, lq, lk, h, h_kv, q_offset=0, k_offset=0):
    """(inputs, options) of a packed call: packed_inputs for the call's identity-map L, and its packing and offsets."""
    length = packed_length(lq, lk, q_offset, k_offset)
    inputs = packed_inputs(spec, lq, lk, h=h, h_kv=h_kv, length=length, seed=len(lq))
    return inputs, {**packing(lq, lk), "q_offset": q_offset, "k_offset": k_offset}


def packing(lq, lk, max_q=None, max_k=None):
    return {
        "cu_seqlens_q": starts(lq),
        "cu_seqlens_k": starts(lk),
        "max_seqlen_q": max(lq) if max_q is None else max_q,
        "max_seqlen_k": max(lk) if max_k is None else max_k,
    }


# -- against the FP64 reference ---------------------------------------------------------------------------------
CASES = [  # (spec, queries per sequence, keys per sequence, H, H_kv, q_offset, k_offset)
    # clipped map; Lq < Lk, an empty query sequence, Lq > Lk, Lq = Lk; multi-query attention; offsets
    ("shaw", [3, 0, 7, 5], [6, 4, 2, 5], 2, 1, 2, 1),
    # identity map (its tables' size follows L); a key offset beyond the query offset
    ("txl", [5, 9], [12, 3], 2, 2, 0, 3),
    # causal, bias only: queries before the first key of their sequence see none (Lq > Lk), a sequence without keys
    ("t5_decoder", [4, 6, 0, 2], [9, 0, 3, 2], 2, 2, 0, 0),
    # the atomic path (±δ share a row), grouped-query attention H = 4, H_kv = 2
    (ATOMIC, [6, 3], [2, 10], 4, 2, 1, 0),
    # causal with query and key terms, in-sequence offsets larger than the band
    (CAUSAL_QK, [2, 11], [13, 4], 2, 2, 0, 0),
]


def _id(case):
    spec = case[0]
    return spec if isinstance(spec, str) else spec["name"]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_separate_packing_matches_reference(case):
    name, lq, lk, h, h_kv, q_offset, k_offset = case
    spec = load(name)
    inputs, options = packed_call(spec, lq, lk, h, h_kv, q_offset, k_offset)
    assert_all_close(compare(spec, inputs, **options), f"{_id(case)} lq={lq} lk={lk}")


@SLOW
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=3).filter(
        lambda pairs: sum(a for a, _ in pairs) > 0 and sum(b for _, b in pairs) > 0
    ),
    extra=st.integers(0, 3),
)
def test_random_lengths_and_padded_maxima_match_reference(lengths, extra):
    """Any lengths, with max_seqlen_q / max_seqlen_k above the real maxima (as a caller bucketing its lengths
    passes them)."""
    spec = load("t5")
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    max_q, max_k = min(max(lq) + extra, sum(lq)), min(max(lk) + extra, sum(lk))
    inputs = packed_inputs(spec, lq, lk, h=2, seed=extra)
    assert_all_close(compare(spec, inputs, **packing(lq, lk, max_q, max_k)), f"lq={lq} lk={lk} max={max_q},{max_k}")


@SLOW
def test_dropout_lse_and_layouts():
    """Dropout draws the mask the testing helper regenerates for [S, H, max_seqlen_q, max_seqlen_k] (sequence s
    using its top-left [Lq, Lk] block); LSE is [total_q, H], −inf for a query without keys; packed tensors ignore
    `layout` (the same bits either way)."""
    spec = load("shaw")
    lq, lk = [4, 3, 6], [7, 0, 2]
    inputs = packed_inputs(spec, lq, lk, h=2, h_kv=1, seed=3)
    options = {**packing(lq, lk), "dropout_p": 0.25, "dropout_seed": 21}
    keep = dropout_keep_mask((3, 2, 6, 7), 0.25, 21, device=DEVICE)
    assert_all_close(compare(spec, inputs, **options, keep_mask=keep), "dropout")

    fn = relgen.compile_mechanism(spec)
    args = (inputs.q, inputs.k, inputs.v)
    out, lse = fn(*args, **inputs.tables, **packing(lq, lk), return_lse=True)
    out_bnhd, lse_bnhd = fn(*args, **inputs.tables, **packing(lq, lk), return_lse=True, layout="bnhd")
    assert torch.equal(out, out_bnhd) and torch.equal(lse, lse_bnhd)
    want_out, want_lse = reference.attention(spec, *args, **inputs.tables, **packing(lq, lk), return_lse=True)
    for name, got, want in (("out", out, want_out), ("lse", lse, want_lse)):
        ok, message = check_close(got, want, torch.float32)
        assert ok, f"{name}: {message}"
    assert lse.shape == (sum(lq), 2) and torch.isneginf(lse[4:7]).all()  # the second sequence has no keys


def test_unproven_map_is_planned_for_the_offsets_packed_calls_reach():
    """A map whose saturation the analyzer cannot prove is re-planned for 1 + the largest |δ| a call reaches; a
    packed sequence with 2 queries and 70 keys reaches δ = 69 (its last query, at position 69, meets key 0)."""
    spec = load(
        {
            "name": "unproven_varlen",
            "terms": ["bias"],
            "map": {"kind": "expression", "expr": "floor(Max(Min(delta, 5), -5) / 2) + 5 + delta - delta", "rows": 11},
        }
    )
    fn = relgen.compile_mechanism(spec)
    lq, lk = [2, 3], [70, 4]
    inputs = packed_inputs(spec, lq, lk, seed=2)
    options = packing(lq, lk)
    assert fn.module.PLAN.valid_up_to < 70
    assert arguments.reach(fn.module.PLAN, inputs.q, inputs.k, inputs.v, options) == 70
    assert_all_close(compare(spec, inputs, **options), "unproven map, Lk = 70")


@SLOW
def test_offset_path_backward_is_deterministic():
    """Two identical backward passes of a packed call with separate packing give the same bits."""
    spec = load("shaw")
    lq, lk = [5, 1, 6], [3, 7, 6]
    inputs = packed_inputs(spec, lq, lk, h=2, h_kv=1, seed=6)
    first, second = gradient_runs(spec, inputs, **packing(lq, lk))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@SLOW
def test_equal_packing_through_either_name_is_the_same_call():
    """cu_seqlens_q = cu_seqlens_k = cu is what cu_seqlens = cu stands for: the same bits, the same gradients."""
    spec = load("t5")
    lengths = [5, 0, 8]
    inputs = packed_inputs(spec, lengths, lengths, seed=5)
    fn = relgen.compile_mechanism(spec)
    leaves = list(inputs.leaves.values())
    cu = starts(lengths)
    runs = []
    for options in ({"cu_seqlens": cu, "max_seqlen": 8}, {"cu_seqlens_q": cu, "cu_seqlens_k": cu}):
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
        runs.append((out, *torch.autograd.grad(out, leaves, torch.ones_like(out))))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


# -- the alignment against dense attention ------------------------------------------------------------------------
def test_chunked_prefill_rows_are_the_full_sequences_last_rows():
    """A chunk of a sequence's last Lq queries against all its Lk keys (chunked prefill, decoding with Lq = 1) gives
    the last Lq rows of dense causal attention over the whole sequence, whatever the map (identity here: its
    tables are sized for L = the longest sequence)."""
    spec = load({"name": "txl_causal", "terms": ["query", "bias"], "map": {"kind": "identity"}, "causal": True})
    lk, lq = [12, 7], [4, 1]
    length = max(lk)
    full = packed_inputs(spec, lk, lk, h=2, length=length, seed=8)  # q for every position, to cut chunks from
    bounds = starts(lk).tolist()
    chunks = [full.q.detach()[b - n : b] for b, n in zip(bounds[1:], lq, strict=True)]
    q = torch.cat(chunks).requires_grad_()
    fn = relgen.compile_mechanism(spec)
    out = fn(q, full.k, full.v, **full.tables, **packing(lq, lk))
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        dense = [t.detach()[a:b].transpose(0, 1).unsqueeze(0) for t in (full.q, full.k, full.v)]
        want = reference.attention(spec, *dense, **full.tables, length=length)[0].transpose(0, 1)[-lq[s] :]
        got = out[sum(lq[:s]) : sum(lq[: s + 1])]
        ok, message = check_close(got, want, torch.float32)
        assert ok, f"sequence {s}: {message}"


def test_reference_alignment_is_dense_attention_with_a_query_offset():
    """The oracle's own rule, from dense attention: a sequence with Lq queries and Lk keys is dense attention with
    q_offset + Lk − Lq as its query offset (Lq ≤ Lk; Lq > Lk puts the first queries before every key)."""
    spec = load("shaw")
    lq, lk = [3, 5], [8, 2]
    inputs = packed_inputs(spec, lq, lk, seed=11)
    length = packed_length(lq, lk, 1, 0)
    got = reference.attention(spec, inputs.q, inputs.k, inputs.v, **inputs.tables, **packing(lq, lk), q_offset=1)
    q, k, v = (t.detach()[None].transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
    first = reference.attention(spec, q[:, :, :3], k[:, :, :8], v[:, :, :8], **inputs.tables, q_offset=1 + 5,
                                length=length)  # fmt: skip
    # the second sequence's queries sit at 1 + 2 − 5 + i = i − 2: both offsets shifted by 2 keep every δ
    second = reference.attention(spec, q[:, :, 3:], k[:, :, 8:], v[:, :, 8:], **inputs.tables, k_offset=2,
                                 length=length)  # fmt: skip
    want = torch.cat([first[0].transpose(0, 1), second[0].transpose(0, 1)])
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


# -- errors: ValueError naming the argument, before any kernel ----------------------------------------------------
def _bad_calls():
    cq, ck = [0, 4, 9], [0, 3, 10]

    def t(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype)

    return [
        ({"cu_seqlens": t(cq)}, "cu_seqlens"),  # both forms
        ({"max_seqlen": 5}, "max_seqlen"),  # both forms
        ({"cu_seqlens_k": None}, "cu_seqlens_k"),
        ({"cu_seqlens_q": None}, "cu_seqlens_q"),
        ({"cu_seqlens_k": t(ck, torch.int64)}, "cu_seqlens_k"),
        ({"cu_seqlens_k": t([ck])}, "cu_seqlens_k"),  # 2-D
        ({"cu_seqlens_k": ck}, "cu_seqlens_k"),  # a list
        ({"cu_seqlens_q": t([1, 4, 9])}, "cu_seqlens_q"),  # not from 0
        ({"cu_seqlens_k": t([0, 6, 3])}, "cu_seqlens_k"),  # decreasing, and not ending at the keys' count
        ({"cu_seqlens_k": t([0, 3, 9])}, "cu_seqlens_k"),  # k holds 10 tokens
        ({"cu_seqlens_q": t([0, 4, 10])}, "cu_seqlens_q"),  # q holds 9 tokens
        ({"cu_seqlens_k": t([0, 3, 6, 10])}, "cu_seqlens_k"),  # three sequences against two
        ({"max_seqlen_q": 4}, "max_seqlen_q"),  # the longest query sequence has 5
        ({"max_seqlen_k": 11}, "max_seqlen_k"),  # more than the 10 keys present
        ({"max_seqlen_k": 7.0}, "max_seqlen_k"),
        ({"max_seqlen_q": True}, "max_seqlen_q"),
        ({"key_padding_mask": torch.ones(2, 7, dtype=torch.bool)}, "key_padding_mask"),
        ({"v": torch.zeros(9, 1, 16)}, "v"),  # v's tokens are q's, not k's
        ({"k": torch.zeros(10, 3, 16), "v": torch.zeros(10, 3, 16)}, "k"),  # 3 does not divide H = 2
        ({"q_offset": (1 << 29) - 3}, "q_offset"),  # beyond relgen.runtime.arguments.MAX_POSITION
    ]


@pytest.mark.parametrize(("changes", "argument"), _bad_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_separate_packing_raises_value_error_naming_it(changes, argument):
    spec = load("t5")
    fn = relgen.compile_mechanism(spec)
    args = {
        "q": torch.zeros(9, 2, 16),
        "k": torch.zeros(10, 1, 16),
        "v": torch.zeros(10, 1, 16),
        "cu_seqlens_q": torch.tensor([0, 4, 9], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 3, 10], dtype=torch.int32),
        **changes,
    }
    args = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        fn(bias=torch.zeros(2, 32, device=DEVICE), **args)


def test_reference_refuses_both_forms():
    spec = load("t5")
    x = torch.zeros(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        reference.attention(spec, x, x, x, bias=torch.zeros(2, 32), cu_seqlens=cu, max_seqlen=4, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        reference.attention(spec, x, x, x, bias=torch.zeros(2, 32), cu_seqlens_q=cu, max_seqlen_q=4)


def test_torch_compile_takes_equal_packing_only():
    """Under torch.compile the ops take cu_seqlens / max_seqlen: the separate names describing equal packing map
    onto them, different query and key packing is NotImplementedError (eager only)."""
    cu, other = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    none = dict.fromkeys(("cu_seqlens", "max_seqlen", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
    same = {**none, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 4, "max_seqlen_k": 4}
    assert compiled_packing(same) == {"cu_seqlens": cu, "max_seqlen": 4}
    assert compiled_packing({**none, "cu_seqlens": cu}) == {"cu_seqlens": cu, "max_seqlen": None}
    with pytest.raises(NotImplementedError, match=r"^cu_seqlens_q, cu_seqlens_k"):
        compiled_packing({**same, "cu_seqlens_k": other, "max_seqlen_k": 6})
    with pytest.raises(ValueError, match=r"^cu_seqlens"):
        compiled_packing({**same, "cu_seqlens": cu})


# -- on a GPU (run on the H200): fp16 and bf16 by the paper's criterion ---------------------------------------------
GPU_CASES = [  # (spec, queries per sequence, keys per sequence, H, H_kv)
    ("shaw", [300, 1, 512, 0, 77], [512, 200, 128, 64, 77], 4, 2),
    ("t5_decoder", [64, 1, 257], [640, 300, 257], 4, 1),
    ("txl", [128, 700], [900, 33], 2, 2),
    (ATOMIC, [100, 350], [400, 90], 4, 4),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=_id)
def test_gpu_separate_packing(case, dtype):
    name, lq, lk, h, h_kv = case
    spec = load(name)
    length = packed_length(lq, lk)
    inputs = packed_inputs(spec, lq, lk, h=h, h_kv=h_kv, d=64, length=length, seed=1, dtype=dtype)
    options = {**packing(lq, lk), "dropout_p": 0.1, "dropout_seed": 5}
    keep = dropout_keep_mask((len(lq), h, max(lq), max(lk)), 0.1, 5, device=DEVICE)
    assert_all_close(compare(spec, inputs, **options, keep_mask=keep), f"{_id(case)} {dtype}")
