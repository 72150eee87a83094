"""The benchmark's CPU-testable parts: FLOP credit, the peers' dense-bias builders against the oracle, the
decomposition's score_mod, the FP32 reference, the exactness check, the runner's crash/timeout handling, the
worker end to end on the CPU, and the report on synthetic records. A GPU smoke test runs the real thing."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiers import SLOW

import relgen
from relgen.bench import cli, common, oracle, peers, report, worker
from relgen.bench.common import FALLBACK_SPECS, SEQ_LENS, SYSTEMS, credited_flops

ROOT = Path(__file__).resolve().parents[1]

# small tables, so that N ≤ 33 reaches every map's saturated rows
SMALL_SPECS = {
    "shaw_small": {"name": "shaw_small", "terms": ["query"], "map": {"kind": "clipped", "min": -4, "max": 4}},
    "relative_key_shared": {
        "name": "relative_key_shared",
        "terms": ["query"],
        "map": {"kind": "clipped", "min": -6, "max": 2, "offset": "key_minus_query"},
        "heads_share_tables": True,
    },
    "deberta_small": {
        "name": "deberta_small",
        "terms": ["query", "key"],
        "map": {"kind": "log", "position_buckets": 8, "max_position": 16},
        "scale": "1/sqrt(3*d)",
    },
    "t5_small": {"name": "t5_small", "terms": ["bias"], "map": {"kind": "t5", "num_buckets": 8, "max_distance": 16}},
    "all_terms": {
        "name": "all_terms",
        "terms": ["query", "key", "bias"],
        "map": {"kind": "clipped", "min": -3, "max": 5},
        "scale": 0.3,
    },
}


def shipped(name: str) -> relgen.MechanismSpec:
    return common.resolve_spec(name)[0]


ALL_SPECS = {name: shipped(name) for name in FALLBACK_SPECS} | {
    name: relgen.load_spec(d) for name, d in SMALL_SPECS.items()
}


def problem(spec, n, batch=2, heads=3, d=8, dtype=torch.float64, seed=0, grad=True):
    p = peers.make_problem(spec, n, batch, heads, d, dtype, "cpu", seed)
    if not grad:
        p = dataclasses.replace(
            p,
            **{
                f: getattr(p, f).detach() if getattr(p, f) is not None else None
                for f in ("q", "k", "v", "aq", "ak", "bias")
            },
        )
    return p


def brute_relative(p) -> torch.Tensor:
    """q_i·a^Q_φ + k_j·a^K_φ + b_φ pair by pair, with φ from the spec's map (no index tensors, no projections)."""
    spec, n = p.spec, p.seq_len
    rel = torch.zeros(p.batch, p.heads, n, n, dtype=torch.float64)
    with torch.no_grad():
        for i in range(n):
            for j in range(n):
                r = int(spec.map.row_ids(np.array([i - j]), n)[0])
                for h in range(p.heads):
                    if p.aq is not None:
                        a = p.aq[r] if spec.heads_share_tables else p.aq[h, r]
                        rel[:, h, i, j] += p.q[:, h, i] @ a.double()
                    if p.ak is not None:
                        a = p.ak[r] if spec.heads_share_tables else p.ak[h, r]
                        rel[:, h, i, j] += p.k[:, h, j] @ a.double()
                    if p.bias is not None:
                        rel[:, h, i, j] += p.bias[r] if spec.heads_share_tables else p.bias[h, r]
    return rel


# -- FLOP credit ------------------------------------------------------------------------------------------------
def test_flops_shaw_8k():
    b, h, n, d = 2, 12, 8192, 64
    fwd = 4 * b * h * n * n * d + 2 * b * h * n * 513 * d
    assert credited_flops(shipped("shaw"), n, b, h, d, "fwd") == fwd
    assert credited_flops(shipped("shaw"), n, b, h, d, "bwd") == 2 * fwd


@pytest.mark.parametrize(
    ("name", "rows", "projections"),
    [("txl", lambda n: 2 * n - 1, 1), ("deberta_v3", lambda n: 512, 2), ("t5", lambda n: 0, 0)],
)
def test_flops_per_mechanism(name, rows, projections):
    h, d = 12, 64
    for n in SEQ_LENS:
        b = common.batch_for(n)
        assert b * n == 16384
        expected = 4 * b * h * n * n * d + 2 * b * h * n * rows(n) * d * projections
        assert credited_flops(shipped(name), n, b, h, d, "fwd") == expected
        assert credited_flops(shipped(name), n, b, h, d, "bwd") == 2 * expected


