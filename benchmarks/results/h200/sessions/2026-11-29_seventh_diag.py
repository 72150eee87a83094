"""GPU diagnosis of test_half_precision_small[txl-1-dtype0]: the comparison under each tile source, repeated."""

import json
from pathlib import Path

import torch

import relgen
from relgen import tuning
from relgen.config import AttnTiles, KernelConfig, ProjectTiles, ReduceTiles, default_config, override_config
from relgen.verify import compare, make_inputs


def from_entry(e):
    return KernelConfig(
        group=e["group"],
        forward=AttnTiles(**e["forward"]),
        backward=AttnTiles(**e["backward"]),
        project=ProjectTiles(**e["project"]),
        reduce=ReduceTiles(**e["reduce"]),
        backward_kv=AttnTiles(**e["backward_kv"]) if e.get("backward_kv") else None,
    )


old = json.loads(Path(".bench_state/sm90_7784871.json").read_text())
for name, n in [("txl", 1), ("txl", 17), ("shaw", 1), ("deberta_v3", 1)]:
    spec = relgen.load_spec(f"specs/{name}.yaml")
    terms = tuple(relgen.compile_mechanism(spec).module.PLAN.terms)
    key = tuning.table_key(terms, torch.float16, 64, n)
    configs = {
        "table": tuning.table_config("90", terms, torch.float16, 64, n),
        "old_table": from_entry(old[key]) if key in old else None,
        "heuristic": default_config(torch.float16, 64, n, terms),
    }
    for label, cfg in configs.items():
        if cfg is None:
            continue
        for rep in range(3):
            inputs = make_inputs(spec, b=2, h=3, nq=n, d=64, dtype=torch.float16, device="cuda", seed=n)
            with override_config(cfg):
                res = compare(spec, inputs, dtype=torch.float16)
            bad = [r for r in res if not r[1]]
            print(f"{name} N={n} {label} rep{rep}: {'PASS' if not bad else 'FAIL'}", flush=True)
            for r in bad:
                print("   ", r)
        print(f"   {label}: {cfg}", flush=True)
