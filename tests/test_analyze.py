"""The analyzer against brute force: every Plan field that indexing depends on, for random maps of every kind.

Brute force walks the window δ ∈ [−(N−1), N−1] with the map's `row_ids` (the single definition of φ) and
rebuilds rows, intervals, saturation bounds, the copy map and the reachable windows of docs/algorithm.md
without looking at how relgen.plan.analyze computes them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tiers import SLOW

from relgen.plan.analyze import GROUP_SIZE, analyze, canonical_length
from relgen.spec.maps import T5Map
from relgen.spec.model import load_spec

OFFSETS = st.sampled_from(["query_minus_key", "key_minus_query"])


# -- random maps of every kind -------------------------------------------------------------------------------


@st.composite
def identity_maps(draw):
    return {"kind": "identity", "offset": draw(OFFSETS)}


@st.composite
def clipped_maps(draw):
    return {
        "kind": "clipped",
        "min": draw(st.integers(-40, 0)),
        "max": draw(st.integers(0, 40)),
        "offset": draw(OFFSETS),
    }


@st.composite
def t5_maps(draw):
    bidirectional = draw(st.booleans())
    num_buckets = draw(st.integers(4 if bidirectional else 2, 64))
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    max_distance = draw(st.integers(exact + 1, 300))
    return {"kind": "t5", "num_buckets": num_buckets, "max_distance": max_distance, "bidirectional": bidirectional}


@st.composite
def log_maps(draw):
    position_buckets = draw(st.integers(2, 64))
    max_position = draw(st.integers(position_buckets // 2 + 2, 320))
    return {"kind": "log", "position_buckets": position_buckets, "max_position": max_position}


@st.composite
def boundaries_maps(draw):
    values = draw(st.lists(st.integers(-60, 60), min_size=1, max_size=8, unique=True))
    return {"kind": "boundaries", "boundaries": sorted(values), "offset": draw(OFFSETS)}


@st.composite
def expression_maps(draw):
    template = draw(st.integers(0, 5))
    a = draw(st.integers(0, 20))
    b = draw(st.integers(1, 20))
    if template == 0:
        expr, rows = f"Min(Abs(delta), {b})", b + 1  # ±δ share a row: not contiguous
    elif template == 1:
        expr, rows = f"Max(Min(delta + {a}, {b}), 0)", b + 1
    elif template == 2:
        expr, rows = f"Min(Max(delta, -{a}), {b}) + {a}", a + b + 1
    elif template == 3:
        expr, rows = f"Min(Max(floor(delta / 3), -{a}), {b}) + {a}", a + b + 1
    elif template == 4:
        expr, rows = f"Min(floor(Abs(delta) / 2), {b})", b + 1
    else:
        expr, rows = f"(Min(Max(delta, -{a}), {b}) + {a}) % 3", 3  # periodic rows: atomic
    return {"kind": "expression", "expr": expr, "rows": rows, "offset": draw(OFFSETS)}


MAPS = st.one_of(identity_maps(), clipped_maps(), t5_maps(), log_maps(), boundaries_maps(), expression_maps())


def spec_of(map_data, causal=False):
    return load_spec({"name": "prop", "terms": ["query", "key", "bias"], "map": map_data, "causal": causal})


# -- brute force ---------------------------------------------------------------------------------------------


def window_rows(spec, n):
    deltas = np.arange(-(n - 1), n)
    return deltas, np.asarray(spec.map.row_ids(deltas, n), dtype=np.int64)


def brute_saturation(deltas, rows):
    """(low, high) over consecutive `deltas`: the largest low with φ constant from the first offset to low and the
    smallest high with φ constant from high to the last offset; (0, 0) if φ is constant on all of them."""
    if (rows == rows[0]).all():
        return 0, 0
    first, last = 0, len(rows) - 1
    while rows[first + 1] == rows[0]:
        first += 1
    while rows[last - 1] == rows[-1]:
        last -= 1
    return int(deltas[first]), int(deltas[last])


def check_windows(s, n, low, high, group):
    """docs/algorithm.md's reachable windows for group size `group`: every pair lands inside its group's window."""
    c = high - low + 1
    width = min(c, n + group - 1)
    for g in range(-(-n // group)):
        i0, i1 = g * group, min(g * group + group, n)
        s0 = int(np.clip(g * group - (n - 1) - low, 0, c - width))
        cols = s[i0:i1, :] - s0  # queries of group g against every key
        assert cols.min() >= 0 and cols.max() < width, (g, s0, width)
        t0 = int(np.clip(-(g * group + group - 1) - low, 0, c - width))
        cols = s[:, i0:i1] - t0  # keys of group g against every query
        assert cols.min() >= 0 and cols.max() < width, (g, t0, width)


@SLOW
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(map_data=MAPS, n=st.integers(1, 300), causal=st.booleans())
def test_plan_matches_brute_force(map_data, n, causal):
    spec = spec_of(map_data, causal)
    plan = analyze(spec, n)
    deltas, rows = window_rows(spec, n)

    assert plan.seq_len == n and plan.rows == spec.map.num_rows(n)
    assert plan.length_dependent == (map_data["kind"] == "identity")

    # rows, their offsets, contiguity and the path
    offsets: dict[int, list[int]] = {}
    for delta, row in zip(deltas.tolist(), rows.tolist(), strict=True):
        offsets.setdefault(row, []).append(delta)
    contiguous = all(max(ds) - min(ds) + 1 == len(ds) for ds in offsets.values())
    assert plan.contiguous == contiguous
    assert plan.path == ("offset" if contiguous else "atomic")
    spans = {span.row: span for span in plan.row_spans}
    assert set(spans) == set(offsets)
    for row, ds in offsets.items():
        covered = [d for lo, hi in spans[row].intervals for d in range(lo, hi + 1)]
        assert covered == ds  # the intervals are exactly the row's offsets, in order
        assert spans[row].contiguous == (max(ds) - min(ds) + 1 == len(ds))
    assert list(plan.row_order) == sorted(offsets, key=lambda r: min(offsets[r]))
    assert list(plan.unreached_rows) == sorted(set(range(plan.rows)) - set(offsets))

    # saturation: the tightest bounds; causal specs mask δ < 0, so theirs are those of the half window [0, N−1]
    half = deltas >= 0
    low, high = brute_saturation(deltas[half], rows[half]) if causal else brute_saturation(deltas, rows)
    assert not causal or low >= 0
    assert (plan.saturation_low, plan.saturation_high) == (low, high)
    c = high - low + 1
    assert plan.expanded_rows == c == len(plan.copy_map)

    # the key indexing identity: β(s) = φ(s + L) and φ(δ) = β(clip(δ, L, U) − L) on every reachable offset
    phi = dict(zip(deltas.tolist(), rows.tolist(), strict=True))
    assert list(plan.copy_map) == [phi[s + low] for s in range(c)]
    for delta in deltas.tolist():
        if causal and delta < 0:
            continue  # masked: never read
        assert phi[delta] == plan.copy_map[min(max(delta, low), high) - low]

    # reachable windows
    assert plan.group_size == GROUP_SIZE
    assert plan.query_window == plan.key_window == min(c, n + plan.group_size - 1)
    assert plan.groups == -(-n // plan.group_size)
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    s = np.clip(i - j, low, high) - low
    for group in (plan.group_size, 16, 5):
        check_windows(s, n, low, high, group)


@settings(max_examples=60, deadline=None)
@given(map_data=st.one_of(clipped_maps(), t5_maps(), log_maps(), boundaries_maps()), causal=st.booleans())
def test_saturation_proven_for_monotone_kinds(map_data, causal):
    """Shipped non-identity kinds saturate for good: φ beyond the window equals the window's edge rows."""
    spec = spec_of(map_data, causal)
    n = canonical_length(spec)
    plan = analyze(spec, n)
    assert plan.saturation_proven
    far = np.arange(n, 4 * n + 1000)
    edge_high = spec.map.row_ids(np.array([n - 1]), n)[0]
    assert (spec.map.row_ids(far, n) == edge_high).all()
    if not causal:
        edge_low = spec.map.row_ids(np.array([-(n - 1)]), n)[0]
        assert (spec.map.row_ids(-far, n) == edge_low).all()
    # a longer window keeps the same bounds
    assert (analyze(spec, 2 * n).saturation_low, analyze(spec, 2 * n).saturation_high) == (
        plan.saturation_low,
        plan.saturation_high,
    )


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), offset=OFFSETS, causal=st.booleans())
def test_identity_plan(n, offset, causal):
    plan = analyze(spec_of({"kind": "identity", "offset": offset}, causal), n)
    assert plan.rows == 2 * n - 1 and plan.contiguous and plan.path == "offset"
    assert not plan.saturation_proven
    assert plan.saturation_high == n - 1
    assert plan.saturation_low == (0 if causal else -(n - 1))