def test_batch_for_rejects_uneven_budget():
    with pytest.raises(ValueError):
        common.batch_for(3000)


# -- dense-bias builders and eager peers ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ALL_SPECS))
@pytest.mark.parametrize("n", [8, 21])
def test_dense_relative_matches_pairwise_definition(name, n):
    p = problem(ALL_SPECS[name], n)
    index = peers.dense_index(p.spec, p.offset_rows, p.seq_len)
    with torch.no_grad():
        dense = peers.dense_relative(p.q, p.k, p.aq, p.ak, p.bias, index)
    torch.testing.assert_close(dense.expand(p.batch, p.heads, -1, -1), brute_relative(p), rtol=1e-12, atol=1e-12)


def test_rel_shift_equals_gather_on_identity_map():
    p = problem(shipped("txl"), 17)
    index = peers.dense_index(p.spec, p.offset_rows, p.seq_len)
    assert index.shift_order is not None
    with torch.no_grad():
        shifted = peers.query_term_rel_shift(p.q, p.aq, index.shift_order)
        gathered = peers.query_term_gather(p.q, p.aq, index.pairs)
    torch.testing.assert_close(shifted, gathered, rtol=0, atol=1e-13)


def reference_of(p, inputs):
    from relgen.reference import attention

    return attention(p.spec, *(inputs.get(k) for k in ("q", "k", "v", "aq", "ak", "bias")))


@pytest.mark.parametrize("name", list(ALL_SPECS))
@pytest.mark.parametrize("n", [8, 33])
@pytest.mark.parametrize("system", ["eager", "sdpa"])
def test_eager_peers_match_relgen_reference(name, n, system):
    """Outputs and every gradient of the eager peers (float64, CPU) equal relgen's FP64 oracle."""
    p = problem(ALL_SPECS[name], n)
    built = peers.build_system(system, p, compile_mode="none")
    out = built.forward()
    grads = torch.autograd.grad(out, [t for _, t in built.inputs], p.d_out)
    inputs = {nm: t.detach().clone().requires_grad_() for nm, t in built.inputs}
    ref = reference_of(p, inputs)
    ref_grads = torch.autograd.grad(ref, list(inputs.values()), p.d_out)
    # HF T5 takes its softmax in FP32 even for float64 inputs, and so does the eager T5 peer
    tol = 1e-5 if system == "eager" and p.spec.map.kind == "t5" else 1e-9
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for (nm, _), g, rg in zip(built.inputs, grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=tol, atol=tol, msg=lambda m, nm=nm: f"{nm}: {m}")


def test_plain_sdpa_drops_relative_terms():
    p = problem(shipped("deberta_v3"), 9)
    built = peers.build_system("sdpa_plain", p, compile_mode="none")
    assert [n for n, _ in built.inputs] == ["q", "k", "v"] and not built.relative
    ref = oracle.reference(p, relative=False, with_grad=False, dtype=torch.float64)
    torch.testing.assert_close(built.forward().detach(), ref["out"], rtol=1e-10, atol=1e-10)


# -- FlexAttention: score_mods evaluated eagerly ------------------------------------------------------------------
def _grid(b, h, n):
    return (
        torch.arange(b)[:, None, None, None],
        torch.arange(h)[None, :, None, None],
        torch.arange(n)[None, None, :, None],
        torch.arange(n)[None, None, None, :],
    )


@pytest.mark.parametrize("name", list(ALL_SPECS))
def test_decomposition_score_mod_equals_dense_bias(name):
    p = problem(ALL_SPECS[name], 21, grad=False)
    zq = p.q @ p.aq.transpose(-1, -2) if p.aq is not None else None
    zk = p.k @ p.ak.transpose(-1, -2) if p.ak is not None else None
    score_mod = peers.decomposition_score_mod(zq, zk, p.bias, p.offset_rows.to(torch.int32), p.seq_len, p.tau)
    got = score_mod(torch.zeros(p.batch, p.heads, 21, 21, dtype=torch.float64), *_grid(p.batch, p.heads, 21))
    expected = p.tau * brute_relative(p)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # the row lookup covers exactly the offsets −(N−1) … N−1
    assert p.offset_rows.shape == (2 * 21 - 1,)


@pytest.mark.parametrize("name", ["t5", "deberta_small"])
def test_dense_score_mod_broadcasts(name):
    p = problem(ALL_SPECS[name], 10, grad=False)
    dense = p.tau * peers.dense_relative(p.q, p.k, p.aq, p.ak, p.bias, peers.dense_index(p.spec, p.offset_rows, 10))
    got = peers.dense_score_mod(dense)(torch.zeros(p.batch, p.heads, 10, 10, dtype=torch.float64), *_grid(2, 3, 10))
    torch.testing.assert_close(got, dense.expand(2, 3, 10, 10))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("system", ["flex", "flex_decomp"])
