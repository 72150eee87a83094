"""The FP64 oracle against a textbook formula written here independently.

The textbook side computes φ with the models' own formulas (docs/mechanisms.md, paper §3.2) in plain Python,
and S_ij, the softmax and O with explicit loops over i and j: it shares no code with relgen.reference or
relgen.spec.maps, so agreement checks both the reference's tensor algebra and the maps' row ids.
"""

from __future__ import annotations

import math
from itertools import combinations
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relgen import reference
from relgen.spec.model import load_spec

ROOT = Path(__file__).resolve().parent.parent

# -- φ by the textbook formulas ------------------------------------------------------------------------------


def phi_identity(delta: int, length: int, key_minus_query: bool = False) -> int:
    return (-delta if key_minus_query else delta) + length - 1


def phi_clipped(delta: int, lo: int, hi: int, key_minus_query: bool = False) -> int:
    seen = -delta if key_minus_query else delta
    return min(max(seen, lo), hi) - lo


def phi_t5(delta: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """HF T5 _relative_position_bucket(j − i, ...) as written in docs/mechanisms.md (T5)."""
    rp = -delta  # memory − query
    if bidirectional:
        nb = num_buckets // 2
        base = nb if rp > 0 else 0
        n = abs(rp)
    else:
        nb = num_buckets
        base = 0
        n = max(0, -rp)
    max_exact = nb // 2
    if n < max_exact:
        b = n
    else:
        b = min(
            nb - 1, max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (nb - max_exact))
        )
    return base + b


def phi_log(delta: int, position_buckets: int, max_position: int) -> int:
    """DeBERTa: clamp(make_log_bucket_position(δ) + position_buckets, 0, 2·position_buckets − 1)."""
    mid = position_buckets // 2
    if abs(delta) <= mid:
        bucket = delta
    else:
        sign = 1 if delta > 0 else -1
        ratio = math.log(abs(delta) / mid) / math.log((max_position - 1) / mid)
        bucket = sign * (math.ceil(ratio * (mid - 1)) + mid)
    return min(max(bucket + position_buckets, 0), 2 * position_buckets - 1)


def phi_boundaries(delta: int, boundaries: list[int], key_minus_query: bool = False) -> int:
    seen = -delta if key_minus_query else delta
    return sum(1 for b in boundaries if b <= seen)


# name → (map spec, textbook φ(δ, L), R(L))
MAPS = {
    "identity": ({"kind": "identity"}, lambda d, L: phi_identity(d, L), lambda L: 2 * L - 1),
    "identity_kmq": (
        {"kind": "identity", "offset": "key_minus_query"},
        lambda d, L: phi_identity(d, L, True),
        lambda L: 2 * L - 1,
    ),
    "clipped": ({"kind": "clipped", "min": -3, "max": 2}, lambda d, L: phi_clipped(d, -3, 2), lambda L: 6),
    "clipped_kmq": (
        {"kind": "clipped", "min": -4, "max": 1, "offset": "key_minus_query"},
        lambda d, L: phi_clipped(d, -4, 1, True),
        lambda L: 6,
    ),
    "t5_bi": (
        {"kind": "t5", "num_buckets": 8, "max_distance": 6, "bidirectional": True},
        lambda d, L: phi_t5(d, 8, 6, True),
        lambda L: 8,
    ),
    "t5_uni": (
        {"kind": "t5", "num_buckets": 8, "max_distance": 7, "bidirectional": False},
        lambda d, L: phi_t5(d, 8, 7, False),
        lambda L: 8,
    ),
    "log": (
        {"kind": "log", "position_buckets": 8, "max_position": 16},
        lambda d, L: phi_log(d, 8, 16),
        lambda L: 16,
    ),
    "log_small": (
        {"kind": "log", "position_buckets": 4, "max_position": 5},
        lambda d, L: phi_log(d, 4, 5),
        lambda L: 8,
    ),
    "boundaries": (
        {"kind": "boundaries", "boundaries": [-4, -1, 0, 3]},
        lambda d, L: phi_boundaries(d, [-4, -1, 0, 3]),
        lambda L: 5,
    ),
    "boundaries_kmq": (
        {"kind": "boundaries", "boundaries": [-2, 2, 5], "offset": "key_minus_query"},
        lambda d, L: phi_boundaries(d, [-2, 2, 5], True),
        lambda L: 4,
    ),
    "expr_abs": (
        {"kind": "expression", "expr": "Min(Abs(delta), 3)", "rows": 4},
        lambda d, L: min(abs(d), 3),
        lambda L: 4,
    ),
    "expr_shift": (
        {"kind": "expression", "expr": "Max(Min(delta + 2, 5), 0)", "rows": 6},
        lambda d, L: max(min(d + 2, 5), 0),
        lambda L: 6,
    ),
    "expr_kmq": (
        {"kind": "expression", "expr": "Min(Max(delta, -1), 3) + 1", "rows": 5, "offset": "key_minus_query"},
        lambda d, L: min(max(-d, -1), 3) + 1,
        lambda L: 5,
    ),
}
TERM_SETS = [list(c) for n in (1, 2, 3) for c in combinations(("query", "key", "bias"), n)]


