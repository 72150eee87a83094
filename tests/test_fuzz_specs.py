"""Fuzzing the spec side: whatever text, dict or expression comes in, `load_spec` and `analyze` either return or
raise SpecError / ValueError with a one-line, bounded message, quickly — never another exception type. And the
interval bounds that saturation proofs rest on hold for the float64 values the maps evaluate to."""

from __future__ import annotations

import math
import time

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import SLOW

from relgen.plan.analyze import analyze
from relgen.spec.expr import compile_expression
from relgen.spec.model import load_spec

FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
VALID_YAML = "name: demo\nterms: [query, bias]\nmap: {kind: clipped, min: -4, max: 4}\nscale: 1/sqrt(d)\n"


def survives(call) -> object:
    """`call()`'s result, or None when it raised a ValueError (SpecError, ExpressionError) with a one-line message
    of bounded length; within two seconds. Any other exception fails the test."""
    start = time.perf_counter()
    try:
        return call()
    except ValueError as err:
        message = str(err)
        assert message and "\n" not in message and "\r" not in message, repr(message)
        assert len(message) <= 500, message
        return None
    finally:
        assert time.perf_counter() - start < 2


# -- strategies ------------------------------------------------------------------------------------------------

HUGE_INTS = st.one_of(st.integers(-(10**6), 10**6), st.integers(-(10**40), 10**40), st.sampled_from([2**63, -(2**64)]))
NUMBERS = st.one_of(HUGE_INTS, st.floats(allow_nan=True, allow_infinity=True), st.booleans())
WORDS = st.sampled_from(
    ["name", "terms", "map", "kind", "min", "max", "scale", "causal", "expr", "rows", "offset", "boundaries",
     "num_buckets", "max_distance", "bidirectional", "position_buckets", "max_position", "heads_share_tables",
     "description", "query", "key", "bias", "clipped", "t5", "log", "identity", "expression", "delta", "d",
     "true", "no", "null", "~", "yes", "0x1F", "1_000", "1:30", ".inf", ".nan", "2024-01-01"]
)  # fmt: skip
YAML_PIECES = st.one_of(
    WORDS,
    st.sampled_from([": ", "- ", "\n", "\n  ", "  ", "{", "}", "[", "]", ", ", "&a ", "*a", "&b ", "*b", "? ",
                     "!!binary ", "!!set ", "!!python/object:os.system ", "!t ", "<<: ", "---\n", "...\n", "#",
                     "'", '"', "|\n  ", ">\n  ", "%YAML 1.1\n", "\t", "\\", "\x00", "\ufeff", "é"]),
    HUGE_INTS.map(str),
)  # fmt: skip


@st.composite
def yaml_texts(draw) -> str:
    if draw(st.booleans()):
        return "".join(draw(st.lists(YAML_PIECES, max_size=60)))
    # a valid spec with a few characters inserted, deleted or replaced
    text = list(VALID_YAML)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = draw(YAML_PIECES)
        if action == "insert":
            text[at:at] = piece
        elif action == "delete":
            del text[at : at + draw(st.integers(1, 8))]
        else:
            text[at : at + 1] = piece
    return "".join(text)


VALUES = st.recursive(
    st.one_of(st.none(), NUMBERS, st.text(max_size=20), WORDS),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(WORDS, inner, max_size=5)),
    max_leaves=12,
)
KINDS = st.sampled_from(["identity", "clipped", "t5", "log", "boundaries", "expression", "wavy"])
MAP_FIELDS = st.sampled_from(
    ["min", "max", "num_buckets", "max_distance", "bidirectional", "position_buckets", "max_position",
     "boundaries", "expr", "rows", "offset"]
)  # fmt: skip


@st.composite
def spec_dicts(draw) -> dict:
    data: dict = {"name": draw(st.sampled_from(["demo", "x" * 70, "Bad Name", 3])), "terms": ["query"]}
    map_data: dict = {"kind": draw(KINDS)}
    for field in draw(st.lists(MAP_FIELDS, max_size=4, unique=True)):
        map_data[field] = draw(st.one_of(HUGE_INTS, VALUES, expressions()))
    data["map"] = map_data
    for field in draw(st.lists(st.sampled_from(["scale", "causal", "heads_share_tables", "terms", "extra"]))):
        data[field] = draw(st.one_of(VALUES, expressions()))
    return data


TOKENS = st.one_of(
    st.sampled_from(["d", "delta", "pi", "e", "x", "os", "__import__", "sqrt", "log", "exp", "abs", "Abs",
                     "floor", "ceil", "ceiling", "min", "Min", "max", "Max", "sign", "Mod", "lambda"]),
    st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "(", ")", ",", " ", "  "]),
    st.sampled_from(["0", "1", "2", "3", "64", "0.5", ".5", "1e308", "1e-400", "9" * 40, "1e999", "2.", "1_0"]),
    st.sampled_from(["#", "'", '"', ";", "\n", "_", "@", "[", "]", ".", "=", "!", "\\", "\x00", "é", "٣"]),
)  # fmt: skip


def expressions() -> st.SearchStrategy[str]:
    """Token soup: mostly ill-formed, sometimes valid."""
    return st.lists(TOKENS, min_size=1, max_size=40).map("".join)