def test_flex_peers_forward_uncompiled(system):
    """Eager (unfused) FlexAttention runs on the CPU without autograd: both flex peers give the oracle's O."""
    p = problem(ALL_SPECS["all_terms"], 12, grad=False)
    out = peers.build_system(system, p, compile_mode="none").forward()
    ref = oracle.reference(p, with_grad=False, dtype=torch.float64)["out"]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


# -- the FP32 reference ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["shaw_small", "relative_key_shared", "deberta_small", "t5_small", "all_terms", "txl"])
def test_oracle_blocks_match_relgen_reference(name):
    p = problem(ALL_SPECS[name], 19)
    ours = oracle.reference(p, dtype=torch.float64, budget_bytes=1)  # one query per block
    assert oracle.block_size(p, 1, True) == 1
    inputs = {nm: t.detach().clone().requires_grad_() for nm, t in p.inputs()}
    ref = reference_of(p, inputs)
    grads = dict(zip(inputs, torch.autograd.grad(ref, list(inputs.values()), p.d_out), strict=True))
    torch.testing.assert_close(ours["out"], ref.detach(), rtol=1e-10, atol=1e-10)
    for nm, g in grads.items():
        torch.testing.assert_close(ours[nm], g, rtol=1e-9, atol=1e-9)
    fwd_only = oracle.reference(p, with_grad=False, dtype=torch.float64)
    assert set(fwd_only) == {"out"}
    torch.testing.assert_close(fwd_only["out"], ours["out"])


# -- the exactness check ------------------------------------------------------------------------------------------
def test_check_close_verdicts():
    """The bench judges with relgen.testing's criterion (one implementation), on the device or on the CPU."""
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(4, 64, 32, generator=gen, dtype=torch.float64)
    cases = {
        "rounded": expected.half(),
        "small noise": expected + 1e-3 * torch.randn(expected.shape, generator=gen, dtype=torch.float64),
        "large noise": expected + 0.2 * torch.randn(expected.shape, generator=gen, dtype=torch.float64),
        "one outlier": expected.clone().index_put_((torch.tensor([0]),) * 3, torch.tensor([9.0], dtype=torch.float64)),
        "nan": expected.clone().index_put_((torch.tensor([1]),) * 3, torch.tensor([float("nan")], dtype=torch.float64)),
    }
    verdicts = {  # (fp16, bf16, fp32)
        "rounded": (True, True, False),
        "small noise": (True, True, False),
        "large noise": (False, False, False),
        "one outlier": (False, False, False),
        "nan": (False, False, False),
    }
    for label, actual in cases.items():
        for dtype, want in zip((torch.float16, torch.bfloat16, torch.float32), verdicts[label], strict=True):
            for on_device in (True, False):
                assert common.check_close(actual, expected, dtype, on_device=on_device)[0] == want, (label, dtype)


def test_worker_check_marks_failures():
    expected = {"out": torch.ones(3, 3), "q": torch.ones(3, 3)}
    ok, details = worker.check({"out": torch.ones(3, 3), "q": 2 * torch.ones(3, 3)}, expected, torch.float16)
    assert not ok and details["out"].startswith("ok") and details["q"].startswith("FAILED")


# -- the worker, end to end on the CPU ------------------------------------------------------------------------------
def _cfg(mechanism="deberta_small", n=16, measurements=(), **extra):
    spec = ALL_SPECS[mechanism]
    cfg = {
        "mechanism": mechanism,
        "spec": spec.model_dump(mode="json"),
        "spec_source": "test",
        "seq_len": n,
        "batch": 2,
        "heads": 2,
        "head_dim": 16,
        "dtype": "fp32",
        "seed": 3,
        "order_seed": 1,
        "compile_mode": "none",
        "process_per": "group",
        "warmup_ms": 1,
        "rep_ms": 1,
        "min_reps": 2,
        "warmup_calls": 1,
        "check": True,
        "device": "cpu",
        "measurements": [dict(m, order=i) for i, m in enumerate(measurements)],
    }
    cfg.update(extra)
    return cfg