def make_spec(map_name: str, terms, *, causal=False, shared=False, scale=None):
    data = {"name": "t", "terms": list(terms), "map": MAPS[map_name][0], "causal": causal, "heads_share_tables": shared}
    if scale is not None:
        data["scale"] = scale
    return load_spec(data)


# -- the textbook formula ------------------------------------------------------------------------------------


def textbook(
    map_name,
    spec,
    q,
    k,
    v,
    aq,
    ak,
    bias,
    *,
    scale=None,
    kpm=None,
    q_offset=0,
    k_offset=0,
    length=None,
    keep=None,
    dropout_p=0.0,
):
    """O [B, H, Nq, dv] and LSE [B, H, Nq] by explicit loops (float64 Python arithmetic)."""
    phi = MAPS[map_name][1]
    batch, heads, nq, d = q.shape
    nk = k.shape[2]
    dv = v.shape[3]
    if length is None:
        length = max(q_offset + nq, k_offset + nk)
    tau = scale if scale is not None else 1.0 / math.sqrt(d)
    shared = spec.heads_share_tables
    Q, K, V = q.tolist(), k.tolist(), v.tolist()
    AQ = aq.tolist() if aq is not None else None
    AK = ak.tolist() if ak is not None else None
    BI = bias.tolist() if bias is not None else None
    out = [[[[0.0] * dv for _ in range(nq)] for _ in range(heads)] for _ in range(batch)]
    lse = [[[-math.inf] * nq for _ in range(heads)] for _ in range(batch)]

    def dot(x, y):
        return sum(a * b for a, b in zip(x, y, strict=True))

    for b in range(batch):
        for h in range(heads):
            for i in range(nq):
                scores = {}
                for j in range(nk):
                    pi, pj = i + q_offset, j + k_offset
                    if spec.causal and pj > pi:
                        continue
                    if kpm is not None and not kpm[b][j]:
                        continue
                    r = phi(pi - pj, length)
                    s = dot(Q[b][h][i], K[b][h][j])
                    if "query" in spec.terms:
                        s += dot(Q[b][h][i], AQ[r] if shared else AQ[h][r])
                    if "key" in spec.terms:
                        s += dot(K[b][h][j], AK[r] if shared else AK[h][r])
                    if "bias" in spec.terms:
                        s += BI[r] if shared else BI[h][r]
                    scores[j] = tau * s
                if not scores:
                    continue
                m = max(scores.values())
                total = sum(math.exp(s - m) for s in scores.values())
                lse[b][h][i] = m + math.log(total)
                for j, s in scores.items():
                    p = math.exp(s - m) / total
                    if keep is not None:
                        p = p * keep[b][h][i][j] / (1.0 - dropout_p)
                    for c in range(dv):
                        out[b][h][i][c] += p * V[b][h][j][c]
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


