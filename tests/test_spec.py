"""The spec language: loading, defaults, scales, safe expressions, and every map kind's row ids against brute force
and against the models' own conventions (docs/mechanisms.md)."""

from __future__ import annotations

import bisect
import math
import time
from pathlib import Path

import numpy as np
import pytest

from relgen.spec.expr import ExpressionError, parse_expression
from relgen.spec.maps import BoundariesMap, ClippedMap, ExpressionMap, IdentityMap, LogMap, T5Map
from relgen.spec.model import MechanismSpec, SpecError, load_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
SHIPPED = ("shaw", "txl", "deberta_v3", "t5", "wav2vec2_bert", "t5_decoder", "txl_uv")

BASE = {"name": "demo", "terms": ["query"], "map": {"kind": "clipped", "min": -4, "max": 4}}


def spec_with(**fields) -> dict:
    return {**BASE, **fields}


# -- loading and defaults ------------------------------------------------------------------------------------


def test_exactly_the_shipped_specs():
    assert sorted(p.stem for p in SPECS.iterdir()) == sorted(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_specs_load(name):
    spec = load_spec(SPECS / f"{name}.yaml")
    assert spec.name == name
    assert spec.description and len(spec.description) > 40
    assert load_spec(str(SPECS / f"{name}.yaml")) == spec  # a str path works too


def test_shipped_spec_fields():
    shaw = load_spec(SPECS / "shaw.yaml")
    assert (shaw.terms, shaw.map, shaw.scale) == (("query",), ClippedMap(kind="clipped", min=-256, max=256), None)
    txl = load_spec(SPECS / "txl.yaml")
    assert txl.terms == ("query",) and isinstance(txl.map, IdentityMap)
    deberta = load_spec(SPECS / "deberta_v3.yaml")
    assert deberta.terms == ("query", "key")
    assert deberta.map == LogMap(kind="log", position_buckets=256, max_position=512)
    assert deberta.scale_value(64) == pytest.approx(1 / math.sqrt(192))
    t5 = load_spec(SPECS / "t5.yaml")
    assert t5.terms == ("bias",) and t5.scale_value(64) == 1.0 and not t5.causal
    assert t5.map == T5Map(kind="t5", num_buckets=32, max_distance=128, bidirectional=True)
    w2v = load_spec(SPECS / "wav2vec2_bert.yaml")
    assert w2v.heads_share_tables and w2v.terms == ("query",)
    assert w2v.map == ClippedMap(kind="clipped", min=-64, max=8, offset="key_minus_query")
    dec = load_spec(SPECS / "t5_decoder.yaml")
    assert dec.causal and dec.terms == ("bias",) and dec.scale_value(64) == 1.0
    assert dec.map == T5Map(kind="t5", num_buckets=32, max_distance=128, bidirectional=False)
    uv = load_spec(SPECS / "txl_uv.yaml")
    assert uv.terms == ("query", "bias") and isinstance(uv.map, IdentityMap) and not uv.heads_share_tables


def test_defaults():
    spec = load_spec(BASE)
    assert spec.description is None
    assert (
        spec.scale is None
        and spec.scale_value(64) == 0.125
        and spec.scale_value(128) == pytest.approx(1 / math.sqrt(128))
    )
    assert spec.causal is False and spec.heads_share_tables is False
    assert spec.map.offset == "query_minus_key"
    assert load_spec(spec_with(map={"kind": "t5"})).map == T5Map(
        kind="t5", num_buckets=32, max_distance=128, bidirectional=True
    )


def test_sources_agree():
    text = "name: demo\nterms: [query]\nmap: {kind: clipped, min: -4, max: 4}\n"
    from_dict = load_spec(BASE)
    assert load_spec(text) == from_dict
    assert load_spec(from_dict) is from_dict
    assert MechanismSpec(**BASE) == from_dict


def test_terms_canonical_order_and_hash():
    spec = load_spec(spec_with(terms=["bias", "key", "query"]))
    assert spec.terms == ("query", "key", "bias")
    assert spec.spec_hash() == load_spec(spec_with(terms=["query", "key", "bias"])).spec_hash()
    assert spec.spec_hash() != load_spec(BASE).spec_hash()
    assert len(spec.spec_hash()) == 16


def test_spec_is_frozen():
    spec = load_spec(BASE)
    with pytest.raises(ValueError):
        spec.causal = True


# -- scale -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scale", "d", "expected"),
    [
        ("1/sqrt(3*d)", 64, 1 / math.sqrt(192)),
        ("1/sqrt(3*d)", 128, 1 / math.sqrt(384)),
        (1, 64, 1.0),
        (0.5, 32, 0.5),
        ("d**-0.5", 64, 0.125),
        ("1 / sqrt(d)", 16, 0.25),
        ("2**-3", 64, 0.125),
    ],
)
def test_scale_values(scale, d, expected):
    assert load_spec(spec_with(scale=scale)).scale_value(d) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("scale", "words"),
    [
        ("1/sqrt(h)", "unknown symbol 'h'"),
        ("foo(d)", "unknown function 'foo'"),
        (-1, "positive"),
        ("0", "positive"),
        ("1/0", "division by zero"),
        ("d % 0", "cannot evaluate"),
        ("sqrt()", "cannot evaluate"),
        (True, "expected a number"),
        ("1/sqrt(d", "cannot parse"),
    ],
)
def test_bad_scales(scale, words):
    with pytest.raises(SpecError, match="field 'scale'") as err:
        load_spec(spec_with(scale=scale))
    assert words in str(err.value)