# -- concrete examples ---------------------------------------------------------------------------------------


def test_t5_encoder_at_1024():
    spec = load_spec({"name": "t5", "terms": ["bias"], "map": {"kind": "t5"}, "scale": 1})
    plan = analyze(spec, 1024)
    assert (plan.saturation_low, plan.saturation_high) == (-91, 91)
    assert plan.contiguous and plan.path == "offset" and plan.expanded_rows == 183
    assert plan.rows == 32 and plan.unreached_rows == (16,) and plan.saturation_proven  # 16: j > i at distance 0
    assert plan.has_copies and not plan.copy_is_identity
    assert plan.copy_map[0] == 31 and plan.copy_map[-1] == 15  # δ ≤ −91: key far right; δ ≥ 91: far left


def test_t5_decoder_causal():
    spec = load_spec(
        {"name": "t5d", "terms": ["bias"], "map": {"kind": "t5", "bidirectional": False}, "scale": 1, "causal": True}
    )
    plan = analyze(spec, 1024)
    decoder = T5Map(kind="t5", bidirectional=False)
    first_saturated = next(n for n in range(1, 1000) if decoder.row_ids(np.array([n]), 1)[0] == 31)
    assert first_saturated == 113  # docs/mechanisms.md: decoder bucket 31 from n = 113
    assert (plan.saturation_low, plan.saturation_high) == (0, 113)
    assert plan.saturation_proven