def random_inputs(spec, map_name, batch, heads, nq, nk, d, length, *, seed=0, dv=None, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rows = MAPS[map_name][2](length)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v = rnd(batch, heads, nq, d), rnd(batch, heads, nk, d), rnd(batch, heads, nk, dv or d)
    lead = () if spec.heads_share_tables else (heads,)
    aq = rnd(*lead, rows, d) if spec.has_query else None
    ak = rnd(*lead, rows, d) if spec.has_key else None
    bias = rnd(*lead, rows) if spec.has_bias else None
    return q, k, v, aq, ak, bias


def close(a, b, tol=1e-10):
    return torch.allclose(a, b, rtol=tol, atol=tol)


# -- φ itself ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("map_name", sorted(MAPS))
def test_relation_rows_match_textbook_phi(map_name):
    spec = make_spec(map_name, ["bias"])
    for nq, nk, qo, ko in [(7, 7, 0, 0), (3, 9, 0, 0), (9, 4, 0, 0), (4, 6, 5, 0), (5, 3, 0, 7), (6, 6, 11, 3)]:
        length = max(qo + nq, ko + nk)
        rows = reference.relation_rows(spec, nq, nk, q_offset=qo, k_offset=ko)
        assert rows.dtype == torch.long and rows.shape == (nq, nk)
        want = [[MAPS[map_name][1](i + qo - j - ko, length) for j in range(nk)] for i in range(nq)]
        assert rows.tolist() == want


def test_textbook_phi_matches_models_over_long_ranges():
    """The plain-Python formulas equal the maps' float32 torch versions far beyond the tiny test sizes."""
    import numpy as np

    deltas = np.arange(-3000, 3001)
    for params in [(32, 128, True), (32, 128, False), (8, 6, True), (8, 7, False), (16, 40, True)]:
        spec = load_spec(
            {
                "name": "t",
                "terms": ["bias"],
                "map": dict(zip(("num_buckets", "max_distance", "bidirectional"), params, strict=True), kind="t5"),
            }
        )
        assert spec.map.row_ids(deltas, 1).tolist() == [phi_t5(int(x), *params) for x in deltas]
    for params in [(256, 512), (8, 16), (4, 5), (64, 100)]:
        spec = load_spec(
            {
                "name": "t",
                "terms": ["bias"],
                "map": {"kind": "log", "position_buckets": params[0], "max_position": params[1]},
            }
        )
        assert spec.map.row_ids(deltas, 1).tolist() == [phi_log(int(x), *params) for x in deltas]


def test_relation_rows_identity_length():
    spec = make_spec("identity", ["query"])
    rows = reference.relation_rows(spec, 3, 3, length=10)
    assert rows.tolist() == [[9 + i - j for j in range(3)] for i in range(3)]
    with pytest.raises(ValueError, match="length"):
        reference.relation_rows(spec, 5, 5, length=3)


# -- the reference against the textbook ----------------------------------------------------------------------


@pytest.mark.parametrize("map_name", sorted(MAPS))
@pytest.mark.parametrize("terms", TERM_SETS, ids="+".join)
def test_every_map_and_term_combination(map_name, terms):
    shared = len(terms) % 2 == 0  # alternate layouts; hypothesis below covers the rest
    spec = make_spec(map_name, terms, shared=shared)
    args = random_inputs(spec, map_name, 2, 2, 6, 6, 3, 6, seed=len(terms))
    out, lse = reference.attention(spec, *args, return_lse=True)
    want_out, want_lse = textbook(map_name, spec, *args)
    assert out.dtype == torch.float64
    assert close(out, want_out) and close(lse, want_lse)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    map_name=st.sampled_from(sorted(MAPS)),
    terms=st.sampled_from(TERM_SETS),
    shared=st.booleans(),
    causal=st.booleans(),
    scale=st.sampled_from([None, 1, 0.37, "1/sqrt(3*d)"]),
    nq=st.integers(1, 9),
    nk=st.integers(1, 9),
    q_offset=st.integers(0, 6),
    k_offset=st.integers(0, 6),
    d=st.integers(1, 4),
    dv=st.integers(1, 3),
    padding=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_textbook(
    map_name, terms, shared, causal, scale, nq, nk, q_offset, k_offset, d, dv, padding, seed
):
    spec = make_spec(map_name, terms, shared=shared, causal=causal, scale=scale)
    length = max(q_offset + nq, k_offset + nk)
    args = random_inputs(spec, map_name, 2, 2, nq, nk, d, length, seed=seed, dv=dv)
    kpm = None
    if padding:
        gen = torch.Generator().manual_seed(seed + 1)
        kpm = torch.rand(2, nk, generator=gen) > 0.3
    out, lse = reference.attention(
        spec, *args, key_padding_mask=kpm, q_offset=q_offset, k_offset=k_offset, return_lse=True
    )
    tau = spec.scale_value(d)
    want_out, want_lse = textbook(
        map_name,
        spec,
        *args,
        scale=tau,
        kpm=None if kpm is None else kpm.tolist(),
        q_offset=q_offset,
        k_offset=k_offset,
    )
    assert torch.isfinite(out).all()
    assert close(out, want_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert close(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)])