# -- safe expressions ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')",
        "__import__('os').system('touch relgen-pwned')",
        "d.real",
        "d.__class__",
        "(lambda: 1)()",
        "[d][0]",
        "'abc'",
        "True",
        "d if d else 1",
        "sqrt(d)(1)",
        "eval('1')",
        "sqrt(x=d)",
        "d; 1",
        "open('f')",
    ],
)
def test_expressions_refuse_code(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExpressionError):
        parse_expression(text, ("d",))
    assert not (tmp_path / "relgen-pwned").exists()


def test_huge_powers_are_refused_quickly():
    start = time.perf_counter()
    for text in ("9**9**9", "(d**64)**64**64", "10**1000"):
        with pytest.raises(ExpressionError, match="power too large"):
            parse_expression(text, ("d",))
    assert time.perf_counter() - start < 2


def test_expression_functions():
    delta = parse_expression("Min(Abs(delta), 16) + floor(delta / 4) % 2", ("delta",))
    assert {str(s) for s in delta.free_symbols} == {"delta"}
    assert parse_expression(3, ()) == 3
    with pytest.raises(ExpressionError):
        parse_expression(True, ())


# -- row ids against brute force -------------------------------------------------------------------------------

DELTAS = np.arange(-700, 701)


def rows_of(map_spec, deltas=DELTAS, length=701):
    return [int(r) for r in map_spec.row_ids(np.asarray(deltas), length)]


@pytest.mark.parametrize("offset", ["query_minus_key", "key_minus_query"])
@pytest.mark.parametrize("length", [1, 5, 64, 701])
def test_identity_rows(offset, length):
    m = IdentityMap(kind="identity", offset=offset)
    deltas = np.arange(-(length - 1), length)
    sign = -1 if offset == "key_minus_query" else 1
    assert rows_of(m, deltas, length) == [sign * int(d) + length - 1 for d in deltas]
    assert m.num_rows(length) == 2 * length - 1 and m.length_dependent
    assert sorted(rows_of(m, deltas, length)) == list(range(2 * length - 1))


@pytest.mark.parametrize("offset", ["query_minus_key", "key_minus_query"])
@pytest.mark.parametrize(("lo", "hi"), [(-256, 256), (-64, 8), (0, 0), (-3, 0), (0, 5)])
def test_clipped_rows(offset, lo, hi):
    m = ClippedMap(kind="clipped", min=lo, max=hi, offset=offset)
    sign = -1 if offset == "key_minus_query" else 1
    assert rows_of(m) == [min(max(sign * int(d), lo), hi) - lo for d in DELTAS]
    assert m.num_rows(10) == hi - lo + 1


def t5_bucket(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Hugging Face T5's _relative_position_bucket for one int, in float64 (identical to float32 below 5000)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if relative_position > 0 else 0
        n = abs(relative_position)
    else:
        n = max(0, -relative_position)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (64, 256), (16, 40)])
