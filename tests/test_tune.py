"""relgen.tiles.tuning lookup tables and relgen.cli.tune (`relgen tune`, `relgen warmup`), on the CPU.

The timing itself needs a GPU; here the tuner runs in Triton's interpreter with a fake timer, which exercises
everything else: the candidates, override_config, the sanity check, skipped candidates and the table file."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from pathlib import Path

import pytest
import torch
from tiers import SLOW

import relgen
from relgen.cli import tune
from relgen.cli.main import main
from relgen.tiles import tuning
from relgen.tiles.configs import AttnTiles, KernelConfig, ProjectTiles, ReduceTiles

ROOT = Path(__file__).resolve().parents[1]
T5 = ROOT / "specs" / "t5.yaml"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU: Triton's interpreter (conftest)

ENTRY = {
    "group": 128,
    "forward": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3},
    "backward": {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 2},
    "project": {"block_t": 128, "block_w": 64, "num_warps": 8, "num_stages": 2},
    "reduce": {"block_t": 64, "block_w": 64, "block_s": 32, "num_warps": 4, "num_stages": 2},
}
CONFIG = KernelConfig(
    group=128,
    forward=AttnTiles(64, 32, 4, 3),
    backward=AttnTiles(32, 64, 4, 2),
    project=ProjectTiles(128, 64, 8, 2),
    reduce=ReduceTiles(64, 64, 32, 4, 2),
)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """lookup() believes it runs on an sm90 GPU and reads its tables from tmp_path."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    tuning._table.cache_clear()
    tuning._capability.cache_clear()
    yield tmp_path
    tuning._table.cache_clear()
    tuning._capability.cache_clear()


def test_bucket_and_table_key():
    lengths = (1, 64, 65, 128, 129, 400, 1000, 8192, 100_000)
    assert [tuning.bucket(n) for n in lengths] == [64, 64, 128, 128, 384, 512, 1024, 8192, 8192]
    assert tuning.table_key("query+key", torch.float16, 64, 1000) == "query+key/fp16/d64/n1024"
    assert tuning.table_key("bias", torch.bfloat16, 128, 10) == "bias/bf16/d128/n64"


@pytest.mark.parametrize(
    "name, family",
    [("shaw", "query"), ("txl", "query@unsaturated"), ("deberta_v3", "query+key"), ("t5", "bias")],
)
def test_kernel_family_separates_saturating_maps_from_growing_ones(name, family):
    """Shaw and Transformer-XL share their terms but not their tiles: TXL's rows grow with N (no saturated tiles)."""
    plan = relgen.compile_mechanism(ROOT / "specs" / f"{name}.yaml").module.PLAN
    assert tuning.plan_family(plan) == family


def test_in_tile_variants_are_a_family_of_their_own(monkeypatch):
    """Ablation no_projections forms each band tile's products from Ã ([BM, BM + BN − 1] fp32 values): no tuned
    entry of the projected kernels applies, and the heuristic gives it 64-row forward tiles of 8 warps (with 4 its
    products spill)."""
    from relgen.tiles import configs

    mechanism = relgen.compile_mechanism(ROOT / "specs" / "shaw.yaml")
    variant = mechanism._ablated(mechanism.module, "no_projections", {})[0]
    assert tuning.plan_family(variant.PLAN) == "query@in_tile"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    forward = configs.default_config(torch.float16, 64, 8192, ("query",), in_tile=True).forward
    assert (forward.block_m, forward.num_warps) == (64, 8)
    assert configs.default_config(torch.float16, 64, 8192, ("query",)).forward.block_m == 128


def test_the_committed_table_gives_shaw_and_txl_their_own_entries():
    table = json.loads((tuning.TABLES / "sm90.json").read_text())
    for family in ("query", "query@unsaturated"):
        assert f"{family}/fp16/d64/n8192" in table


def test_lookup_reads_a_hand_written_table(fake_gpu):
    table = {"query/fp16/d64/n512": ENTRY, "_timings": {"query/fp16/d64/n512": {"forward_ms": {}}}}
    (fake_gpu / "sm90.json").write_text(json.dumps(table))
    assert tuning.lookup("query", torch.float16, 64, 400) == CONFIG
    assert tuning.lookup("query", torch.float16, 64, 600) is None  # bucket 768: no entry
    assert tuning.lookup("bias", torch.float16, 64, 400) is None
    assert tuning.lookup("query", torch.float32, 64, 400) is None


def test_lookup_without_a_gpu_or_a_table(fake_gpu, monkeypatch):
    assert tuning.lookup("query", torch.float16, 64, 400) is None  # no sm90.json
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tuning.lookup("query", torch.float16, 64, 400) is None


