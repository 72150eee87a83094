"""benchmarks/tiled_products.py (relation products formed per tile) against a float64 oracle written here.

The oracle builds every pair's table row p_(i−j) explicitly (no band, no skew) and differentiates by autograd, so
no expected value comes from the prototype; run in Triton's interpreter on the CPU (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from tiers import SLOW, slow_values

from relgen.testing import assert_close

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "tiled_products.py"
_SPEC = importlib.util.spec_from_file_location("tiled_products", _PATH)
tp = importlib.util.module_from_spec(_SPEC)
sys.modules["tiled_products"] = tp
_SPEC.loader.exec_module(tp)


def oracle(q, k, v, table, causal):
    """(O, LSE) in float64: S_ij = τ·(q_i·k_j + q_i·table[δ + N − 1]), δ = i − j, gathered pair by pair."""
    q, k, v, table = (t.double() for t in (q, k, v, table))
    n, d = q.shape[2], q.shape[3]
    i = torch.arange(n)
    pairs = table[:, (i[:, None] - i[None, :]) + n - 1]  # [H, N, N, d]: row p_(i−j) of every pair
    s = (torch.einsum("bhid,bhjd->bhij", q, k) + torch.einsum("bhid,hijd->bhij", q, pairs)) / math.sqrt(d)
    if causal:
        s = s.masked_fill(i[:, None] < i[None, :], float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def inputs(b, h, n, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, generator=gen).to(dtype) for _ in range(4))
    table = torch.randn(h, 2 * n - 1, d, generator=gen).to(dtype)
    return q, k, v, table, do


# N not a multiple of the tile (16 in the interpreter), one tile, several; fp16 and fp32; B·H = 4 with B = 2 so
# that the table gradient sums over the batch
CASES = slow_values(
    [(16, torch.float32), (37, torch.float32), (64, torch.float32), (130, torch.float32), (67, torch.float16)],
    fast=[(16, torch.float32)],
)
CAUSAL = slow_values([False, True], slow=[True])


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize(("n", "dtype"), CASES, ids=["N16-fp32", "N37-fp32", "N64-fp32", "N130-fp32", "N67-fp16"])
def test_forward_every_method(n, dtype, causal):
    q, k, v, table, _ = inputs(2, 2, n, 16, dtype)
    o_ref, lse_ref = oracle(q, k, v, table, causal)
    for method in tp.METHODS:
        o, lse = tp.attention_lse(q, k, v, table, causal, method=method)
        assert_close(o, o_ref, dtype, f"{method} O")
        assert_close(lse, lse_ref, dtype, f"{method} LSE")


@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "causal"])
@pytest.mark.parametrize(("n", "dtype"), CASES, ids=["N16-fp32", "N37-fp32", "N64-fp32", "N130-fp32", "N67-fp16"])
def test_gradients(n, dtype, causal):
    q, k, v, table, do = inputs(2, 2, n, 16, dtype, seed=1)
    leaves = [t.double().requires_grad_() for t in (q, k, v, table)]
    o_ref, _ = oracle(*leaves, causal)
    expected = torch.autograd.grad(o_ref, leaves, do.double())
    mine = [t.clone().requires_grad_() for t in (q, k, v, table)]
    got = torch.autograd.grad(tp.attention(*mine, causal, method="reuse"), mine, do)
    for name, a, e in zip(("dq", "dk", "dv", "dP"), got, expected, strict=True):
        assert a.dtype == dtype
        assert_close(a, e, dtype, name)


@pytest.mark.parametrize("block", slow_values([16, 32], slow=[32]))
def test_backward_is_bitwise_deterministic(block):
    """Two backwards of one output: every gradient entry bitwise equal (one writer each, fixed loop orders)."""
    q, k, v, table, do = inputs(2, 1, 40, 16, torch.float16, seed=2)
    mine = [t.clone().requires_grad_() for t in (q, k, v, table)]
    out = tp.attention(*mine, method="reuse", block=block)
    first = torch.autograd.grad(out, mine, do, retain_graph=True)
    second = torch.autograd.grad(out, mine, do)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@SLOW
def test_larger_tile_matches_oracle():
    """Tiles of 32 (the GPU's fp32 tile) on a length that leaves a partial tile."""
    q, k, v, table, do = inputs(1, 2, 45, 16, torch.float32, seed=3)
    leaves = [t.double().requires_grad_() for t in (q, k, v, table)]
    o_ref, lse_ref = oracle(*leaves, True)
    expected = torch.autograd.grad(o_ref, leaves, do.double())
    for method in tp.METHODS:
        o, lse = tp.attention_lse(q, k, v, table, True, method=method, block=32)
        assert_close(o, o_ref, torch.float32, f"{method} O")
        assert_close(lse, lse_ref, torch.float32, f"{method} LSE")
    mine = [t.clone().requires_grad_() for t in (q, k, v, table)]
    got = torch.autograd.grad(tp.attention(*mine, True, block=32), mine, do)
    for name, a, e in zip(("dq", "dk", "dv", "dP"), got, expected, strict=True):
        assert_close(a, e, torch.float32, name)


def test_refuses_bad_arguments():
    q, k, v, table, _ = inputs(1, 2, 20, 16, torch.float32)
    with pytest.raises(ValueError, match="table"):
        tp.attention(q, k, v, table[:, :-1])
    with pytest.raises(ValueError, match="method"):
        tp.attention(q, k, v, table, method="stored")
    with pytest.raises(NotImplementedError, match="head dim"):
        tp.attention(q[..., :12], k[..., :12], v[..., :12], table[..., :12])
