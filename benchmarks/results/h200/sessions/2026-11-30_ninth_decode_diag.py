"""T5's decode gradients in half precision (test_features_long's Nq = 1 case) for several dO draws: the kernels'
errors next to the error Δ = rowsum(dO∘O) alone carries when O is the rounded output (FlashAttention's Δ)."""

import json
import sys

import torch

import relgen
from relgen import reference
from relgen.testing import check_close
from relgen.verify import make_inputs

spec = relgen.load_spec("specs/t5.yaml")
n = 4096
fn = relgen.compile_mechanism(spec)
for dtype in (torch.bfloat16, torch.float16):
    part = make_inputs(spec, b=2, h=2, nq=1, nk=n, d=64, dtype=dtype, device="cuda", seed=1, length=n)
    out = fn(part.q, part.k, part.v, **part.tables, q_offset=n - 1)
    leaves = [part.q, part.k, part.v, part.tables["bias"]]
    dl = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = reference.attention(spec, dl[0], dl[1], dl[2], bias=dl[3], q_offset=n - 1)
    for s in range(6):
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(s)).to("cuda", dtype)
        got = torch.autograd.grad(out, leaves, do, retain_graph=True)
        want = torch.autograd.grad(ref, dl, do.double(), retain_graph=True)
        d_delta = ((out.detach().double() - ref.detach()) * do.double()).sum(-1).abs().max().item()
        row = {"tree": sys.argv[1], "dtype": str(dtype), "do_seed": s, "delta_err_from_rounded_O": d_delta}
        for name, g, w in zip(["dq", "dk", "dv", "dbias"], got, want, strict=True):
            ok, _ = check_close(g, w, dtype)
            row[name] = {"ok": ok, "max_abs": (g.double() - w).abs().max().item(), "max_ref": w.abs().max().item()}
        print(json.dumps(row), flush=True)
