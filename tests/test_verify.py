"""relgen.check.verify: check_spec and `relgen check` against the FP64 reference (Triton's interpreter on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import relgen
from relgen.check import verify
from relgen.cli.main import main
from relgen.runtime import mechanism as runtime

ROOT = Path(__file__).resolve().parents[1]
T5 = ROOT / "specs" / "t5.yaml"


def test_check_spec_passes_on_a_shipped_spec():
    results = verify.check_spec(T5, seq_lens=(17,))
    assert [r.tensor for r in results] == ["out", "dq", "dk", "dv", "dbias"]
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert {(r.spec, r.seq_len, r.device) for r in results} == {("t5", 17, device)}
    assert all(0 <= r.rel_l2 < 1e-2 and not r.zero_expected for r in results)


def test_check_spec_rejects_bad_lengths():
    with pytest.raises(ValueError, match="positive"):
        verify.check_spec(T5, seq_lens=(0,))


def test_cli_check_passes(capsys):
    code = main(["check", str(T5), "--seq-len", "9"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.startswith(f"ok  {T5}  t5  (")
    assert "5/5 tensors passed" in out and "FAIL" not in out
    header, row = out.splitlines()[1:3]
    assert header.split() == ["N", "out", "dq", "dk", "dv", "dbias"]
    assert row.split()[0] == "9" and row.split().count("ok") == 5


def _perturbed(monkeypatch, factor=1.5):
    """compile_mechanism returns a callable whose output is 50 % too large (a deliberately wrong kernel)."""
    real = runtime.compile_mechanism

    def wrong(spec):
        fn = real(spec)
        return lambda *args, **kwargs: fn(*args, **kwargs) * factor

    monkeypatch.setattr(runtime, "compile_mechanism", wrong)


def test_wrong_kernel_is_detected(monkeypatch, capsys):
    _perturbed(monkeypatch)
    results = verify.check_spec(T5, seq_lens=(9,))
    failed = {r.tensor for r in results if not r.ok}
    assert "out" in failed and "dv" in failed
    assert all(r.message for r in results)

    code = main(["check", str(T5), "--seq-len", "9"])
    out, _ = capsys.readouterr()
    assert code == 1
    assert out.startswith(f"FAILED  {T5}")
    assert "FAIL N=9 out:" in out and "rel ℓ2" in out


def test_raising_kernel_is_a_failure(monkeypatch, capsys):
    def broken(spec):
        def fn(*args, **kwargs):
            raise RuntimeError("kernel exploded")

        return fn

    monkeypatch.setattr(runtime, "compile_mechanism", broken)
    code = main(["check", str(T5), "--seq-len", "3", "5"])
    out, _ = capsys.readouterr()
    assert code == 1
    assert "ERROR N=3: RuntimeError: kernel exploded" in out and "ERROR N=5" in out


def test_bad_spec_exits_2_and_other_specs_are_checked(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo\nterms: [query]\nmap: {kind: clipped, min: 4, max: 2}\n")
    code = main(["check", str(bad), str(T5), "--seq-len", "2"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith(f"relgen: error: {bad}: line 3") and err.count("\n") == 1
    assert f"ok  {T5}" in out


def test_bad_seq_len_exits_2(capsys):
    code = main(["check", str(T5), "--seq-len", "0"])
    _, err = capsys.readouterr()
    assert code == 2 and "--seq-len" in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [(["--head-dim", "20"], ["--head-dim", "20"]), (["--seq-len", "9000"], ["--seq-len", "8192", "9000"])],
)
def test_bad_settings_exit_2(capsys, argv, words):
    code = main(["check", str(T5), *argv])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and err.startswith("relgen: error: ") and err.count("\n") == 1
    assert all(word in err for word in words), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter only (no CUDA GPU)")
def test_bf16_in_the_interpreter_is_not_run(capsys):
    # its bf16 tl.dot is wrong: a comparison would report a failure of the interpreter, not of relgen
    code = main(["check", str(T5), "--dtype", "bf16", "--seq-len", "9"])
    out, err = capsys.readouterr()
    assert (code, err) == (2, "")
    assert out.startswith(f"NOT RUN  {T5}  t5  (cpu, bf16)")
    assert "NOT RUN N=9: " in out and "interpreter" in out
    assert "FAIL" not in out and "0/0 tensors passed, 1 lengths not run" in out


def test_not_run_exits_2_and_a_failure_exits_1(monkeypatch, capsys):
    real = runtime.compile_mechanism

    def fake(spec):
        if spec.name == "t5":
            raise NotImplementedError("t5: not supported\nhere")
        fn = real(spec)
        return lambda *args, **kwargs: fn(*args, **kwargs) * 1.5

    monkeypatch.setattr(runtime, "compile_mechanism", fake)
    assert main(["check", str(T5), "--seq-len", "2", "3"]) == 2
    out, _ = capsys.readouterr()
    assert out.startswith(f"NOT RUN  {T5}  t5") and "NOT RUN N=2, 3: t5: not supported here\n" in out
    decoder = ROOT / "specs" / "t5_decoder.yaml"
    assert main(["check", str(T5), str(decoder), "--seq-len", "2"]) == 1
    out, _ = capsys.readouterr()
    assert f"FAILED  {decoder}" in out


def test_compare_keeps_the_test_suites_api():
    spec = relgen.load_spec(T5)
    inputs = verify.make_inputs(spec, b=1, h=2, nq=5, d=16)
    results = verify.compare(spec, inputs)
    assert [name for name, _, _ in results] == ["out", "dq", "dk", "dv", "dbias"]
    verify.assert_all_close(results)
    with pytest.raises(AssertionError, match="ctx"):
        verify.assert_all_close([("out", False, "bad")], "ctx")


def test_format_table():
    def result(n, tensor, ok, err, zero=False):
        return verify.CheckResult("s", n, tensor, ok, err, zero, "", "float32", 16, "cpu")

    lines = verify.format_table(
        [result(1, "out", True, 0.0), result(1, "dq", True, 3e-8, zero=True), result(17, "out", False, 0.5)]
    )
    assert lines[0].split() == ["N", "out", "dq"]
    assert lines[1].split() == ["1", "ok", "0.00e+00", "ok", "|a|=3.0e-08"]
    assert lines[2].split() == ["17", "FAIL", "5.00e-01", "-"]