def test_t5_rows(bidirectional, num_buckets, max_distance):
    m = T5Map(kind="t5", num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional)
    # T5 buckets memory − query = j − i = −δ
    assert rows_of(m) == [t5_bucket(-int(d), bidirectional, num_buckets, max_distance) for d in DELTAS]
    assert m.num_rows(7) == num_buckets


# first distance n = |i − j| of each bucket (docs/mechanisms.md, T5)
T5_ENCODER_FIRST = {**{b: b for b in range(8)}, 8: 8, 9: 12, 10: 16, 11: 23, 12: 32, 13: 46, 14: 64, 15: 91}
T5_DECODER_FIRST = {
    **{b: b for b in range(16)},
    **{16: 16, 17: 19, 18: 21, 19: 24, 20: 27, 21: 31, 22: 35, 23: 40, 24: 46, 25: 52, 26: 59, 27: 67},
    **{28: 77, 29: 87, 30: 99, 31: 113},
}


def first_distances(m, signed: int, limit: int = 5000) -> dict[int, int]:
    distances = np.arange(0, limit)
    rows = m.row_ids(signed * distances, limit)
    first: dict[int, int] = {}
    for n, r in zip(distances, rows, strict=True):
        first.setdefault(int(r), int(n))
    return first


def test_t5_encoder_thresholds():
    m = load_spec(SPECS / "t5.yaml").map
    assert first_distances(m, +1) == T5_ENCODER_FIRST  # δ = i − j ≥ 0: key in the past, j − i ≤ 0
    # keys to the right (j − i > 0) add 16; j − i = 0 stays in bucket 0, so bucket 16 is never used
    right = first_distances(m, -1)
    assert right.pop(0) == 0
    assert right == {b + 16: n for b, n in T5_ENCODER_FIRST.items() if b > 0}
    assert rows_of(m, [90, 91, 128, 10**6]) == [14, 15, 15, 15]
    assert rows_of(m, [-90, -91, -(10**6)]) == [30, 31, 31]


def test_t5_decoder_thresholds():
    m = load_spec(SPECS / "t5_decoder.yaml").map
    assert first_distances(m, +1) == T5_DECODER_FIRST
    assert rows_of(m, [112, 113, 10**6]) == [30, 31, 31]
    assert rows_of(m, [-1, -5, -(10**6)]) == [0, 0, 0]  # future keys: bucket 0 (masked anyway)