@SLOW
def test_worker_runs_systems_and_checks_them(capsys):
    measurements = [{"system": s, "pass": p, "variant": None} for s in ("eager", "sdpa_plain") for p in ("fwd", "bwd")]
    records = worker.run(_cfg(measurements=measurements))
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(common.RECORD_MARK) for line in lines) == 4
    assert sum(line.startswith(common.START_MARK) for line in lines) == 4
    assert [k for k in worker._HELD if k != "keep"] == []  # fwd → bwd reused the built system, then let it go
    for r in records:
        assert r["status"] == "ok", r
        assert r["exact"] is True, r["check"]
        assert r["ms"] > 0 and r["tflops"] > 0 and r["flops"] > 0
        assert r["relative_terms"] is (r["system"] != "sdpa_plain")
        names = set(r["check"])
        if r["pass"] == "bwd":
            assert names == ({"out", "q", "k", "v"} | ({"aq", "ak"} if r["relative_terms"] else set()))
        else:
            assert names == {"out"}
        for field in ("mechanism", "system", "seq_len", "pass", "batch", "heads", "head_dim", "dtype", "torch"):
            assert r[field] is not None


@SLOW
def test_worker_records_unsupported_and_errors(monkeypatch):
    records = worker.run(
        _cfg(
            measurements=[
                {"system": "relgen", "pass": "bwd", "variant": "atomic_gradients"},
                {"system": "flex", "pass": "bwd", "variant": None},  # FlexAttention has no CPU backward
            ]
        )
    )
    if not hasattr(relgen.runtime.mechanism, "ABLATIONS"):
        assert records[0]["status"] == "unsupported" and "atomic_gradients" in records[0]["error"]
    assert records[1]["status"] in ("unsupported", "error") and records[1]["ms"] is None
    assert records[1]["exact"] is None


def test_relgen_variant_hook():
    with pytest.raises(ValueError):
        peers.relgen_variant("no_such_component")
    if not hasattr(relgen.runtime.mechanism, "ABLATIONS"):
        with pytest.raises(NotImplementedError, match="relgen_variant"):
            peers.relgen_variant("no_projections")


# -- the parent: plan, crash and timeout handling, merging -------------------------------------------------------
FAKE_WORKER = r"""
import json, sys, time
cfg = json.loads(sys.stdin.read())
for m in cfg["measurements"]:
    print("RELGEN_BENCH_START " + json.dumps({k: m.get(k) for k in ("system", "pass", "variant")}), flush=True)
    if m["system"] == "flex":  # never built
        time.sleep(30)
    if m["system"] == "compiled":  # built, then the timing never ends
        print("RELGEN_BENCH_BUILT " + json.dumps({"warmup_s": 0.1}), flush=True)
        time.sleep(30)
    if m["system"] == "sdpa":
        print("boom", file=sys.stderr, flush=True)
        sys.exit(3)
    print("noise on stdout", flush=True)
    print("RELGEN_BENCH_RECORD " + json.dumps({"mechanism": cfg["mechanism"], "seq_len": cfg["seq_len"],
          "status": "ok", "ms": 1.0, **{k: m.get(k) for k in ("system", "pass", "variant")}}), flush=True)
"""


