"""The `relgen` command line: explain, validate, the hooks, and one-line errors for bad specs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from tiers import SLOW

from relgen.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
SPEC_IDS = [p.stem for p in SPECS]

GOOD = "name: demo\nterms: [query]\nmap: {kind: clipped, min: -4, max: 4}\n"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- explain ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_explain_table(capsys, spec):
    code, out, err = run(capsys, "explain", spec)
    assert code == 0 and err == ""
    assert "N = 1024" in out
    for label in (
        "rows R",
        "contiguity",
        "path",
        "saturation low L",
        "saturation high U",
        "beyond the window",
        "expanded rows C",
        "copies",
        "row order",
        "unreached rows",
        "group size G",
        "query window W",
        "key window",
        "groups",
        "projection FLOPs",
    ):
        assert label in out, label


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_explain_json(capsys, spec):
    code, out, err = run(capsys, "explain", spec, "--json", "--seq-len", "512")
    assert code == 0 and err == ""
    plan = json.loads(out)
    assert plan["spec_name"] == spec.stem and plan["seq_len"] == 512
    assert isinstance(plan["rows"], int) and isinstance(plan["contiguous"], bool)
    assert plan["path"] in ("offset", "atomic")
    assert set(plan["saturation"]) >= {"low", "high"}
    assert plan["expanded_rows"] == plan["saturation"]["high"] - plan["saturation"]["low"] + 1


def test_explain_t5(capsys):
    code, out, _ = run(capsys, "explain", ROOT / "specs/t5.yaml", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["seq_len"] == 1024
    assert plan["saturation"] == {"low": -91, "high": 91}
    assert plan["contiguous"] is True and plan["path"] == "offset"
    assert plan["rows"] == 32 and plan["expanded_rows"] == 183 and plan["unreached_rows"] == [16]

    code, out, _ = run(capsys, "explain", ROOT / "specs/t5.yaml")
    assert code == 0
    assert "saturation low L      -91" in out and "saturation high U     91" in out
    assert "offset: atomic-free" in out and "deterministic" in out
    assert "proven" in out and "183" in out


def test_explain_identity_depends_on_length(capsys):
    _, out, _ = run(capsys, "explain", ROOT / "specs/txl.yaml", "--seq-len", "300", "--json")
    plan = json.loads(out)
    assert plan["rows"] == 599 and plan["saturation"] == {"low": -299, "high": 299}
    assert plan["query_window"] == 300 + 128 - 1


def test_explain_atomic_path(capsys, tmp_path):
    spec = write(
        tmp_path, "name: sym\nterms: [query]\nmap: {kind: expression, expr: 'Min(Abs(delta), 16)', rows: 17}\n"
    )
    code, out, _ = run(capsys, "explain", spec, "--seq-len", "256")
    assert code == 0
    assert "NOT contiguous" in out
    assert "atomic" in out and "fp32 atomic" in out and "NOT bitwise deterministic" in out
    _, out, _ = run(capsys, "explain", spec, "--seq-len", "256", "--json")
    assert json.loads(out)["path"] == "atomic"


# -- validate --------------------------------------------------------------------------------------------------


def test_validate_shipped_specs(capsys):
    code, out, err = run(capsys, "validate", *SPECS)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == len(SPECS)
    for line, spec in zip(lines, SPECS, strict=True):
        assert line.startswith(f"ok  {spec}  {spec.stem}: map=")


def test_validate_reports_each_bad_spec(capsys, tmp_path):
    bad = write(tmp_path, GOOD.replace("[query]", "[query, query]"), "bad.yaml")
    code, out, err = run(capsys, "validate", SPECS[0], bad, SPECS[1])
    assert code == 2
    assert len(out.splitlines()) == 2
    assert err.splitlines() == [err.strip()]
    assert err.startswith(f"relgen: error: {bad}: line 2: field 'terms'")


# -- errors: one line, exit status 2 ---------------------------------------------------------------------------

BAD_SPECS = [
    # (id, YAML, words the line must contain: the field and the YAML line)
    ("unknown-top", GOOD + "foo: 1\n", ["line 4", "field 'foo'", "unknown key", "allowed: name"]),
    (
        "unknown-in-map",
        "name: demo\nterms: [query]\nmap:\n  kind: clipped\n  min: -4\n  max: 4\n  bogus: 3\n",
        ["line 7", "field 'map.bogus'", "unknown key", "allowed: kind, min, max, offset"],
    ),
    ("terms-int", GOOD.replace("[query]", "5"), ["line 2", "field 'terms'", "list", "got 5"]),
    ("causal-maybe", GOOD + "causal: maybe\n", ["line 4", "field 'causal'", "boolean", "'maybe'"]),
    ("clipped-min-gt-max", GOOD.replace("min: -4, max: 4", "min: 4, max: 2"), ["line 3", "field 'map.min'"]),
    ("clipped-min-positive", GOOD.replace("min: -4", "min: 1"), ["line 3", "field 'map.min'", "less than or equal"]),
    ("clipped-max-negative", GOOD.replace("max: 4", "max: -1"), ["line 3", "field 'map.max'"]),
    ("scale-symbol", GOOD + "scale: 1/sqrt(h)\n", ["line 4", "field 'scale'", "unknown symbol 'h'"]),
    ("scale-function", GOOD + "scale: tanh(d)\n", ["line 4", "field 'scale'", "unknown function 'tanh'"]),
    ("scale-negative", GOOD + "scale: -2\n", ["line 4", "field 'scale'", "positive"]),
    (
        "expr-symbol",
        "name: demo\nterms: [query]\nmap:\n  kind: expression\n  expr: Min(Abs(x), 4)\n  rows: 5\n",
        ["line 5", "field 'map.expr'", "unknown symbol 'x'"],
    ),
    (
        "expr-function",
        "name: demo\nterms: [query]\nmap: {kind: expression, expr: 'cosh(delta)', rows: 5}\n",
        ["line 3", "field 'map.expr'", "unknown function 'cosh'"],
    ),
    (
        "expr-code",
        "name: demo\nterms: [query]\nmap: {kind: expression, expr: \"__import__('os')\", rows: 5}\n",
        ["line 3", "field 'map.expr'", "__import__"],
    ),
    (
        "expr-out-of-range",
        "name: demo\nterms: [query]\nmap: {kind: expression, expr: 'Min(Abs(delta), 16)', rows: 5}\n",
        ["line 3", "field 'map'", "expected an integer in [0, rows=5)"],
    ),
    (
        "expr-negative",
        "name: demo\nterms: [query]\nmap: {kind: expression, expr: 'Min(delta, 3)', rows: 5}\n",
        ["line 3", "field 'map'", "gives -1024"],
    ),
    (
        "expr-not-integer",
        "name: demo\nterms: [query]\nmap: {kind: expression, expr: 'Min(Abs(delta), 8) / 2', rows: 5}\n",
        ["line 3", "field 'map'", "gives 3.5 at delta=-7", "integer"],
    ),
    ("terms-empty", GOOD.replace("[query]", "[]"), ["line 2", "field 'terms'", "at least one of query, key, bias"]),
    ("terms-repeated", GOOD.replace("[query]", "[key, key]"), ["line 2", "field 'terms'", "must not repeat"]),
    ("terms-unknown", GOOD.replace("[query]", "[query, value]"), ["line 2", "field 'terms[1]'", "'value'"]),
    ("name-bad", GOOD.replace("name: demo", "name: Demo-1"), ["line 1", "field 'name'", "'Demo-1'"]),
    ("map-missing", "name: demo\nterms: [query]\n", ["field 'map'", "required"]),
    ("map-kind-unknown", GOOD.replace("clipped", "wavy"), ["line 3", "field 'map.kind'", "'wavy'"]),
    ("yaml-tab", "name: demo\nterms: [query]\nmap:\n\tkind: clipped\n", ["line 4", "unreadable YAML", "'\\t'"]),
    (
        "yaml-unclosed",
        "name: demo\nterms: [query\nmap: {kind: clipped, min: -4, max: 4}\n",
        ["line 3", "unreadable YAML", "started at line 2"],
    ),
    ("yaml-empty", "", ["empty"]),
    ("yaml-list", "- name\n- terms\n", ["mapping"]),
]


@pytest.mark.parametrize(("text", "words"), [case[1:] for case in BAD_SPECS], ids=[case[0] for case in BAD_SPECS])
@pytest.mark.parametrize("command", ["explain", "validate"])
def test_bad_spec_is_one_line(capsys, tmp_path, command, text, words):
    spec = write(tmp_path, text)
    code, out, err = run(capsys, command, spec)
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"relgen: error: {spec}:")
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def test_missing_file(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    code, out, err = run(capsys, "explain", missing)
    assert (code, out) == (2, "")
    assert err == f"relgen: error: {missing}: cannot read spec file: No such file or directory\n"


@pytest.mark.parametrize("seq_len", ["0", "-3"])
def test_bad_seq_len(capsys, seq_len):
    code, out, err = run(capsys, "explain", SPECS[0], "--seq-len", seq_len)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "argument --seq-len: expected an integer from 1 to" in err


def test_usage_errors_and_help(capsys):
    assert run(capsys, "--help")[0] == 0
    assert run(capsys, "--version")[1].startswith("relgen ")
    code, _, err = run(capsys)
    assert code == 2 and "usage" in err and err.count("\n") == 1
    code, _, err = run(capsys, "frobnicate")
    assert code == 2 and "invalid choice" in err and err.count("\n") == 1


# -- hooks -----------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_modules(monkeypatch):
    """Stand-ins for relgen.cli.commands, relgen.cli.tune and relgen.bench.cli that record their calls."""
    calls: list[tuple[str, object]] = []

    def recorder(name):
        def function(args):
            calls.append((name, args))
            return 0

        return function

    commands = types.ModuleType("relgen.cli.commands")
    commands.cli_build = recorder("build")
    commands.cli_check = recorder("check")
    tune = types.ModuleType("relgen.cli.tune")
    tune.cli_tune = recorder("tune")
    tune.cli_warmup = recorder("warmup")
    bench = types.ModuleType("relgen.bench.cli")
    bench.main = recorder("bench")
    monkeypatch.setitem(sys.modules, "relgen.cli.commands", commands)
    monkeypatch.setitem(sys.modules, "relgen.cli.tune", tune)
    monkeypatch.setitem(sys.modules, "relgen.bench.cli", bench)
    return calls


def test_hooks_receive_arguments(capsys, fake_modules):
    shaw, t5 = str(ROOT / "specs/shaw.yaml"), str(ROOT / "specs/t5.yaml")
    assert main(["build", shaw, t5]) == 0
    assert main(["build", shaw, "-o", "out"]) == 0
    assert main(["check", shaw, "--seq-len", "64", "300"]) == 0
    assert main(["check", shaw]) == 0
    assert main(["tune", shaw, "--out", "tuned.json"]) == 0
    assert main(["warmup", shaw]) == 0
    assert main(["warmup", shaw, "--dtype", "bf16", "--head-dim", "128"]) == 0
    got = [(name, vars(args)) for name, args in fake_modules]
    assert [name for name, _ in got] == ["build", "build", "check", "check", "tune", "warmup", "warmup"]
    assert got[0][1]["specs"] == [shaw, t5] and got[0][1]["out"] == "generated"
    assert got[1][1]["out"] == "out"
    assert got[2][1]["seq_len"] == [64, 300] and got[3][1]["seq_len"] is None
    assert got[4][1]["out"] == "tuned.json"
    assert (got[5][1]["dtype"], got[5][1]["head_dim"]) == ("fp16", 64)
    assert (got[6][1]["dtype"], got[6][1]["head_dim"]) == ("bf16", 128)


def test_bench_passthrough(capsys, fake_modules):
    assert main(["bench", "--help", "--mechanism", "t5", "-n", "3"]) == 0
    assert fake_modules == [("bench", ["--help", "--mechanism", "t5", "-n", "3"])]


def test_hook_errors_are_one_line(capsys, monkeypatch, fake_modules):
    def failing(args):
        raise ValueError("q: head dim d must be one of (16, 32, 64, 128), got 48")

    monkeypatch.setattr(sys.modules["relgen.cli.tune"], "cli_warmup", failing)
    code, _, err = run(capsys, "warmup", SPECS[0], "--head-dim", "48")
    assert code == 2 and err == "relgen: error: q: head dim d must be one of (16, 32, 64, 128), got 48\n"

    monkeypatch.delattr(sys.modules["relgen.cli.tune"], "cli_tune")
    code, _, err = run(capsys, "tune", SPECS[0])
    assert code == 2 and err == "relgen: error: 'relgen tune' is not available (relgen.cli.tune.cli_tune is missing)\n"


# -- the installed entry point ---------------------------------------------------------------------------------


@SLOW
def test_installed_entry_point(tmp_path):
    exe = shutil.which("relgen")
    if exe is None:
        pytest.skip("the relgen console script is not installed (pip install -e .)")
    bad = write(tmp_path, GOOD + "causal: maybe\n")
    # one process (importing torch takes seconds): a good spec, then a bad one
    done = subprocess.run(
        [exe, "validate", "specs/t5.yaml", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stdout.startswith("ok  specs/t5.yaml  t5: map=t5 terms=bias R=32 path=offset saturation=[-91, 91]")
    assert done.stdout.count("\n") == 1
    message = "Input should be a valid boolean, got 'maybe'"  # strict: no 'yes'/'on' strings read as booleans
    assert done.stderr == f"relgen: error: {bad}: line 4: field 'causal': {message}\n"
