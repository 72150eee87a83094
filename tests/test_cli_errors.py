"""The command line never ends in a traceback: a bad argument, spec or file is one line `relgen: error: ...` naming
it, exit status 2; an unexpected exception (a bug) one line `relgen: internal error: ...`, exit status 1."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from relgen.cli import main as cli
from relgen.cli.main import MAX_SEQ_LEN, main
from relgen.codegen import generator as codegen
from relgen.plan.analyze import analyze
from relgen.spec.model import load_spec

ROOT = Path(__file__).resolve().parents[1]
T5 = ROOT / "specs" / "t5.yaml"
GOOD = "name: demo\nterms: [bias]\nmap: {kind: clipped, min: -4, max: 4}\n"


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(err: str, *words: str) -> None:
    assert err.startswith("relgen: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


# -- sequence lengths are bounded by argparse -------------------------------------------------------------------

BAD_LENGTHS = ["2**62", "4611686018427387904", "1000000000", str(MAX_SEQ_LEN + 1), "0", "-3", "abc", "1.5", ""]


@pytest.mark.parametrize("value", BAD_LENGTHS)
@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("explain", "--seq-len"),
        ("validate", "--seq-len"),
        ("check", "--seq-len"),
        ("tune", "--seq-lens"),
        ("warmup", "--seq-lens"),
    ],
)
def test_bad_lengths_are_one_line(capsys, command, option, value):
    code, out, err = run(capsys, command, T5, option, value)
    assert (code, out) == (2, "")
    assert_one_line(err, f"argument {option}", f"from 1 to {MAX_SEQ_LEN}", f"usage: relgen {command}")


def test_the_largest_length_is_accepted_by_the_parser():
    args = cli.build_parser().parse_args(["explain", str(T5), "--seq-len", str(MAX_SEQ_LEN)])
    assert args.seq_len == MAX_SEQ_LEN


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], ["required: COMMAND", "usage: relgen"]),
        (["frobnicate"], ["invalid choice", "'frobnicate'"]),
        (["explain"], ["required: SPEC", "usage: relgen explain"]),
        (["explain", T5, "--bogus"], ["unrecognized arguments: --bogus"]),
        (["check", T5, "--dtype", "fp8"], ["argument --dtype", "invalid choice"]),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert_one_line(err, *words)


# -- build: the output folder and file --------------------------------------------------------------------------


def test_build_onto_a_file(capsys, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("keep me")
    code, out, err = run(capsys, "build", T5, "-o", target)
    assert (code, out) == (2, "")
    assert_one_line(err, "--out", str(target), "Not a directory")
    assert target.read_text() == "keep me"


def test_build_below_a_file(capsys, tmp_path):
    (tmp_path / "a_file").write_text("")
    code, _, err = run(capsys, "build", T5, "-o", tmp_path / "a_file" / "sub")
    assert code == 2
    assert_one_line(err, "--out", "Not a directory")


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc")
def test_build_into_proc(capsys):
    code, _, err = run(capsys, "build", T5, "-o", "/proc/relgen_out")
    assert code == 2
    assert_one_line(err, "--out", "/proc/relgen_out")


def test_build_with_a_name_too_long(capsys, tmp_path):
    code, _, err = run(capsys, "build", T5, "-o", tmp_path / ("a" * 300))
    assert code == 2
    assert_one_line(err, "--out", os.strerror(errno.ENAMETOOLONG))


def test_build_permission_denied_leaves_no_partial_file(capsys, tmp_path, monkeypatch):
    def denied(src, dst):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(src), None, str(dst))

    monkeypatch.setattr(codegen.os, "replace", denied)
    code, _, err = run(capsys, "build", T5, "-o", tmp_path)
    assert code == 2
    assert_one_line(err, "--out", "Permission denied", str(tmp_path / "t5.py"))
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone too


def test_build_replaces_a_link_not_its_target(capsys, tmp_path):
    victim = tmp_path / "victim.py"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "t5.py").symlink_to(victim)
    code, stdout, err = run(capsys, "build", T5, "-o", out)
    assert (code, err) == (0, "") and stdout == f"wrote {out / 't5.py'}\n"
    assert victim.read_text() == "keep me"
    built = out / "t5.py"
    assert not built.is_symlink()
    assert built.read_text() == codegen.format_source(codegen.render(analyze(load_spec(T5))))
    assert sorted(p.name for p in out.iterdir()) == ["t5.py"]


def test_build_reports_each_bad_spec_and_builds_the_others(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("min: -4", "min: 4"))
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "build", bad, T5, "-o", out)
    assert code == 2
    assert_one_line(err, str(bad), "field 'map.min'")
    assert stdout == f"wrote {out / 't5.py'}\n"


# -- specs that exhaust the interpreter -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["explain", "validate", "build"])
def test_a_deeply_nested_scale_is_one_line(capsys, tmp_path, command):
    spec = tmp_path / "deep.yaml"
    spec.write_text(GOOD + f"scale: '{'-' * 5000}1'\n")
    code, out, err = run(capsys, command, spec, *(["-o", tmp_path / "out"] if command == "build" else []))
    assert (code, out) == (2, "")
    assert_one_line(err, str(spec))


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (RecursionError("maximum recursion depth exceeded"), ["nested too deeply"]),
        (MemoryError(), ["out of memory"]),
        (NotImplementedError("a combination relgen does not support"), ["does not support"]),
    ],
)
def test_analysis_running_out_is_one_line(capsys, monkeypatch, tmp_path, error, words):
    def failing(*args, **kwargs):
        raise error

    spec = tmp_path / "spec.yaml"
    spec.write_text(GOOD)
    monkeypatch.setattr(cli, "analyze", failing)
    for command in ("explain", "validate"):
        code, out, err = run(capsys, command, spec)
        assert (code, out) == (2, "")
        assert_one_line(err, str(spec), *words)


def test_an_os_error_is_one_line(capsys, monkeypatch):
    def failing(path):
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    monkeypatch.setattr(cli, "_load", failing)
    code, _, err = run(capsys, "explain", T5)
    assert code == 2
    assert err == f"relgen: error: {T5}: {os.strerror(errno.EIO)}\n"


def test_a_bug_is_one_line_and_exit_1(capsys, monkeypatch):
    def buggy(*args, **kwargs):
        raise KeyError("no such thing")

    monkeypatch.setattr(cli, "analyze", buggy)
    code, out, err = run(capsys, "explain", T5)
    assert (code, out) == (1, "")
    assert err == "relgen: internal error: KeyError: 'no such thing'\n"
    monkeypatch.setenv("RELGEN_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["explain", str(T5)])


# -- the spec's own text is printed without control characters ----------------------------------------------------


def test_explain_prints_no_control_characters(capsys, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(GOOD + 'description: "red \\e[31m text\\u2028and a bell\\a"\n')
    code, out, err = run(capsys, "explain", spec)
    assert (code, err) == (0, "")
    assert "red" in out and "bell" in out
    assert not any(c in out for c in "\x1b\u2028\x07")


def test_error_lines_carry_no_control_characters(capsys, tmp_path):
    spec = tmp_path / "a\x1b[2Jb\u2028c.yaml"  # the file's name is part of the message
    spec.write_text(GOOD.replace("name: demo", "name: Demo"))
    code, _, err = run(capsys, "validate", spec)
    assert code == 2
    assert_one_line(err, "field 'name'", "a [2Jb c.yaml")
    assert "\x1b" not in err and "\u2028" not in err