def valid_expressions(variable: str) -> st.SearchStrategy[str]:
    """Well-formed expressions in `variable` (many still refused: division by zero, too high a degree...)."""
    leaves = st.one_of(
        st.just(variable),
        st.integers(-20, 20).map(lambda v: f"({v})"),
        st.sampled_from(["0.5", "pi", "1e300", "3"]),
    )

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        binary = st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%"]), inner)
        power = st.tuples(inner, st.sampled_from(["2", "3", "-1", "0.5", "-2"]))
        unary = st.tuples(st.sampled_from(["sqrt", "log", "exp", "Abs", "floor", "ceiling", "sign", "-"]), inner)
        minmax = st.tuples(st.sampled_from(["Min", "Max"]), st.lists(inner, min_size=1, max_size=3))
        return st.one_of(
            binary.map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            power.map(lambda t: f"({t[0]})**{t[1]}"),
            unary.map(lambda t: f"{t[0]}({t[1]})"),
            minmax.map(lambda t: f"{t[0]}({', '.join(t[1])})"),
        )

    return st.recursive(leaves, extend, max_leaves=12)


# -- load_spec and analyze never fail otherwise -----------------------------------------------------------------


@FUZZ
@given(text=yaml_texts(), seq_len=st.one_of(st.none(), st.integers(-3, 300)))
def test_yaml_text(text, seq_len):
    spec = survives(lambda: load_spec(text))
    if spec is not None:
        survives(lambda: analyze(spec, seq_len))


@SLOW
@FUZZ
@given(data=spec_dicts(), seq_len=st.integers(-3, 300), head_dim=st.one_of(st.integers(-2, 300), NUMBERS))
def test_spec_dicts(data, seq_len, head_dim):
    spec = survives(lambda: load_spec(data))
    if spec is not None:
        survives(lambda: analyze(spec, seq_len))
        survives(lambda: spec.scale_value(head_dim))


@FUZZ
@given(text=st.one_of(expressions(), valid_expressions("d")), head_dim=st.integers(1, 512))
def test_scale_expressions(text, head_dim):
    spec = survives(lambda: load_spec({"name": "demo", "terms": ["query"], "map": {"kind": "identity"}, "scale": text}))
    if spec is not None:
        tau = survives(lambda: spec.scale_value(head_dim))
        assert tau is None or (math.isfinite(tau) and tau > 0)


@FUZZ
@given(
    text=st.one_of(expressions(), valid_expressions("delta")),
    rows=st.one_of(st.integers(1, 64), HUGE_INTS),
    offset=st.sampled_from(["query_minus_key", "key_minus_query"]),
    causal=st.booleans(),
)
def test_expression_maps(text, rows, offset, causal):
    data = {
        "name": "demo",
        "terms": ["bias"],
        "map": {"kind": "expression", "expr": text, "rows": rows, "offset": offset},
        "causal": causal,
    }
    spec = survives(lambda: load_spec(data))
    if spec is not None:
        survives(lambda: analyze(spec, 200))


# -- the bounds saturation proofs rest on ------------------------------------------------------------------------


@settings(max_examples=300, deadline=2000)
@given(
    text=valid_expressions("x"),
    ends=st.tuples(st.integers(-(10**6), 10**6), st.integers(0, 10**6)),
    samples=st.lists(st.floats(0, 1), min_size=1, max_size=20),
)
def test_interval_bounds_hold_for_every_evaluated_value(text, ends, samples):
    expr = survives(lambda: compile_expression(text, ("x",)))
    if expr is None:
        return
    low, high = ends[0], ends[0] + ends[1]
    lo, hi = expr.bounds(low, high)
    points = np.array([low, high, *[low + s * (high - low) for s in samples], *range(low, min(high, low + 50) + 1)])
    values = expr.evaluate({"x": points})
    if math.isnan(lo):
        return  # undefined somewhere: nothing is claimed
    assert not np.isnan(values).any(), (text, low, high, lo, hi)
    assert ((lo <= values) & (values <= hi)).all(), (text, low, high, lo, hi, values[(values < lo) | (values > hi)])


@FUZZ
@given(
    text=valid_expressions("delta"),
    offset=st.sampled_from(["query_minus_key", "key_minus_query"]),
    causal=st.booleans(),
    far=st.lists(st.integers(1, 2**30), min_size=1, max_size=30),
)
def test_a_proven_saturation_holds_far_beyond_the_window(text, offset, causal, far):
    clamped = f"Min(Max(floor({text}), 0), 9)"  # integer rows in [0, 10) wherever the expression is defined
    data = {"name": "demo", "terms": ["bias"], "map": {"kind": "expression", "expr": clamped, "rows": 10}}
    spec = survives(lambda: load_spec({**data, "causal": causal, "map": {**data["map"], "offset": offset}}))
    plan = spec and survives(lambda: analyze(spec))
    if plan is None or not plan.saturation_proven:
        return
    n, beyond = plan.seq_len, np.array(far) + plan.seq_len
    assert (spec.map.row_ids(beyond, n) == plan.copy_map[-1]).all()
    if not causal:
        assert (spec.map.row_ids(-beyond, n) == plan.copy_map[0]).all()
