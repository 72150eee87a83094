"""Forward tiles x the fused prologue's column tile (project.block_w) for Shaw / DeBERTa (twelfth session).

python sweepw.py SPEC N warm IDX   compile one candidate (one call)
python sweepw.py SPEC N measure    time every candidate, three alternating rounds, JSON lines
"""

import json
import sys
from dataclasses import replace

import torch
import triton

import relgen
from relgen.config import AttnTiles, override_config, select_config
from relgen.verify import make_inputs

name, n, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
spec = relgen.load_spec(f"specs/{name}.yaml")
fn = relgen.compile_mechanism(spec)
made = make_inputs(spec, b=max(1, 16384 // n), h=12, nq=n, d=64, dtype=torch.float16, device="cuda")
base = select_config(fn.module.PLAN, torch.float16, 64, n)
tiles = [(base.forward.block_m, base.forward.block_n, base.forward.num_warps, base.forward.num_stages)]
tiles += [t for t in [(128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3), (128, 64, 8, 3)] if t not in tiles]
cands = [(t, w) for t in tiles for w in (32, 64, 128)]


def cfg_of(c):
    t, w = c
    return replace(base, forward=AttnTiles(*t), project=replace(base.project, block_w=w))


def call():
    return fn(made.q, made.k, made.v, **made.tables)


if what == "warm":
    c = cands[int(sys.argv[4])] if int(sys.argv[4]) < len(cands) else None
    if c:
        with override_config(cfg_of(c)):
            call()
        torch.cuda.synchronize()
    sys.exit(0)
ref = call().float()
print(json.dumps({"spec": name, "n": n, "base": str(base.forward), "base_w": base.project.block_w}), flush=True)
for rnd in (1, 2, 3):
    for c in cands:
        try:
            with override_config(cfg_of(c)):
                diff = (call().float() - ref).abs().max().item()
                ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
        except Exception as err:
            ms, diff = f"{type(err).__name__}: {str(err)[:100]}", None
        print(
            json.dumps(
                {"spec": name, "n": n, "round": rnd, "tiles": c[0], "block_w": c[1], "ms": ms, "max_diff": diff}
            ),
            flush=True,
        )