def test_custom_scale_overrides_spec():
    spec = make_spec("clipped", ["query", "bias"], scale="1/sqrt(3*d)")
    args = random_inputs(spec, "clipped", 1, 2, 5, 5, 4, 5, seed=3)
    assert close(reference.attention(spec, *args), textbook("clipped", spec, *args, scale=1 / math.sqrt(12))[0])
    assert close(reference.attention(spec, *args, scale=0.7), textbook("clipped", spec, *args, scale=0.7)[0])


def test_scale_1_is_plain_sum():
    """T5: τ = 1, S = q·k + b."""
    spec = make_spec("t5_bi", ["bias"], scale=1)
    args = random_inputs(spec, "t5_bi", 1, 2, 7, 7, 4, 7, seed=4)
    assert close(reference.attention(spec, *args), textbook("t5_bi", spec, *args, scale=1.0)[0])


@pytest.mark.parametrize("map_name", ["identity", "clipped", "t5_uni", "log"])
def test_causal_with_offsets(map_name):
    """Causal masking compares absolute positions; Nq ≠ Nk (a decoding chunk over a longer cache)."""
    spec = make_spec(map_name, ["query", "key", "bias"], causal=True)
    nq, nk, qo = 3, 8, 5  # queries at positions 5..7 see keys 0..5+i
    args = random_inputs(spec, map_name, 2, 2, nq, nk, 3, 8, seed=5)
    out, lse = reference.attention(spec, *args, q_offset=qo, return_lse=True)
    want_out, want_lse = textbook(map_name, spec, *args, q_offset=qo)
    assert close(out, want_out) and close(lse, want_lse)
    # offsets shift φ: without q_offset the result differs
    assert not close(out, reference.attention(spec, *args))


def test_fully_padded_batch_row_gives_zeros_and_finite_grads():
    spec = make_spec("log", ["query", "key", "bias"])
    q, k, v, aq, ak, bias = (
        None if x is None else x.requires_grad_() for x in random_inputs(spec, "log", 2, 2, 5, 6, 3, 6, seed=6)
    )
    kpm = torch.tensor([[True, False, True, True, False, True], [False] * 6])
    out, lse = reference.attention(spec, q, k, v, aq, ak, bias, key_padding_mask=kpm, return_lse=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    want_out, want_lse = textbook(
        "log", spec, q.detach(), k.detach(), v.detach(), aq.detach(), ak.detach(), bias.detach(), kpm=kpm.tolist()
    )
    assert close(out, want_out) and close(lse[0], want_lse[0])
    (out.square().sum() + lse[0].sum()).backward()
    for t in (q, k, v, aq, ak, bias):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1]))
    assert torch.equal(v.grad[1], torch.zeros_like(v.grad[1]))
    # padded keys of the real batch row get no gradient either
    assert torch.equal(k.grad[0, :, 1], torch.zeros_like(k.grad[0, :, 1]))
    assert torch.equal(v.grad[0, :, 4], torch.zeros_like(v.grad[0, :, 4]))


