"""Specs are untrusted input: every hostile spec is refused before any expensive work with a one-line SpecError or
ValueError naming the field, never a traceback, a hang or a crash; every limit of relgen.spec.limits holds."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import pytest

from relgen.plan.analyze import analyze, canonical_length
from relgen.spec import limits
from relgen.spec.expr import ExpressionError, compile_expression, parse_expression
from relgen.spec.model import MechanismSpec, SpecError, load_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "demo", "terms": ["query"], "map": {"kind": "clipped", "min": -4, "max": 4}}
BASE_YAML = "name: demo\nterms: [query]\nmap: {kind: clipped, min: -4, max: 4}\n"


def spec_with(**fields) -> dict:
    return {**BASE, **fields}


def refused(source, *words: str, seconds: float = 1.0) -> str:
    """The SpecError `load_spec(source)` raises: quickly, on one short line, holding every one of `words`."""
    start = time.perf_counter()
    with pytest.raises(SpecError) as err:
        load_spec(source)
    assert time.perf_counter() - start < seconds
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    for word in words:
        assert word in message, message
    return message


# -- the shipped specs keep their hashes (they key the kernel cache and generated/ headers) ----------------------

SHIPPED_HASHES = {
    "deberta_v3": "94806578d772608e",
    "shaw": "98fa864eb8acca10",
    "t5": "946fee7e043b7cbd",
    "t5_decoder": "57d631b4113da6f1",
    "txl": "2e559959aa74558e",
    "wav2vec2_bert": "2fdf5be0a3d22fbe",
}


@pytest.mark.parametrize("name", SHIPPED_HASHES)
def test_shipped_spec_hashes_unchanged(name):
    assert load_spec(ROOT / "specs" / f"{name}.yaml").spec_hash() == SHIPPED_HASHES[name]


# -- expressions accept only their own tokens --------------------------------------------------------------------


def test_a_comment_cannot_hide_code_in_scale(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    payload = '1 #" if __import__("os").system("touch pwned") else "1'
    refused(spec_with(scale=payload), "field 'scale'", "'#'")
    refused(spec_with(map={"kind": "expression", "expr": payload.replace("1", "0"), "rows": 1}), "field 'map.expr'")
    assert not (tmp_path / "pwned").exists()


ALLOWED = set("0123456789.eE+-*/%(), \t") | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
FOREIGN = [*sorted(set(map(chr, range(32, 127))) - ALLOWED), "\n", "\r", "\x00", "\x0b", "é", "٣", "\u2212"]


@pytest.mark.parametrize("char", FOREIGN)
def test_every_foreign_character_is_refused(char):
    with pytest.raises(ExpressionError, match="is not allowed") as err:
        compile_expression(f"d {char} 1", ("d",))
    assert "position 2" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("__import__", "'_'"),
        ("d_1", "'_'"),
        ("os", "unknown symbol 'os'"),
        ("eval(d)", "unknown function 'eval'"),
        ("Mod(d, 2)", "unknown function 'Mod'"),
        ("sqrt", "needs its arguments"),
        ("d d", "unexpected 'd'"),
        ("", "empty"),
        ("   ", "empty"),
        ("(d", "expected ')'"),
        ("1.5.3", "unexpected"),
        ("min()", "takes 1 or more argument(s), got 0"),
        ("log(d, 2, 3)", "takes 1 to 2 argument(s), got 3"),
    ],
)
def test_grammar_errors(text, words):
    with pytest.raises(ExpressionError) as err:
        compile_expression(text, ("d",))
    assert words in str(err.value)


def test_python_precedence():
    values = {
        "-2**2": -4.0,
        "2**-1": 0.5,
        "2**3**2": 512.0,
        "7 // 2 * 2": 6.0,
        "-7 // 2": -4.0,
        "-7 % 3": 2.0,
        "7 % -3": -2.0,
        "1 - 2 - 3": -4.0,
        "2 * (3 + 4)": 14.0,
        "+-+1": -1.0,
        "log(8, 2)": 3.0,
        ".5e1 + 1.": 6.0,
    }
    for text, expected in values.items():
        assert compile_expression(text, ()).value == pytest.approx(expected), text
        assert float(parse_expression(text, ())) == pytest.approx(expected), text


# -- expression size, nesting, powers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("(" * 50_000 + "1" + ")" * 50_000, "too long"),
        ("-" * 5_000 + "1", "too long"),
        ("+".join(["1"] * 200_000), "too long"),
        ("(" * 40 + "d" + ")" * 40, "nested too deeply"),
        ("-" * 40 + "d", "nested too deeply"),
        ("sqrt(" * 40 + "d" + ")" * 40, "nested too deeply"),
        ("2**" * 40 + "1", "nested too deeply"),
        ("+".join(["d"] * 300), "more than 256 nodes"),
        ("2**(d**64)", "variable exponent"),
        ("d**(d**d)", "variable exponent"),
        ("2**d", "variable exponent"),
        ("(d**64)**64", "degree too high"),
        ("((d**60 + 1)**60 + 1)**60", "degree too high"),
        ("*".join(["d"] * 65), "degree too high"),
        ("d**65", "power too large"),
        ("9**9**9", "power too large"),
        ("1" + "0" * 400, "number too large"),
        ("1e999", "number too large"),
        ("10.0**64 * 10.0**64 * 10.0**64 * 10.0**64 * 10.0**64", "too large (beyond float64)"),
        ("exp(1000)", "too large"),
        ("delta // 0", "division by zero"),
        ("delta % (3 - 3)", "division by zero"),
        ("1 / 1e-400", "division by zero"),
        ("0**-1", "division by zero"),
        ("sqrt(-1)", "not a real number"),
        ("log(-1)", "not a real number"),
        ("(-8)**(1/3)", "not a real number"),
    ],
)
def test_expression_limits(text, words):
    start = time.perf_counter()
    with pytest.raises(ExpressionError) as err:
        compile_expression(text, ("d", "delta"))
    assert time.perf_counter() - start < 0.5
    message = str(err.value)
    assert words in message and "\n" not in message and len(message) < 300, message


def test_expressions_at_the_limits_are_accepted():
    assert compile_expression("(" * 31 + "d" + ")" * 31, ("d",)).size == 1
    assert compile_expression("d**64", ("d",)).degree == 64
    assert compile_expression("+".join(["d"] * 128), ("d",)).size == 255
    assert compile_expression("1" + " " * (limits.MAX_EXPRESSION_LENGTH - 1), ()).value == 1


def test_symbolic_form_is_refused_when_undefined():
    # the float tree never divides by a constant zero, but sympy folds delta - delta to 0
    with pytest.raises(ExpressionError, match="undefined"):
        parse_expression("1 / (delta - delta)", ("delta",))


# -- sizes of maps -----------------------------------------------------------------------------------------------

BIG = 10**18


@pytest.mark.parametrize(
    ("map_spec", "field"),
    [
        ({"kind": "clipped", "min": -BIG, "max": BIG}, "map.min"),
        ({"kind": "clipped", "min": -(10**30), "max": 4}, "map.min"),
        ({"kind": "clipped", "min": -4, "max": limits.MAX_OFFSET + 1}, "map.max"),
        ({"kind": "t5", "num_buckets": 10**9}, "map.num_buckets"),
        ({"kind": "t5", "max_distance": 10**9}, "map.max_distance"),
        ({"kind": "log", "position_buckets": 10**9, "max_position": 10**9 + 10}, "map.position_buckets"),
        ({"kind": "log", "position_buckets": 256, "max_position": BIG}, "map.max_position"),
        ({"kind": "expression", "expr": "0", "rows": BIG}, "map.rows"),
        ({"kind": "expression", "expr": "d" * 2000, "rows": 3}, "map.expr"),
        ({"kind": "boundaries", "boundaries": list(range(limits.MAX_BOUNDARIES + 1))}, "map.boundaries"),
        ({"kind": "boundaries", "boundaries": [-BIG, 0]}, "map.boundaries[0]"),
    ],
)
def test_map_sizes_are_bounded(map_spec, field):
    refused(spec_with(map=map_spec), f"field '{field}'")


def test_maps_at_the_limits_are_accepted():
    top = limits.MAX_OFFSET
    assert load_spec(spec_with(map={"kind": "clipped", "min": -top, "max": top})).map.num_rows(1) == limits.MAX_ROWS
    assert load_spec(spec_with(map={"kind": "t5", "num_buckets": limits.MAX_ROWS, "max_distance": top}))
    assert load_spec(spec_with(map={"kind": "log", "position_buckets": limits.MAX_ROWS // 2, "max_position": top}))
    boundaries = list(range(-limits.MAX_BOUNDARIES // 2, limits.MAX_BOUNDARIES // 2))
    assert load_spec(spec_with(map={"kind": "boundaries", "boundaries": boundaries})).map.num_rows(1) == 4097


def test_unsorted_boundaries_message_stays_short():
    message = refused(spec_with(map={"kind": "boundaries", "boundaries": list(range(4000))[::-1]}), "index 1")
    assert len(message) < 150


# -- strict types ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"causal": "yes"}, "causal"),
        ({"causal": 1}, "causal"),
        ({"heads_share_tables": "true"}, "heads_share_tables"),
        ({"map": {"kind": "clipped", "min": "-4", "max": 4}}, "map.min"),
        ({"map": {"kind": "clipped", "min": False, "max": 4}}, "map.min"),
        ({"map": {"kind": "clipped", "min": -4.0, "max": 4}}, "map.min"),
        ({"map": {"kind": "t5", "bidirectional": "no"}}, "map.bidirectional"),
        ({"map": {"kind": "t5", "num_buckets": 32.0}}, "map.num_buckets"),
        ({"map": {"kind": "expression", "expr": "0", "rows": "3"}}, "map.rows"),
        ({"map": {"kind": "boundaries", "boundaries": ["1", "2"]}}, "map.boundaries[0]"),
        ({"map": {"kind": "expression", "expr": 3, "rows": 4}}, "map.expr"),
        ({"name": 5}, "name"),
        ({"description": ["a"]}, "description"),
        ({"terms": "query"}, "terms"),
        ({"scale": True}, "scale"),
        ({"scale": [1]}, "scale"),
    ],
)
def test_no_lenient_coercion(fields, field):
    refused(spec_with(**fields), f"field '{field}'")


def test_numbers_where_numbers_are_meant():
    assert load_spec(spec_with(scale=1)).scale == 1.0  # an int is a number (and the canonical form stays 1.0)
    assert load_spec(spec_with(scale=0.5)).scale_value(64) == 0.5
    assert load_spec(spec_with(terms=("key", "query"))).terms == ("query", "key")


def test_name_length_is_bounded():
    refused(spec_with(name="a" * 300), "field 'name'", "at most 64 characters")
    assert load_spec(spec_with(name="a" * 64)).name == "a" * 64
    refused(spec_with(description="x" * (limits.MAX_DESCRIPTION_LENGTH + 1)), "field 'description'")


# -- τ ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scale", "d", "words"),
    [
        ("d - 20", 16, "τ = -4 at d = 16"),
        ("exp(-1000)", 64, "τ = 0 at d = 64"),
        (1e-46, 64, "τ = 1e-46"),
        ("1e-40", 64, "τ = 1e-40"),  # subnormal in fp32
        ("2e38*d", 64, "τ = 1.28e+40"),
        ("1e38 * 4", 64, "τ = 4e+38"),
        ("1/(d - 64)", 64, "τ = inf"),
        ("sqrt(d - 65)", 64, "τ = nan"),
    ],
)
def test_scale_must_be_a_positive_fp32_number(scale, d, words):
    if d == 64:
        refused(spec_with(scale=scale), "field 'scale'", words)
    spec = MechanismSpec.model_construct(scale=scale)  # unchecked: as if loaded at another head dim
    with pytest.raises(ValueError, match="scale") as err:
        spec.scale_value(d)
    assert words in str(err.value)


def test_scale_checked_at_each_head_dim():
    spec = load_spec(spec_with(scale="d - 20"))  # positive at d = 64, where loading checks it
    assert spec.scale_value(64) == 44.0
    with pytest.raises(ValueError, match="scale 'd - 20' gives τ = -4 at d = 16"):
        spec.scale_value(16)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0.0, -1.0])
def test_non_finite_or_non_positive_scale_numbers(scale):
    refused(spec_with(scale=scale), "field 'scale'")


@pytest.mark.parametrize("head_dim", [0, -1, True, 2.5, "64", None])
def test_scale_value_head_dim(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        load_spec(BASE).scale_value(head_dim)


def test_scale_value_is_bounded_in_time():
    spec = load_spec(spec_with(scale="floor(exp(exp(d) / 1e27)) + " + " + ".join(["sqrt(d)"] * 30)))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="τ = inf"):
        spec.scale_value(128)  # exp(exp(128)/1e27) is beyond float64: sympy would compute its digits
    assert spec.scale_value(64) > 0
    assert time.perf_counter() - start < 0.5


# -- YAML ----------------------------------------------------------------------------------------------------------


def alias_bomb(levels: int = 9) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_counted_not_expanded():
    refused(BASE_YAML + alias_bomb(), "more than 10000 YAML nodes")
    bomb_as_map = "name: demo\nterms: [query]\n" + alias_bomb().replace("l8:", "map:")
    refused(bomb_as_map, "more than 10000 YAML nodes")


def test_aliases_within_the_limit_are_plain_data():
    text = "name: demo\nterms: &t [query]\nmap: &m {kind: clipped, min: -4, max: 4}\n"
    assert load_spec(text) == load_spec(BASE)


def test_recursive_alias():
    refused("a: &a [1, *a]\n", "line 1", "recursive alias *a")


@pytest.mark.parametrize("text", ["[" * 30_000 + "]" * 30_000, "{a: " * 30_000 + "1" + "}" * 30_000])
def test_deep_nesting_is_refused_before_composing(text):
    # libyaml's composer recurses once per level and crashes the interpreter at about this depth
    refused(text[: limits.MAX_SPEC_BYTES], "nested more than 16 levels")


def test_yaml_text_size():
    refused(BASE_YAML + "#" * limits.MAX_SPEC_BYTES, "larger than 65536 bytes")
    refused("é" * (limits.MAX_SPEC_BYTES // 2 + 1), "larger than 65536 bytes")  # two bytes each in UTF-8


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("description: !!binary aGVsbG8=\n", "YAML tag !!binary is not allowed"),
        ("description: !!python/object/apply:os.system ['true']\n", "!!python/object/apply:os.system"),
        ("description: !custom x\n", "YAML tag !custom is not allowed"),
        ("description: 2024-01-01\n", "!!timestamp"),
        ("causal: !!bool maybe\n", "unreadable bool 'maybe'"),
        ("causal: !!map x\n", "!!map"),
        ("1: 2\n", "keys must be strings"),
        ("[a]: 2\n", "keys must be strings"),
        ("causal: false\ncausal: true\n", "line 5: duplicate key 'causal' (first at line 4)"),
        ("name: other\n", "line 4: duplicate key 'name' (first at line 1)"),
        ("---\nname: x\n", "expected a single document"),
    ],
)
def test_plain_yaml_only(extra, words):
    refused(BASE_YAML + extra, words)


def test_set_and_merge_keys_are_refused():
    refused(BASE_YAML.replace("[query]", "!!set {query: null}"), "line 2", "!!set")
    merged = "base: &b {kind: clipped, min: -4, max: 4}\nname: demo\nterms: [query]\nmap: {<<: *b}\n"
    refused(merged, "line 4", "!!merge")


def test_long_numbers_are_refused_before_conversion():
    refused(BASE_YAML.replace("-4", "-" + "9" * 5000), "line 3", "number longer than 100 characters")
    refused(BASE_YAML.replace("-4", "-" + ":".join(["59"] * 60)), "number longer")  # base 60


def test_hostile_keys_and_tags_are_quoted_short():
    refused(spec_with(**{"k" * 10_000: 1}), "unknown key")
    refused(spec_with(map={"kind": "w" * 10_000}), "field 'map.kind'", "unknown map kind")


# -- files and paths -----------------------------------------------------------------------------------------------


def test_large_files_are_read_only_up_to_the_limit(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(BASE_YAML + "#" * limits.MAX_SPEC_BYTES)
    refused(big, str(big), "larger than 65536 bytes")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_is_refused_at_once():
    refused(Path("/dev/zero"), "/dev/zero: spec file larger than")
    refused("/dev/zero", "/dev/zero: spec file larger than")


def test_non_utf8_file_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: d\xe9mo\n")
    refused(path, str(path), "not UTF-8 text (byte 0xe9 at offset 7)")


def test_a_utf8_bom_is_fine(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + BASE_YAML.encode())
    assert load_spec(path) == load_spec(BASE)


def test_path_rules(tmp_path, monkeypatch):
    path = tmp_path / "spec.yaml"
    path.write_text(BASE_YAML)
    expected = load_spec(BASE)
    assert load_spec(f"{path} ") == expected  # surrounding whitespace is stripped
    assert load_spec(f"  {path}\n") == expected
    plain = tmp_path / "spec_without_suffix"
    plain.write_text(BASE_YAML)
    assert load_spec(str(plain)) == expected  # an existing file, whatever its name
    refused(str(tmp_path / "missing.yml"), "cannot read spec file: No such file")
    refused(str(tmp_path), "cannot read spec file")  # a directory
    refused("just some words", "expected a mapping of spec fields (or the path of an existing spec file)")
    refused("x" * 10_000, "expected a mapping")  # too long to be a path: YAML text
    refused("a\x00b.yaml", "cannot read spec file")


@pytest.mark.parametrize("source", [3, None, b"name: x", ["name"]])
def test_unsupported_sources(source):
    refused(source, "expected a MechanismSpec, a dict, a path or YAML text")


# -- analysis bounds -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [10**9, limits.MAX_SEQ_LEN + 1, 0, -5, True, 2.0, "64"])
def test_analysis_length_is_bounded(seq_len):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="seq_len must be a positive integer of at most 131072"):
        analyze(BASE, seq_len)
    assert time.perf_counter() - start < 0.5


def test_analysis_at_the_longest_length():
    txl = {"name": "txl", "terms": ["query"], "map": {"kind": "identity"}}
    start = time.process_time()
    plan = analyze(txl, limits.MAX_SEQ_LEN)
    assert time.process_time() - start < 5  # about 0.3 s alone; the machine may be busy
    assert plan.rows == 2 * limits.MAX_SEQ_LEN - 1 and plan.unreached_rows == ()


@pytest.mark.parametrize("head_dim", [0, True, 1.5])
def test_analysis_head_dim(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        analyze(BASE, 16, head_dim=head_dim)


def nested_floors(k: int) -> str:
    text = "delta"
    for i in range(k):
        text = f"{'floor' if i % 2 == 0 else 'ceiling'}({text}/{i + 2})"
    return f"Max(Min({text}, 2), -2) + 2"


@pytest.mark.parametrize(
    "expr",
    [
        nested_floors(12),  # sympy's simplify took over a minute on this
        "sign(Min(Max(floor(-14), (delta // 5)), exp(Max(delta, delta)), 9)) + 1",
        " % 7 + ".join([f"floor(delta / {i + 2})" for i in range(6)]) + " % 7",
    ],
)
def test_saturation_proofs_are_bounded_in_time(expr):
    rows = 3 if expr.startswith("sign") else 43
    spec = load_spec(spec_with(map={"kind": "expression", "expr": expr, "rows": rows}))
    start = time.process_time()
    canonical_length(spec)
    analyze(spec, 256)
    assert time.process_time() - start < 2


@pytest.mark.parametrize(
    ("expr", "rows", "proven"),
    [
        ("Min(Abs(delta), 16)", 17, True),
        ("floor(Max(Min(delta, 5), -5) / 2) + 5", 11, True),
        ("sign(delta)*Min(floor(sqrt(Abs(delta))), 7) + 7", 15, True),
        ("Min(floor(log(Abs(delta) + 1) * 4), 15)", 16, True),
        ("(Min(Max(delta, -3), 4) + 3) % 3", 3, True),
        ("Min(Abs(delta), 3)**2", 10, True),
        ("delta % 2", 2, False),
        ("Min(Abs(delta), 5) + delta - delta", 6, False),  # interval arithmetic cannot cancel delta - delta
    ],
)
def test_saturation_proofs(expr, rows, proven):
    for offset in ("query_minus_key", "key_minus_query"):
        spec = load_spec(spec_with(map={"kind": "expression", "expr": expr, "rows": rows, "offset": offset}))
        n = canonical_length(spec)
        plan = analyze(spec, n)
        assert plan.saturation_proven == proven, (expr, offset)
        if proven:  # the proof holds far beyond the window: brute force
            far = np.arange(n, 50 * n)
            high_row = spec.map.row_ids(np.array([n - 1]), n)[0]
            low_row = spec.map.row_ids(np.array([-(n - 1)]), n)[0]
            assert (spec.map.row_ids(far, n) == high_row).all() and (spec.map.row_ids(-far, n) == low_row).all()


def test_interval_bounds_of_a_few_expressions():
    def bounds(text, low, high):
        return compile_expression(text, ("x",)).bounds(low, high)

    assert bounds("Min(Abs(x), 16)", 16, math.inf) == (16, 16)
    assert bounds("x % 5", 10, 14) == (0, 4)
    assert bounds("x % 5", 10, 15) == (0, 5)
    assert all(math.isnan(v) for v in bounds("1 / x", -1, 1))
    assert all(math.isnan(v) for v in bounds("Max(Min(sqrt(x), 5), 5)", -1, 4))  # NaN at x < 0 propagates
    assert all(math.isnan(v) for v in bounds("Min(exp(x) - exp(x), 1)", 0, math.inf))  # inf − inf is NaN
    assert bounds("Min(exp(x), 5)", 0, 1e6) == (np.nextafter(1, 0), 5)  # an overflow to inf is still ordered
    assert bounds("x**2", -3, 2) == (0, np.nextafter(9, 10))  # libm's pow: one ulp wider
    low, high = bounds("x**-1", 1, 1e300)
    assert 0 < low <= 1e-300 and 1 <= high < 1 + 1e-15
    assert bounds("Max(Min(x, 3), 3)**-1", 1, 1e300) == (1 / 3, 1 / 3)  # a single point: its exact value
    assert bounds("0 * x", -1e9, 1e9) == (0, 0)
    assert all(math.isnan(v) for v in bounds("0 * exp(x)", 0, 1e9))  # 0 · inf is NaN
    assert bounds("x - x", 0, 1) == (-1, 1)