def test_write_entry_merges_and_lookup_reads_it(fake_gpu):
    path = fake_gpu / "sm90.json"
    path.write_text(json.dumps({"bias/fp16/d64/n64": ENTRY}))
    tuning.lookup("query", torch.float16, 64, 100)  # fills lookup's cache: write_entry must clear it
    tune.write_entry(path, "query/fp16/d64/n128", tune.config_entry(CONFIG), {"forward_ms": {"a": 1.0}})
    table = json.loads(path.read_text())
    assert set(table) == {"bias/fp16/d64/n64", "query/fp16/d64/n128", "_timings"}
    assert table["_timings"] == {"query/fp16/d64/n128": {"forward_ms": {"a": 1.0}}}
    assert tuning.lookup("query", torch.float16, 64, 100) == CONFIG
    assert tuning.lookup("bias", torch.float16, 64, 64) == CONFIG


def test_key_pass_tiles_round_trip_through_the_table():
    split = dataclasses.replace(CONFIG, backward_kv=AttnTiles(32, 64, 8, 2))
    assert split.key_pass == AttnTiles(32, 64, 8, 2) and CONFIG.key_pass == CONFIG.backward
    entry = tune.config_entry(split)
    assert entry["backward_kv"] == {
        "block_m": 32, "block_n": 64, "num_warps": 8, "num_stages": 2, "key_major": False, "group_split": 0
    }  # fmt: skip
    assert AttnTiles(**entry["backward_kv"]) == split.key_pass
    assert "backward_kv" not in tune.config_entry(CONFIG)
    assert "/ kv 32x64 w8 s2 |" in tune.backward_label(split)
    key_major = dataclasses.replace(CONFIG, backward_kv=AttnTiles(32, 64, 8, 2, key_major=True))
    assert tune.config_entry(key_major)["backward_kv"]["key_major"] is True
    assert "/ kv 32x64 w8 s2 key-major |" in tune.backward_label(key_major)


def test_candidates_fit_the_group():
    from relgen.tiles.configs import default_config

    base = default_config(torch.float16, 64, 1024)
    if base.group != tune.GROUP:  # the interpreter's configuration: tune with the group of the GPUs
        base = KernelConfig(
            tune.GROUP, AttnTiles(128, 64), AttnTiles(64, 64), ProjectTiles(64, 64), ReduceTiles(64, 64, 64)
        )
    stages = (
        tune.forward_candidates,
        tune.project_candidates,
        tune.backward_candidates,
        tune.key_pass_candidates,
        tune.query_pass_candidates,
        tune.reduce_candidates,
    )
    for stage in stages:
        candidates = stage(base)
        # the key pass tries both orientations of its tiles: at most 18 candidates there, 10 elsewhere
        assert candidates[0] == base and len(candidates) == len(set(candidates)) <= 18
        for cfg in candidates:
            cfg.check()
            assert cfg.group == 128


# -- the tuner in the interpreter, with a fake timer ---------------------------------------------------------------
@pytest.fixture
def small_tuner(monkeypatch):
    """The heuristic's tiles and one or two more per stage (forward 96 cannot run: it does not divide the
    group), tiny problems, a fake timer."""
    monkeypatch.setattr(tune, "FORWARD_TILES", ((64, 32, 4, 2), (96, 32, 4, 2)))
    monkeypatch.setattr(tune, "PROJECT_TILES", ((64, 64, 4, 2),))
    monkeypatch.setattr(tune, "BACKWARD_TILES", ((32, 64, 4, 2),))
    monkeypatch.setattr(tune, "REDUCE_TILES", ((64, 64, 32, 4, 2),))
    times = itertools.cycle([3.0, 1.0, 2.0])

    def timer(fn):
        fn()
        return next(times)

    factory = functools.partial(tune.Tuner, device=DEVICE, tokens=32, heads=2, timer=timer, log=lambda line: None)
    monkeypatch.setattr(tune, "Tuner", factory)
    monkeypatch.setattr(tune, "_require_cuda", lambda command, why: None)
    return factory


