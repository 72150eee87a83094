"""Shaw's 8K forward with the committed tiles against 4-stage and other candidates (two alternating rounds)."""
import json
from dataclasses import replace

import torch
import triton

import relgen
from relgen.config import AttnTiles, override_config, select_config
from relgen.verify import make_inputs

spec = relgen.load_spec("specs/shaw.yaml")
fn = relgen.compile_mechanism(spec)
made = make_inputs(spec, b=2, h=12, nq=8192, d=64, dtype=torch.float16, device="cuda")
base = select_config(fn.module.PLAN, torch.float16, 64, 8192)
print(json.dumps({"base": str(base.forward)}), flush=True)
cands = [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 5), (128, 128, 8, 3)]
for rnd in (1, 2):
    for c in cands:
        cfg = replace(base, forward=AttnTiles(*c))
        try:
            with override_config(cfg):
                ms = triton.testing.do_bench(lambda: fn(made.q, made.k, made.v, **made.tables), warmup=25, rep=150,
                                             return_mode="median")
        except Exception as err:
            ms = f"{type(err).__name__}: {str(err)[:100]}"
        print(json.dumps({"round": rnd, "tiles": c, "ms": ms}), flush=True)