def deberta_bucket(relative: int, bucket_size: int = 256, max_position: int = 512) -> int:
    """Hugging Face DeBERTa-v2's make_log_bucket_position for one int, in float64."""
    mid = bucket_size // 2
    sign = (relative > 0) - (relative < 0)
    abs_pos = mid - 1 if -mid < relative < mid else abs(relative)
    if abs_pos <= mid:
        return relative
    log_pos = math.ceil(math.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    return log_pos * sign


DEBERTA_SAMPLES = {129: 129, 130: 130, 135: 133, 150: 143, 200: 169, 256: 192, 300: 207, 400: 233, 500: 254}
DEBERTA_SAMPLES |= {d: 255 for d in range(506, 512)} | {512: 256, 1000: 317, 5000: 465}


def test_deberta_samples():
    m = load_spec(SPECS / "deberta_v3.yaml").map
    for delta, bucket in DEBERTA_SAMPLES.items():
        assert deberta_bucket(delta) == bucket, delta  # the brute force agrees with docs/mechanisms.md
        # δ = i − j; the bucket is odd in δ, then offset by 256 and clamped to the 512 rows
        assert rows_of(m, [delta, -delta]) == [min(bucket + 256, 511), max(256 - bucket, 0)], delta
    assert rows_of(m, [505, 506, 511, 512]) == [510, 511, 511, 511]
    assert rows_of(m, [-505, -506, -511, -512, -(10**6)]) == [2, 1, 1, 0, 0]
    assert rows_of(m, list(range(-128, 129))) == list(range(128, 385))


@pytest.mark.parametrize(("buckets", "max_position"), [(256, 512), (64, 128), (32, 300)])
def test_log_rows(buckets, max_position):
    m = LogMap(kind="log", position_buckets=buckets, max_position=max_position)
    deltas = np.arange(-3000, 3001)
    expected = [min(max(deberta_bucket(int(d), buckets, max_position) + buckets, 0), 2 * buckets - 1) for d in deltas]
    assert rows_of(m, deltas) == expected
    assert m.num_rows(5) == 2 * buckets


@pytest.mark.parametrize("offset", ["query_minus_key", "key_minus_query"])
def test_boundaries_rows(offset):
    boundaries = [-8, -2, 0, 3, 9]
    m = BoundariesMap(kind="boundaries", boundaries=boundaries, offset=offset)
    sign = -1 if offset == "key_minus_query" else 1
    assert rows_of(m) == [bisect.bisect_right(boundaries, sign * int(d)) for d in DELTAS]
    assert m.num_rows(3) == 6


@pytest.mark.parametrize("offset", ["query_minus_key", "key_minus_query"])
@pytest.mark.parametrize(
    ("expr", "rows", "python"),
    [
        ("Min(Abs(delta), 16)", 17, lambda d: min(abs(d), 16)),
        ("Max(Min(delta + 3, 6), 0)", 7, lambda d: max(min(d + 3, 6), 0)),
        ("Min(Max(floor(delta / 4), -4), 4) + 4", 9, lambda d: min(max(d // 4, -4), 4) + 4),
        ("delta % 5", 5, lambda d: d % 5),
        ("3", 4, lambda d: 3),
    ],
)
def test_expression_rows(offset, expr, rows, python):
    m = ExpressionMap(kind="expression", expr=expr, rows=rows, offset=offset)
    sign = -1 if offset == "key_minus_query" else 1
    assert rows_of(m) == [python(sign * int(d)) for d in DELTAS]
    assert m.num_rows(3) == rows


def test_wav2vec2_bert_rows():
    m = load_spec(SPECS / "wav2vec2_bert.yaml").map
    for i in range(0, 200, 7):
        for j in range(0, 200, 3):
            assert rows_of(m, [i - j]) == [min(max(j - i, -64), 8) + 64]
    assert m.num_rows(1000) == 73


@pytest.mark.parametrize(
    ("expr", "rows", "words"),
    [
        ("Abs(delta)", 5, "gives 1024 at delta=-1024: expected an integer in [0, rows=5)"),
        ("delta / 3", 1000, "gives -341.333"),
        ("delta - 1", 3000, "gives -1025"),
        ("sqrt(Abs(delta))", 40, "gives 31.9"),
    ],
)
def test_expression_values_checked(expr, rows, words):
    with pytest.raises(SpecError, match="field 'map'") as err:
        load_spec(spec_with(map={"kind": "expression", "expr": expr, "rows": rows}))
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("map_spec", "field", "words"),
    [
        ({"kind": "clipped", "min": 3, "max": 6}, "map.min", "less than or equal to 0"),
        ({"kind": "clipped", "min": -6, "max": -3}, "map.max", "greater than or equal to 0"),
        ({"kind": "clipped", "min": -4, "max": 4, "bogus": 1}, "map.bogus", "unknown key (allowed: kind, min, max"),
        ({"kind": "wavy"}, "map.kind", "'wavy'"),
        ({"min": 1}, "map.kind", "missing 'kind'"),
        ({"kind": "t5", "num_buckets": 2}, "map", "num_buckets is too small"),
        ({"kind": "log", "position_buckets": 256, "max_position": 100}, "map", "max_position"),
        ({"kind": "boundaries", "boundaries": [3, 1]}, "map.boundaries", "strictly increasing"),
        ({"kind": "boundaries", "boundaries": [1, 3], "offset": "up"}, "map.offset", "got 'up'"),
        ({"kind": "expression", "expr": "tanh(delta)", "rows": 3}, "map.expr", "unknown function 'tanh'"),
        ({"kind": "expression", "expr": "x", "rows": 3}, "map.expr", "unknown symbol 'x'"),
    ],
)
def test_bad_maps_name_the_field(map_spec, field, words):
    with pytest.raises(SpecError) as err:
        load_spec(spec_with(map=map_spec))
    assert f"field '{field}'" in str(err.value)
    assert words in str(err.value)