@SLOW
def test_tuner_picks_the_fastest_and_records_skips(small_tuner):
    tuner = small_tuner(torch.float32, 16)
    entry, timings = tuner.tune([relgen.load_spec(T5)], 24)
    forward, backward = timings["forward_ms"], timings["backward_ms"]
    assert any(isinstance(v, str) and "must divide the group" in v for v in forward.values())
    for record, chosen in ((forward, timings["chosen"]["forward"]), (backward, timings["chosen"]["backward"])):
        measured = {k: v for k, v in record.items() if isinstance(v, float)}
        assert chosen == min(measured, key=measured.get)
    assert entry["group"] == 128 and set(entry) - {"backward_kv"} == {
        "group",
        "forward",
        "backward",
        "project",
        "reduce",
    }
    assert any(" / kv " in label for label in backward)  # the key pass was tried on its own tiles
    assert timings["batch"] == 1 and timings["heads"] == 2 and timings["specs"] == ["t5"]


def test_tuner_budget(small_tuner):
    with pytest.raises(tune.OutOfBudget):
        small_tuner(torch.float32, 16, budget_s=0.0, started=0.0).tune([relgen.load_spec(T5)], 8)


@SLOW
def test_cli_tune_writes_and_resumes(small_tuner, tmp_path, capsys):
    out = tmp_path / "table.json"
    argv = ["tune", str(T5), "--out", str(out), "--seq-lens", "20", "--dtype", "fp32", "--head-dim", "16"]
    assert main(argv) == 0
    table = json.loads(out.read_text())
    assert set(table) == {"bias/fp32/d16/n64", "_timings"}
    assert "1 entry written" in capsys.readouterr().out
    assert main([*argv, "--resume"]) == 0
    assert "already tuned, skipped (--resume)" in capsys.readouterr().out


# -- on a machine without a GPU ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("command", "words"), [("tune", "timed on the GPU"), ("warmup", "compiles nothing")])
def test_needs_a_gpu(monkeypatch, capsys, tmp_path, command, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main([command, str(T5)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith(f"relgen: error: 'relgen {command}' needs a CUDA GPU") and words in err
    assert err.count("\n") == 1


def test_heuristic_halves_forward_rows_for_two_gathered_terms(monkeypatch):
    """query+key band tiles gather Z^Q and Z^K: the GPU heuristic gives them 64-row forward tiles (sm90.json's
    measurements), while one gathered term keeps 128 rows; the tiles still divide the group."""
    from relgen.tiles import configs

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    both = configs.default_config(torch.float16, 64, 1024, ("query", "key"))
    one = configs.default_config(torch.float16, 64, 1024, ("query",))
    assert (both.forward.block_m, one.forward.block_m) == (64, 128)
    assert both.backward == one.backward and both.project == one.project
    both.check()


def test_selection_is_shared_by_a_bucket_and_yields_to_an_override():
    from relgen.tiles import select

    plan = relgen.compile_mechanism(ROOT / "specs" / "deberta_v3.yaml").module.PLAN
    first = select.select_config(plan, torch.float16, 64, 600)
    assert select.select_config(plan, torch.float16, 64, 700) is first  # one bucket (768), one selection
    with select.override_config(CONFIG):
        assert select.select_config(plan, torch.float16, 64, 600) is CONFIG
    assert select.select_config(plan, torch.float16, 64, 600) is first


def test_configs_change_by_name_and_refuse_what_does_not_fit():
    """KernelConfig.with_changes (benchmarks' and compile checks' --tiles): each part's field by name, a change to
    the key pass starting from the query pass's tiles, and a clear error for a name, a value or a tile that the
    group does not take."""
    changed = CONFIG.with_changes(["forward.num_warps=8", "backward_kv.block_m=16"])
    assert changed.forward == dataclasses.replace(CONFIG.forward, num_warps=8)
    assert changed.backward == CONFIG.backward
    assert changed.key_pass == dataclasses.replace(CONFIG.backward, block_m=16)
    assert CONFIG.with_changes([]) is CONFIG
    for bad in ("forward.num_warp=8", "forward=8", "forward.block_m=x", "reduce.block_t"):
        with pytest.raises(ValueError, match=r"PART\.FIELD=N"):
            CONFIG.with_changes([bad])
    with pytest.raises(ValueError, match="divide the group"):
        CONFIG.with_changes(["forward.block_m=96"])


def test_changed_tiles_force_the_changed_selection_for_the_block_only():
    from relgen.tiles import select

    plan = relgen.compile_mechanism(ROOT / "specs" / "shaw.yaml").module.PLAN
    chosen = select.select_config(plan, torch.float16, 64, 1024)
    with select.changed_tiles(plan, torch.float16, 64, 1024, []):
        assert not select.overridden()
    with select.changed_tiles(plan, torch.float16, 64, 1024, ["forward.num_warps=8"]):
        assert select.select_config(plan, torch.float16, 64, 1024) == chosen.with_changes(["forward.num_warps=8"])
    assert select.select_config(plan, torch.float16, 64, 1024) is chosen