def test_causal_rows_without_keys():
    """k_offset past the query: the first queries see no key at all."""
    spec = make_spec("clipped", ["query"], causal=True)
    args = [x.requires_grad_() if x is not None else None for x in random_inputs(spec, "clipped", 1, 2, 4, 4, 3, 6)]
    out, lse = reference.attention(spec, *args, k_offset=2, return_lse=True)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in args if x is not None)


@pytest.mark.parametrize("map_name", ["identity", "t5_bi", "expr_abs"])
def test_packed_equals_separate_sequences(map_name):
    spec = make_spec(map_name, ["query", "key", "bias"])
    lengths, max_seqlen, heads, d = [3, 5, 1, 4], 5, 2, 3
    total = sum(lengths)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(total, heads, d, generator=gen, dtype=torch.float64) for _ in range(3))
    rows = MAPS[map_name][2](max_seqlen)
    aq, ak = (torch.randn(heads, rows, d, generator=gen, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(heads, rows, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    keep = torch.rand(len(lengths), heads, max_seqlen, max_seqlen, generator=gen) > 0.25
    out, lse = reference.attention(
        spec,
        q,
        k,
        v,
        aq,
        ak,
        bias,
        cu_seqlens=cu,
        max_seqlen=max_seqlen,
        keep_mask=keep,
        dropout_p=0.25,
        return_lse=True,
    )
    assert out.shape == (total, heads, d) and lse.shape == (total, heads)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        n = b - a

        def seq(x, a=a, b=b):
            return x[a:b].transpose(0, 1).unsqueeze(0)

        one, one_lse = reference.attention(
            spec,
            seq(q),
            seq(k),
            seq(v),
            aq,
            ak,
            bias,
            length=max_seqlen,
            keep_mask=keep[s : s + 1, :, :n, :n],
            dropout_p=0.25,
            return_lse=True,
        )
        assert close(out[a:b], one[0].transpose(0, 1))
        assert close(lse[a:b], one_lse[0].transpose(0, 1))
        book, book_lse = textbook(
            map_name,
            spec,
            seq(q),
            seq(k),
            seq(v),
            aq,
            ak,
            bias,
            length=max_seqlen,
            keep=keep[s : s + 1, :, :n, :n].double().tolist(),
            dropout_p=0.25,
        )
        assert close(one, book) and close(one_lse, book_lse)


def test_packed_sequences_do_not_see_each_other():
    spec = make_spec("clipped", ["query"])
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(7, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    aq = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    out = reference.attention(spec, q, k, v, aq, cu_seqlens=cu, max_seqlen=4)
    k2, v2 = k.clone(), v.clone()
    k2[4:] += 1.0
    v2[4:] -= 2.0
    out2 = reference.attention(spec, q, k2, v2, aq, cu_seqlens=cu, max_seqlen=4)
    assert torch.equal(out[:4], out2[:4]) and not torch.equal(out[4:], out2[4:])


@pytest.mark.parametrize("shared", [False, True])
def test_keep_mask_dropout(shared):
    spec = make_spec("t5_bi", ["query", "key", "bias"], shared=shared)
    args = random_inputs(spec, "t5_bi", 2, 2, 6, 7, 3, 7, seed=9)
    gen = torch.Generator().manual_seed(10)
    keep = torch.rand(2, 2, 6, 7, generator=gen) > 0.4
    out, lse = reference.attention(spec, *args, keep_mask=keep, dropout_p=0.4, return_lse=True)
    want, want_lse = textbook("t5_bi", spec, *args, keep=keep.double().tolist(), dropout_p=0.4)
    assert close(out, want)
    assert close(lse, reference.attention(spec, *args, return_lse=True)[1]) and close(lse, want_lse)
    # all kept, p = 0: plain attention
    all_kept = torch.ones_like(keep)
    assert close(reference.attention(spec, *args, keep_mask=all_kept), reference.attention(spec, *args))


def test_lse_is_natural_log_sum_exp():
    spec = make_spec("boundaries", ["bias"], scale=0.5)
    q, k, v, aq, ak, bias = random_inputs(spec, "boundaries", 1, 2, 4, 5, 3, 5, seed=11)
    _, lse = reference.attention(spec, q, k, v, aq, ak, bias, return_lse=True)
    rows = reference.relation_rows(spec, 4, 5)
    scores = 0.5 * (q @ k.transpose(-1, -2) + bias[:, rows][None])
    assert close(lse, torch.logsumexp(scores, dim=-1))


def test_inputs_of_other_dtypes_get_float64_and_gradients():
    spec = make_spec("clipped", ["query", "key"])
    args = random_inputs(spec, "clipped", 1, 2, 4, 4, 3, 4, seed=12, dtype=torch.float32)
    args = [x.requires_grad_() if x is not None else None for x in args]
    out = reference.attention(spec, *args)
    assert out.dtype == torch.float64
    out.sum().backward()
    assert args[0].grad.dtype == torch.float32 and args[3].grad is not None


def test_tables_of_absent_terms_are_ignored():
    spec = make_spec("clipped", ["query"])
    q, k, v, aq, _, _ = random_inputs(spec, "clipped", 1, 2, 4, 4, 3, 4, seed=13)
    junk = torch.full((2, 6, 3), float("nan"), dtype=torch.float64)
    assert torch.equal(
        reference.attention(spec, q, k, v, aq, junk, junk[..., 0]), reference.attention(spec, q, k, v, aq)
    )


# -- errors --------------------------------------------------------------------------------------------------


def test_errors_name_the_argument():
    spec = make_spec("clipped", ["query", "bias"])
    q, k, v, aq, _, bias = random_inputs(spec, "clipped", 1, 2, 4, 4, 3, 4)
    with pytest.raises(ValueError, match="aq"):
        reference.attention(spec, q, k, v, None, None, bias)
    with pytest.raises(ValueError, match="bias"):
        reference.attention(spec, q, k, v, aq)
    with pytest.raises(ValueError, match="aq"):
        reference.attention(spec, q, k, v, aq[:, :5], None, bias)
    with pytest.raises(ValueError, match="aq"):
        reference.attention(spec, q, k, v, aq[0], None, bias)  # shared layout for a per-head spec
    with pytest.raises(ValueError, match="bias"):
        reference.attention(spec, q, k, v, aq, None, bias[:, :, None])
    with pytest.raises(ValueError, match="k must"):
        reference.attention(spec, q, k[..., :2], v, aq, None, bias)
    with pytest.raises(ValueError, match="v must"):
        reference.attention(spec, q, k, v[:, :, :3], aq, None, bias)
    with pytest.raises(ValueError, match="q must"):
        reference.attention(spec, q[0], k, v, aq, None, bias)
    with pytest.raises(ValueError, match="key_padding_mask"):
        reference.attention(spec, q, k, v, aq, None, bias, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep_mask"):
        reference.attention(spec, q, k, v, aq, None, bias, keep_mask=torch.ones(1, 2, 4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep_mask"):
        reference.attention(spec, q, k, v, aq, None, bias, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        reference.attention(spec, q, k, v, aq, None, bias, dropout_p=1.0)
    flat = q[0].transpose(0, 1).contiguous()
    with pytest.raises(ValueError, match="max_seqlen"):
        reference.attention(spec, flat, flat, flat, aq, None, bias, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        reference.attention(
            spec, flat, flat, flat, aq, None, bias, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32), max_seqlen=4
        )
    with pytest.raises(ValueError, match="key_padding_mask"):
        reference.attention(
            spec,
            flat,
            flat,
            flat,
            aq,
            None,
            bias,
            cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
            max_seqlen=4,
            key_padding_mask=torch.ones(1, 4, dtype=torch.bool),
        )
    shared = make_spec("clipped", ["query"], shared=True)
    with pytest.raises(ValueError, match=r"aq.*heads_share_tables"):
        reference.attention(shared, q, k, v, aq)


# -- gradients -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("map_name", "shared", "causal", "padded", "dropout"),
    [
        ("clipped", False, False, False, False),
        ("t5_bi", True, False, True, False),
        ("log", False, True, False, True),
        ("identity", True, True, True, True),
        ("expr_abs", False, False, True, False),
    ],
)
def test_gradcheck(map_name, shared, causal, padded, dropout):
    spec = make_spec(map_name, ["query", "key", "bias"], shared=shared, causal=causal)
    nq, nk, qo = 3, 4, 1
    length = max(qo + nq, nk)
    inputs = [x.requires_grad_() for x in random_inputs(spec, map_name, 2, 2, nq, nk, 2, length, seed=14)]
    kpm = torch.tensor([[True, False, True, True], [False] * 4]) if padded else None
    keep = (torch.rand(2, 2, nq, nk, generator=torch.Generator().manual_seed(15)) > 0.3) if dropout else None
    p = 0.3 if dropout else 0.0

    def fn(*xs):
        out, lse = reference.attention(
            spec, *xs, key_padding_mask=kpm, keep_mask=keep, dropout_p=p, q_offset=qo, return_lse=True
        )
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_gradcheck_packed():
    spec = make_spec("identity", ["query", "bias"])
    gen = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(5, 2, 2, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    aq = torch.randn(2, 5, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)

    def fn(q, k, v, aq, bias):
        return reference.attention(spec, q, k, v, aq, None, bias, cu_seqlens=cu, max_seqlen=3, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, aq, bias), eps=1e-6, atol=1e-7)


# -- the tolerance criterion (relgen.testing) ----------------------------------------------------------------


def test_tolerance_criterion():
    from relgen.testing import assert_close, check_close, tolerance

    assert tolerance(torch.float16).rel_l2 == pytest.approx(0.0078125)  # 0.78 %: the paper's figure
    assert tolerance("bf16").rel_l2 == pytest.approx(0.0625)
    gen = torch.Generator().manual_seed(17)
    e = torch.randn(4096, generator=gen, dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        ok, message = check_close(e.to(dtype), e, dtype)
        assert ok and "rel ℓ2" in message and "max |a−e|" in message  # rounding to the dtype passes
    assert not check_close(e.float() * (1 + 1e-4), e, torch.float32)[0]  # 1e-4 relative is too much for fp32
    assert check_close(e * (1 + 5e-6), e, torch.float32)[0]
    # fp16: one element far off but a tiny ℓ2 error passes (ℓ2 criterion); a uniform 1 % error passes elementwise
    spike = e.clone()
    spike[7] += 0.3  # rel ℓ2 ≈ 0.3/‖e‖ ≈ 0.5 %, but 0.3 > 0.05·|e| + 0.03
    assert check_close(spike, e, torch.float16)[0]
    assert check_close(e * 1.01, e, torch.float16)[0]
    assert not check_close(e * 1.1, e, torch.float16)[0]
    assert check_close(e * 1.05, e, torch.bfloat16)[0]
    bad = e.clone()
    bad[3] = float("nan")
    assert not check_close(bad, e, torch.float16)[0]
    bad[3] = float("inf")
    assert not check_close(bad, e, torch.bfloat16)[0]
    lse = torch.tensor([0.5, -math.inf, 2.0], dtype=torch.float64)
    assert check_close(lse.float(), lse, torch.float32)[0]  # matching −inf (rows without keys) is fine
    assert not check_close(torch.tensor([0.5, 0.0, 2.0]), lse, torch.float32)[0]
    zero = torch.zeros(5, dtype=torch.float64)
    assert check_close(torch.full((5,), 1e-7), zero, torch.float32)[0]
    assert not check_close(torch.full((5,), 1e-3), zero, torch.float32)[0]
    assert check_close(torch.full((5,), 0.02), zero, torch.float16)[0]
    # an FP64 residue of an exactly cancelling sum is zero too (it used to switch the fp32 floor to 2e-6)
    residue = torch.full((5,), -2.6e-15, dtype=torch.float64)
    assert check_close(torch.full((5,), 2.03e-6), residue, torch.float32)[0]
    assert not check_close(torch.full((5,), 2e-5), residue, torch.float32)[0]
    assert "FP64 rounding" in check_close(torch.full((5,), 2.03e-6), residue, torch.float32)[1]
    tiny = torch.full((5,), 1e-9, dtype=torch.float64)  # above the zero threshold: the elementwise rule holds
    assert not check_close(torch.full((5,), 3e-6), tiny, torch.float32)[0]
    assert not check_close(e[:10], e[:11], torch.float32)[0]
    with pytest.raises(AssertionError, match="dq"):
        assert_close(e * 2, e, torch.float32, name="dq")
    with pytest.raises(ValueError, match="dtype"):
        tolerance(torch.int32)


@settings(max_examples=60, deadline=None)
@given(
    left=st.one_of(st.none(), st.integers(0, 6)),
    right=st.one_of(st.none(), st.integers(0, 6)),
    causal=st.booleans(),
    nq=st.integers(1, 9),
    nk=st.integers(1, 9),
    q_offset=st.integers(0, 6),
    k_offset=st.integers(0, 6),
)
def test_allowed_pairs_by_their_definition(left, right, causal, nq, nk, q_offset, k_offset):
    """Query i (at i + q_offset) may attend to key j (at j + k_offset) when causality allows it and the key lies in
    [position − left, position + right], each bound unbounded when null."""
    data = {"name": "w", "terms": ["bias"], "map": MAPS["clipped"][0], "causal": causal}
    spec = load_spec({**data, "window": {"left": left, "right": right}})
    allowed = reference.allowed_pairs(spec, nq, nk, q_offset, k_offset)
    for i in range(nq):
        for j in range(nk):
            pi, pj = i + q_offset, j + k_offset
            expected = (not causal or pj <= pi) and (left is None or pj >= pi - left)
            expected = expected and (right is None or pj <= pi + right)
            assert bool(allowed[i, j]) == expected, (i, j)


# -- the GPU suite's decomposed oracle ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "window", "offsets"),
    [
        ("shaw", None, (0, 0)),
        ("deberta_v3", None, (0, 0)),
        ("t5", None, (0, 0)),
        ("txl", None, (0, 0)),
        ("t5_decoder", None, (6, 2)),  # causal, queries after the first keys
        ("shaw", (5, 3), (0, 4)),  # a local window, keys from position 4 on: the first queries see none
    ],
    ids=["shaw", "deberta_v3", "t5", "txl", "t5_decoder-offsets", "shaw-window-offsets"],
)
def test_decomposed_reference_matches_reference(name, window, offsets):
    """The GPU suite's oracle (tests/test_gpu.py: scores through Z = x·Aᵀ, which fit at 8K) against this one, with
    keys of the second sequence padded."""
    from test_gpu import decomposed_reference

    from relgen.check.verify import make_inputs

    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    if window is not None:
        spec = load_spec({**spec.model_dump(), "window": {"left": window[0], "right": window[1]}})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    (q_offset, k_offset), nq, nk = offsets, 40, 33
    length = max(q_offset + nq, k_offset + nk)
    inputs = make_inputs(spec, b=2, h=2, nq=nq, nk=nk, d=16, device=device, dtype=torch.float64, length=length)
    kpm = torch.ones(2, nk, dtype=torch.bool, device=device)
    kpm[1, 5:12] = False
    options = dict(key_padding_mask=kpm, q_offset=q_offset, k_offset=k_offset)
    a = decomposed_reference(spec, inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    b = reference.attention(spec, inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
