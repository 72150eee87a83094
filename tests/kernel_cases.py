"""Shared helpers of the kernel tests: random inputs for a spec, and a run against the FP64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import relgen
from relgen import reference
from relgen.testing import check_close

SPECS = ("shaw", "txl", "deberta_v3", "t5", "wav2vec2_bert", "t5_decoder")


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tables: dict[str, torch.Tensor]

    @property
    def leaves(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "k": self.k, "v": self.v, **self.tables}


def make_inputs(spec, b=1, h=2, nq=17, nk=None, d=16, dtype=torch.float32, device="cpu", seed=0, length=None) -> Inputs:
    spec = relgen.load_spec(spec)
    nk = nq if nk is None else nk
    rows = spec.map.num_rows(length or max(nq, nk))
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen, dtype=torch.float32) * scale
        return t.to(device=device, dtype=dtype).requires_grad_()

    shape = (rows, d) if spec.heads_share_tables else (h, rows, d)
    tables = {}
    if spec.has_query:
        tables["aq"] = rand(*shape, scale=0.5)
    if spec.has_key:
        tables["ak"] = rand(*shape, scale=0.5)
    if spec.has_bias:
        tables["bias"] = rand(*shape[:-1]).detach().float().requires_grad_()
    return Inputs(rand(b, h, nq, d), rand(b, h, nk, d), rand(b, h, nk, d), tables)


def compare(spec, inputs: Inputs, dtype=torch.float32, check_grads=True, **options):
    """Run relgen and the reference; return a list of (name, ok, message) for the output and every gradient."""
    fn = relgen.compile_mechanism(spec)
    keep_mask = options.pop("keep_mask", None)  # the reference's explicit dropout mask
    out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    ref_options = {k: v for k, v in options.items() if k not in ("recompute_projections", "dropout_seed")}
    if keep_mask is not None:
        ref_options["keep_mask"] = keep_mask
    ref = reference.attention(spec, inputs.q, inputs.k, inputs.v, **inputs.tables, **ref_options)
    results = [("out", *check_close(out, ref, dtype))]
    if check_grads:
        gen = torch.Generator(device="cpu").manual_seed(1)
        do = torch.randn(out.shape, generator=gen).to(out.device)
        names, leaves = zip(*inputs.leaves.items(), strict=True)
        got = torch.autograd.grad(out, leaves, do.to(out.dtype), allow_unused=True)
        want = torch.autograd.grad(ref, leaves, do.double(), allow_unused=True)
        for name, g, w in zip(names, got, want, strict=True):
            w = torch.zeros_like(inputs.leaves[name], dtype=torch.float64) if w is None else w
            if g is None:
                results.append((f"d{name}", False, "no gradient"))
            else:
                results.append((f"d{name}", *check_close(g, w, dtype)))
    return results


def assert_all_close(results, context=""):
    failed = [f"{name}: {msg}" for name, ok, msg in results if not ok]
    assert not failed, f"{context}\n" + "\n".join(failed)