@SLOW
def test_run_group_survives_crash_and_timeout(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    measurements = [
        {"system": s, "pass": "fwd", "variant": None, "order": i}
        for i, s in enumerate(["eager", "flex", "sdpa", "compiled", "relgen"])
    ]
    cfg = _cfg("shaw_small", measurements=measurements)
    cfg["measurements"] = measurements
    log = tmp_path / "logs" / "w.log"
    records = list(cli.run_group(cfg, 1.0, log, command=lambda: [sys.executable, str(script)]))
    status = {r["system"]: r["status"] for r in records}
    assert status == {"eager": "ok", "flex": "timeout", "sdpa": "error", "compiled": "timeout", "relgen": "ok"}
    phase = {r["system"]: r.get("phase") for r in records if r["status"] == "timeout"}
    assert phase == {"flex": "build", "compiled": "timing"}
    assert "while building" in next(r for r in records if r["system"] == "flex")["error"]
    crashed = next(r for r in records if r["system"] == "sdpa")
    assert "code 3" in crashed["error"] and "boom" in crashed["error"]
    assert crashed["flops"] > 0 and crashed["batch"] == 2  # failure records carry the full set of fields
    assert "noise on stdout" in log.read_text()


@SLOW
def test_run_group_stops_at_the_budget(tmp_path):
    """At --budget-s the worker in flight is ended and nothing is recorded for what it had not finished."""
    import time

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    measurements = [{"system": s, "pass": "fwd", "variant": None} for s in ["eager", "flex", "relgen"]]
    cfg = _cfg("shaw_small", measurements=measurements)
    stop_at = time.monotonic() + 1.0
    records = list(
        cli.run_group(cfg, 60.0, tmp_path / "w.log", command=lambda: [sys.executable, str(script)], stop_at=stop_at)
    )
    assert [r["system"] for r in records] == ["eager"]
    assert time.monotonic() - stop_at < 5


def test_plan_shuffles_systems_reproducibly():
    args = cli.parser().parse_args(["--quick", "--mechanisms", "shaw,t5"])
    a, b, c = cli.plan(args, 1), cli.plan(args, 1), cli.plan(args, 2)
    assert [g["seq_len"] for g in a] == [512, 8192, 512, 8192]
    assert [g["batch"] for g in a] == [32, 2, 32, 2]
    order = [[(m["system"], m["pass"]) for m in g["measurements"]] for g in a]
    assert order == [[(m["system"], m["pass"]) for m in g["measurements"]] for g in b]
    assert order != [[(m["system"], m["pass"]) for m in g["measurements"]] for g in c]
    assert all(len(o) == 2 * len(SYSTEMS) for o in order)
    for g in a:  # each system's fwd comes right before its bwd
        ms = g["measurements"]
        assert all(ms[i]["system"] == ms[i + 1]["system"] for i in range(0, len(ms), 2))


def test_plan_ablation_runs_relgen_variants_only():
    args = cli.parser().parse_args(["--ablation", "atomic_gradients", "no_projections", "--seq-lens", "1k"])
    groups = cli.plan(args, 0)
    assert len(groups) == 4 and groups[0]["seq_len"] == 1024
    names = {(m["system"], m["variant"], m["pass"]) for m in groups[0]["measurements"]}
    assert names == {
        ("relgen", None, "fwd"),
        ("relgen", None, "bwd"),
        ("relgen", "atomic_gradients", "bwd"),  # atomic-free gradients only change the backward
        ("relgen", "no_projections", "fwd"),
        ("relgen", "no_projections", "bwd"),
    }
    assert cli.results_name(args) == "ablation"


def test_cli_dry_run_and_bad_arguments(capsys):
    assert cli.main(["--dry-run", "--quick", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("N=512") == 4 and out.count("N=8192") == 4 and "relgen:fwd" in out
    assert cli.main(["--systems", "relgen,nope"]) == 2
    assert cli.main(["--passes", "sideways"]) == 2
    assert cli.main(["--mechanisms", "no_such_mechanism", "--dry-run"]) == 2


def test_merge_and_resume_keys(tmp_path):
    path = tmp_path / "attention.json"
    base = {"mechanism": "t5", "system": "relgen", "variant": None, "seq_len": 128, "pass": "fwd", "dtype": "fp16"}
    base |= {"batch": 128, "heads": 12, "head_dim": 64}
    common.write_records(path, [dict(base, status="timeout"), dict(base, system="eager", status="ok")])
    merged = common.merge_records(common.load_records(path), [dict(base, status="ok", ms=1.0)])
    assert len(merged) == 2 and merged[0]["status"] == "ok" and merged[0]["ms"] == 1.0
    assert json.loads(path.read_text())[0]["status"] == "timeout"


def test_resume_keeps_timeouts_only_under_an_equal_or_longer_limit():
    timed_out = {"status": "timeout", "timeout_s": 40.0}
    assert cli.settled({"status": "ok"}, 300.0) and cli.settled({"status": "oom"}, 300.0)
    assert not cli.settled({"status": "error"}, 40.0)
    assert cli.settled(timed_out, 40.0) and cli.settled(timed_out, 30.0)
    assert not cli.settled(timed_out, 60.0)  # a longer limit may let it finish: measure again
    assert not cli.settled({"status": "timeout"}, 40.0)  # records from before the limit was kept
    assert not cli.settled(dict(timed_out, phase="build"), 30.0)  # warmer compile caches may get it to the timing
    assert cli.settled(dict(timed_out, phase="timing"), 40.0)


def test_merge_keeps_a_measurement_over_a_later_timeout_while_building():
    key = {"mechanism": "t5", "system": "flex_decomp", "variant": None, "seq_len": 2048, "pass": "bwd"}
    measured = dict(key, status="ok", ms=353.1, compile_mode="default", timestamp="2026-11-29T14:00:00")
    building = dict(key, status="timeout", phase="build", compile_mode="max-autotune", timestamp="2026-11-29T21:00:00")
    timing = dict(building, phase="timing")
    assert common.newest_records([measured], [building]) == [measured]
    assert common.newest_records([building], [measured]) == [measured]
    assert common.newest_records([measured], [timing]) == [timing]  # it ran, and ran too long: that is a result
    later = dict(building, timestamp="2026-11-29T22:00:00")
    assert common.newest_records([building], [later]) == [later]


def test_report_marks_compiled_peers_outside_the_protocols_mode():
    ok = {"status": "ok", "ms": 1.0, "relative_terms": True, "exact": True}
    assert report._cell(dict(ok, compile_mode="default"), "ms", None, str).endswith("°")
    assert not report._cell(dict(ok, compile_mode="max-autotune"), "ms", None, str).endswith("°")
    assert not report._cell(dict(ok, compile_mode=None), "ms", None, str).endswith("°")  # not a compiled system
    assert report._cell({"status": "timeout", "compile_mode": "default"}, "ms", None, str) == "t/o°"


def test_resume_measures_compiled_peers_again_under_another_compile_mode():
    default_mode = {"status": "ok", "compile_mode": "default"}
    assert not cli.settled(default_mode, 40.0, "max-autotune")
    assert cli.settled(default_mode, 40.0, "default") and cli.settled(default_mode, 40.0)
    assert cli.settled({"status": "ok", "compile_mode": None}, 40.0, "max-autotune")  # not a compiled system


# -- the report -------------------------------------------------------------------------------------------------
def synthetic_records() -> list[dict]:
    rng = np.random.default_rng(0)
    records = []
    for mechanism in common.MECHANISMS:
        spec = shipped(mechanism)
        for n in SEQ_LENS:
            b = common.batch_for(n)
            for system, meta in SYSTEMS.items():
                for pass_ in common.PASSES:
                    r = {
                        "mechanism": mechanism,
                        "system": system,
                        "variant": None,
                        "seq_len": n,
                        "pass": pass_,
                        "batch": b,
                        "heads": 12,
                        "head_dim": 64,
                        "dtype": "fp16",
                        "relative_terms": meta["relative"],
                        "rows": spec.map.num_rows(n),
                        "flops": credited_flops(spec, n, b, 12, 64, pass_),
                        "gpu": "NVIDIA H200",
                        "torch": "2.11.0",
                        "triton": "3.6.0",
                        "cuda": "13.0",
                        "process_per": "measurement",
                        "compile_mode": "max-autotune" if meta["compiled"] else None,
                        "timestamp": "2026-11-29T10:00:00+0000",
                        "gpu_state": {"sm_mhz": 1980, "mem_mhz": 3201, "power_w": 500.0, "temp_c": 60},
                        "status": "ok",
                        "exact": True,
                        "check": {"out": "ok: fine"},
                        "error": None,
                    }
                    speed = 200.0 if system == "relgen" else float(rng.uniform(5, 150))
                    r["tflops"] = speed
                    r["ms"] = r["flops"] / (speed * 1e12) * 1e3
                    r["peak_mib"] = float(rng.uniform(20, 20000))
                    if system == "sdpa" and n == 8192:
                        r.update(
                            status="oom", tflops=None, ms=None, peak_mib=None, exact=None, error="CUDA out of memory"
                        )
                    if system == "eager" and mechanism == "deberta_v3" and pass_ == "bwd" and n >= 4096:
                        r.update(exact=False, check={"out": "ok: fine", "ak": "FAILED: rel l2 = 2e-2"})
                    if system == "flex" and mechanism == "t5" and n == 128:
                        r.update(status="error", tflops=None, ms=None, peak_mib=None, exact=None, error="boom | bad")
                    records.append(r)
    return records


def test_report_from_synthetic_records(tmp_path):
    records = synthetic_records()
    common.write_records(tmp_path / "attention.json", records)
    written = report.write_reports(tmp_path)
    names = {p.name for p in written}
    assert "attention.md" in names
    md = (tmp_path / "attention.md").read_text()
    for mechanism in common.MECHANISMS:
        assert f"### {mechanism}" in md
    assert "| System | F 128 | F 256 | F 512 | F 1K | F 2K | F 4K | F 8K | B 128 |" in md
    assert "**200**" in md  # relgen is the fastest everywhere
    assert "oom" in md and "err" in md and "†" in md
    assert "### txl (R=255 at 128 … 16383 at 8K)" in md  # TXL's rows grow with N
    assert "NVIDIA H200" in md and "SM clock 1980–1980 MHz" in md
    assert "relgen vs. fastest exact peer" in md
    assert "boom / bad" in md  # pipes in messages cannot break the table
    relgen_row = next(line for line in md.splitlines() if line.startswith("| relgen (ours) |"))
    assert relgen_row.count("|") == 16
    pytest.importorskip("matplotlib")
    for png in ("throughput.png", "memory.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_targets_section_judges_the_records():
    records = synthetic_records()
    md = report.markdown(records)
    assert "## Targets (the paper's kernels on an H200, fp16, N = 8K)" in md
    # synthetic relgen runs at 200 TFLOP/s everywhere: below Shaw's 279 forward, above its 166 backward
    shaw = next(line for line in md.splitlines() if line.startswith("| shaw | "))
    assert shaw.startswith("| shaw | 200 (279) ✗ | 200 (166) ✓ |")
    assert "- shaw: ✓" in md  # fastest at every length (peers are drawn below 150)
    slow = [r for r in records if not (r["system"] == "relgen" and r["mechanism"] == "t5" and r["seq_len"] == 1024)]
    slow += [
        dict(r, tflops=1.0, ms=r["ms"] * 200)
        for r in records
        if r["system"] == "relgen" and r["mechanism"] == "t5" and r["seq_len"] == 1024
    ]
    t5 = next(line for line in report.markdown(slow).splitlines() if line.startswith("- t5: "))
    assert t5.startswith("- t5: ✗ — behind at fwd 1K (") and "behind at bwd 1K" in t5
    assert report._meets_mib(222.9, 222) and not report._meets_mib(223.0, 222)
    assert report._meets_mib(24.75, 24) and not report._meets_mib(25.5, 24)
    assert report._meets_mib(3194.0, 3.1 * 1024) and not report._meets_mib(3290.2, 3.1 * 1024)


def test_report_formatting():
    assert [report.fmt_tflops(x) for x in (279.4, 44.2, 7.14, 0.744, 0.0351)] == ["279", "44", "7.1", "0.74", "0.035"]
    assert [report.fmt_mib(x) for x in (222.0, 1228.8, 14336.0)] == ["222", "1.2K", "14K"]
    assert [report.fmt_n(n) for n in (128, 1024, 8192)] == ["128", "1K", "8K"]
    # a tie at three digits is printed apart (a measured T5 forward at 512 on the H200)
    assert report.fmt_apart(0.16287999, 0.16307200) == ("0.1629", "0.1631")
    assert report.fmt_apart(0.2, 0.35) == ("0.2", "0.35")
    assert report.fmt_apart(1.0, 1.0) == ("1", "1")


def test_ablation_report(tmp_path):
    records = []
    for mechanism, variant, ms, mib, status in [
        ("shaw", None, 1.0, 100.0, "ok"),
        ("shaw", "no_projections", 2.5, 30.0, "ok"),
        ("shaw", "atomic_gradients", None, None, "unsupported"),
        ("t5", "no_projections", 9.0, 9.0, "ok"),  # full relgen not measured: no ratio, not listed
    ]:
        for pass_ in ("fwd", "bwd"):
            records.append(
                {"mechanism": mechanism, "system": "relgen", "variant": variant, "seq_len": 1024, "pass": pass_}
                | {"status": status, "ms": ms, "peak_mib": mib, "batch": 16, "dtype": "fp16"}
            )
    common.write_records(tmp_path / "ablation.json", records)
    assert [p.name for p in report.write_reports(tmp_path)] == ["ablation.md"]
    md = (tmp_path / "ablation.md").read_text()
    assert "| no_projections | 2.5 | 2.5 | 0.3 | 0.3 | shaw |" in md
    assert "| atomic_gradients | unsupported | unsupported | unsupported | unsupported | – |" in md
    assert "| shaw | 1K | no_projections | fwd | 2.5 | 1 | 2.50× | 30 | 100 |" in md
    assert "| t5 |" not in md


def test_report_only_cli(tmp_path, capsys):
    common.write_records(tmp_path / "attention.json", synthetic_records()[:20])
    assert cli.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "attention.md" in capsys.readouterr().out
    assert cli.main(["--report-only", "--out", str(tmp_path / "empty")]) == 1


def test_merge_cli_keeps_each_measurements_newest_record(tmp_path, capsys):
    """Two GPUs resume one state in parallel, each re-measuring its own mechanisms: the union keeps the fresh
    records whatever order the files come in, and the report is rewritten."""
    base = {"mechanism": "t5", "system": "relgen", "variant": None, "seq_len": 128, "pass": "fwd", "dtype": "fp16"}
    base |= {"batch": 128, "heads": 12, "head_dim": 64, "status": "ok", "ms": 1.0, "tflops": 1.0, "peak_mib": 1.0}
    old_t5, old_txl = (
        dict(base, timestamp="2026-11-29T10:00:00+0000"),
        dict(base, mechanism="txl", timestamp="2026-11-29T10:00:00+0000"),
    )
    new_t5 = dict(old_t5, ms=0.5, timestamp="2026-11-29T12:00:00+0000")
    new_txl = dict(old_txl, ms=0.25, timestamp="2026-11-29T12:00:01+0000")
    common.write_records(tmp_path / "attention.json", [old_t5, old_txl])
    common.write_records(tmp_path / "gpu0.json", [new_t5, old_txl])
    common.write_records(tmp_path / "gpu1.json", [old_t5, new_txl])
    assert cli.main(["--merge", str(tmp_path / "gpu0.json"), str(tmp_path / "gpu1.json"), "--out", str(tmp_path)]) == 0
    merged = {r["mechanism"]: r["ms"] for r in common.load_records(tmp_path / "attention.json")}
    assert merged == {"t5": 0.5, "txl": 0.25}
    assert "attention.md" in capsys.readouterr().out
    assert cli.main(["--merge", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2


# -- on a GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_smoke_all_systems(tmp_path):
    """Every system on the real device at a small size (default compile mode, to keep it short)."""
    args = [
        "--mechanisms", "deberta_v3", "--seq-lens", "128", "--tokens", "256", "--out", str(tmp_path),
        "--flex-mode", "default", "--process-per", "group", "--warmup-ms", "5", "--rep-ms", "10", "--seed", "0",
    ]  # fmt: skip
    assert cli.main(args) == 0
    records = common.load_records(tmp_path / "attention.json")
    assert len(records) == 2 * len(SYSTEMS)
    for r in records:
        assert r["status"] == "ok", r
        assert r["peak_mib"] is not None and r["gpu"]
        if r["system"] == "relgen":
            assert r["exact"] is True, r["check"]
    assert (tmp_path / "attention.md").exists()


def test_targets_say_when_relgen_and_its_peers_were_not_measured_together():
    def stamped(record, hour):
        return dict(record, timestamp=f"2026-11-29T{hour:02d}:00:00+0000")

    records = synthetic_records()
    together = [stamped(r, 10) for r in records]
    assert "Not side by side" not in report.markdown(together)
    apart = [stamped(r, 16 if r["system"] == "relgen" else 11) for r in records]
    assert "Not side by side: at N = 8K relgen was measured 2026-11-29 16:00–16:00 UTC" in report.markdown(apart)
    # the N ≥ 512 comparison says per length how many peer records were measured apart from relgen's
    peers_at = {n: sum(r["system"] != "relgen" and r["seq_len"] == n for r in records) for n in (512, 8192)}
    assert f"N = 512 {peers_at[512]} of {peers_at[512]}, " in report.markdown(apart)
    assert f"8K {peers_at[8192]} of {peers_at[8192]}." in report.markdown(apart)
    # one peer record from an earlier run among side-by-side ones is named
    old = next(r for r in records if r["system"] != "relgen" and r["seq_len"] == 8192)
    mixed = [stamped(r, 11 if r is old else 16) for r in records]
    text = report.markdown(mixed)
    assert "1 peer record(s) come from another run, 2026-11-29 11:00–11:00 UTC" in text
    assert f"N = 8K 1 of {peers_at[8192]}." in text
    assert f"{old['mechanism']} {old['system']} {old['pass']}." in text


def test_host_time_per_call_queues_a_bounded_amount_of_work():
    calls = []
    for estimate_ms, expected in ((0.1, 50), (1.0, 20), (100.0, 1)):
        calls.clear()
        ms = worker.host_ms(lambda: calls.append(1), torch.device("cpu"), worker.queued_calls(estimate_ms))
        assert len(calls) == expected and ms >= 0.0


def test_report_names_the_host_bound_readings():
    records = synthetic_records()
    assert "Host-bound readings" not in report.markdown(records)  # records without host_ms say nothing
    for r in records:
        if r["status"] == "ok":
            r["host_ms"] = 0.01 * r["ms"]
    marked = {
        ("t5", "relgen", 128, "fwd"): 1.2,
        ("t5", "flex_decomp", 512, "fwd"): 0.95,
        ("t5", "relgen", 256, "fwd"): 0.9,
    }
    for r in records:
        factor = marked.get((r["mechanism"], r["system"], r["seq_len"], r["pass"]))
        if factor:
            r["host_ms"] = factor * r["ms"]
    md = report.markdown(records)
    lines = [line for line in md.splitlines() if line.startswith("Host-bound readings")]
    assert len(lines) == 1 and md.index(lines[0]) > md.index("### t5")
    assert lines[0].endswith("relgen (ours) fwd 128, 256; FlexAttention + decomp. fwd 512.")