def test_deberta_at_1024():
    spec = load_spec(
        {
            "name": "deberta",
            "terms": ["query", "key"],
            "map": {"kind": "log", "position_buckets": 256, "max_position": 512},
            "scale": "1/sqrt(3*d)",
        }
    )
    plan = analyze(spec, 1024)
    assert (plan.saturation_low, plan.saturation_high) == (-512, 506)
    assert plan.expanded_rows == 1019 and plan.rows == 512
    assert plan.contiguous and plan.path == "offset" and plan.saturation_proven
    assert plan.query_window == 1019


def test_min_abs_expression_is_atomic():
    spec = spec_of({"kind": "expression", "expr": "Min(Abs(delta), 16)", "rows": 17})
    plan = analyze(spec, 1024)
    assert not plan.contiguous and plan.path == "atomic"
    assert plan.saturation_proven
    assert (plan.saturation_low, plan.saturation_high) == (-16, 16)


def test_shaw_and_identity():
    shaw = analyze(spec_of({"kind": "clipped", "min": -256, "max": 256}), 8192)
    assert (shaw.saturation_low, shaw.saturation_high, shaw.expanded_rows) == (-256, 256, 513)
    assert shaw.copy_is_identity and shaw.saturation_proven and shaw.path == "offset"
    txl = analyze(spec_of({"kind": "identity"}), 8192)
    assert txl.expanded_rows == 2 * 8192 - 1 and txl.query_window == 8192 + GROUP_SIZE - 1
    assert txl.copy_is_identity and not txl.saturation_proven


@pytest.mark.parametrize(
    "map_data",
    [
        {"kind": "clipped", "min": -64, "max": 8, "offset": "key_minus_query"},
        {"kind": "boundaries", "boundaries": [-5, 0, 7, 30]},
        {"kind": "t5", "num_buckets": 16, "max_distance": 40},
        {"kind": "log", "position_buckets": 32, "max_position": 100},
    ],
)
def test_shipped_kinds_saturation_proven(map_data):
    assert analyze(spec_of(map_data)).saturation_proven


def test_expression_not_saturating_is_not_proven():
    # periodic beyond any window: the sympy proof must fail
    spec = spec_of({"kind": "expression", "expr": "delta % 2", "rows": 2})
    plan = analyze(spec, 64)
    assert not plan.saturation_proven
    assert not plan.contiguous and plan.path == "atomic"


def test_plan_json_roundtrip_fields():
    plan = analyze(spec_of({"kind": "t5"}), 300)
    data = plan.to_json()
    assert data["expanded_rows"] == plan.expanded_rows
    assert data["saturation"] == {"low": plan.saturation_low, "high": plan.saturation_high}
    assert data["deterministic"] == (plan.path == "offset")


def test_bad_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        analyze(spec_of({"kind": "t5"}), 0)


@settings(max_examples=40, deadline=None)
@given(map_data=MAPS)
def test_canonical_length_bounds_inside_window(map_data):
    spec = spec_of(map_data)
    n = canonical_length(spec)
    assume(not spec.map.length_dependent)
    plan = analyze(spec, n)
    if plan.saturation_proven:
        assert -(n - 1) < plan.saturation_low and plan.saturation_high < n - 1
