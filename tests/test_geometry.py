"""Geometry facts the kernels rely on, checked by brute force over the windows they compute."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import make_inputs

import relgen
from relgen.runtime.arguments import prepare_call

ROOT = Path(__file__).resolve().parent.parent


def geometry(module, inputs, **options):
    tables = {name: inputs.tables.get(name) for name in ("aq", "ak", "bias")}
    return prepare_call(module.PLAN, inputs.q, inputs.k, inputs.v, *tables.values(), **options).geo


def window_starts(geo, query_side: bool) -> list[int]:
    """clip(±gG + base, 0, C − W) for every group (docs/algorithm.md), as the kernels' `_window_start` computes it."""
    width = geo.wq if query_side else geo.wk
    tokens = geo.nq if query_side else geo.nk
    base = geo.doff - (geo.nk - 1 if query_side else geo.group - 1) - geo.low
    sign = 1 if query_side else -1
    groups = -(-tokens // geo.group)
    return [min(max(sign * g * geo.group + base, 0), geo.c - width) for g in range(groups)]


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["shaw", "txl", "deberta_v3", "t5", "t5_decoder"]),
    nq=st.integers(1, 300),
    nk=st.integers(1, 300),
    k_offset=st.sampled_from([0, 16, 5]),
)
def test_aligned_windows_start_on_multiples_of_16(name, nq, nk, k_offset):
    spec = relgen.load_spec(ROOT / "specs" / f"{name}.yaml")
    length = max(nq, k_offset + nk)
    inputs = make_inputs(spec, b=1, h=1, nq=nq, nk=nk, d=16, device="cpu", length=length)
    module = relgen.compile_mechanism(spec).module_for(length)
    geo = geometry(module, inputs, k_offset=k_offset)
    for query_side in (True, False):
        if geo.windows_aligned(query_side):
            assert all(start % 16 == 0 for start in window_starts(geo, query_side)), (query_side, geo)


@pytest.mark.parametrize(("name", "n"), [("txl", 64), ("txl", 256), ("deberta_v3", 1024)])
def test_windows_aligned_where_the_benchmark_needs_it(name, n):
    """TXL (windows at multiples of G) and DeBERTa at long lengths (each window the whole expansion)."""
    spec = relgen.load_spec(ROOT / "specs" / f"{name}.yaml")
    inputs = make_inputs(spec, b=1, h=1, nq=n, d=16, device="cpu")
    module = relgen.compile_mechanism(spec).module_for(n)
    geo = geometry(module, inputs)
    assert geo.windows_aligned(True) and geo.windows_aligned(False)


@pytest.mark.parametrize(
    ("name", "n"),
    [("shaw", 300), ("txl", 40), ("deberta_v3", 520), ("t5", 200), ("t5_decoder", 200), ("wav2vec2_bert", 80)],
)
def test_expanded_tables_hold_the_row_of_every_offset(name, n):
    """Ã = E·A: expanded column s is the table row φ(low + s) by the reference's own φ, for every offset of the
    expansion (including the plans whose β is the identity and skip the gather)."""
    spec = relgen.load_spec(ROOT / "specs" / f"{name}.yaml")
    module = relgen.compile_mechanism(spec).module
    inputs = make_inputs(spec, b=1, h=2, nq=n, d=16)
    geo = geometry(module, inputs)
    tables = {t: inputs.tables.get(t) for t in ("aq", "ak", "bias")}
    expanded = geo.expand(*tables.values())
    rows = relgen.reference.relation_rows(spec, n, n)
    deltas = range(geo.low, geo.high + 1)
    assert geo.low >= -(n - 1) and geo.high <= n - 1  # every offset of the expansion occurs in this call
    phi = [int(rows[d, 0]) if d >= 0 else int(rows[0, -d]) for d in deltas]
    for table, got in ((tables["aq"], expanded.aq), (tables["ak"], expanded.ak)):
        if table is not None:
            assert got.shape[-2] == geo.c
            assert torch.equal(got, table[..., phi, :])
    if tables["bias"] is not None:
        assert torch.equal(expanded.bias, tables["bias"][..., phi].float())


@given(width=st.integers(1, 20000))
def test_row_stride_is_the_smallest_aligned_width(width):
    from relgen.runtime.geometry import ROW_ALIGN, Geometry

    stride = Geometry.row_stride(width)
    assert stride % ROW_ALIGN == 0 and width <= stride < width + ROW_ALIGN
    assert Geometry.row_units(width) * ROW_ALIGN == stride


@pytest.mark.parametrize(
    ("storage", "dtype", "stored", "prec"),
    [
        ("fp32", torch.float16, torch.float32, "tf32"),
        ("fp32", torch.bfloat16, torch.float32, "tf32"),
        ("fp32", torch.float32, torch.float32, "ieee"),
        ("fp16", torch.float16, torch.float16, "ieee"),
        ("fp16", torch.bfloat16, torch.float32, "tf32"),
    ],
)
def test_gradient_buffer_precision_follows_the_inputs(storage, dtype, stored, prec):
    """dZ̃ is fp16 only for fp16 inputs under the fp16 projection storage. bf16 keeps it in fp32 in either (its
    boundary columns are sums over many pairs), and an fp32 dZ̃ of half-precision inputs enters the reductions as
    tf32. (The dtype is the Geometry's only: the interpreter refuses bf16 calls.)"""
    spec = relgen.load_spec(ROOT / "specs" / "t5_decoder.yaml")
    inputs = make_inputs(spec, b=1, h=2, nq=1, nk=300, d=16, device="cpu", length=300)
    module = relgen.compile_mechanism(spec).module_for(300)
    geo = replace(geometry(module, inputs, q_offset=299), dtype=dtype, fp16_storage=storage == "fp16")
    assert geo.gradient_buffer(torch.device("cpu")).dtype == stored
    red = geo.reduction(True)
    assert red.prec == prec


def test_device_constants_are_made_on_a_thread_of_their_own():
    """A CUDA graph's warm-up sends the calling thread's allocations to the graph's pool: a kept constant is made
    on another thread (relgen.runtime.geometry._outside_graph_pools), and its errors still reach the caller."""
    import threading

    from relgen.runtime.geometry import _outside_graph_pools

    caller = threading.current_thread()
    made_on = []

    def make():
        made_on.append(threading.current_thread())
        return torch.arange(3)

    assert torch.equal(_outside_graph_pools(make), torch.arange(3))
    assert made_on and made_on[0] is not caller

    def fail():
        raise ValueError("no device")

    with pytest.raises(ValueError, match="no device"):
        _outside_graph_pools(fail)


@pytest.mark.parametrize(
    ("map_", "window", "n", "q_offset"),
    [
        ({"kind": "identity"}, {"left": 5, "right": 2}, 30, 0),
        ({"kind": "identity"}, {"left": None, "right": 3}, 20, 7),
        ({"kind": "identity", "offset": "key_minus_query"}, {"left": 4, "right": 0}, 25, 3),
        ({"kind": "identity", "offset": "key_minus_query"}, None, 18, 0),
    ],
)
def test_fold_of_a_length_dependent_map_gathers_each_row_from_its_column(map_, window, n, q_offset):
    """The backward's fold of an identity or reversed map (windowed or not): row r reads the one column s with
    β(s) = r, none for a row outside the window, worked out here from β itself; and the runs are made once per
    length, not per call (2L − 1 rows)."""
    data = {"name": "fold_case", "terms": ["query"], "map": map_, **({"window": window} if window else {})}
    spec = relgen.load_spec(data)
    module = relgen.compile_mechanism(spec).module
    inputs = make_inputs(spec, b=1, h=1, nq=n, d=16, device="cpu", length=n + q_offset)
    geo = geometry(module, inputs, q_offset=q_offset)
    beta = geo.copy_beta or list(range(geo.c))
    column = {row: s for s, row in enumerate(beta)}
    assert len(column) == geo.c  # one column per row
    expected = tuple((column[r], 1) if r in column else (0, 0) for r in range(geo.rows))
    assert geo.fold == expected
    again = geometry(module, make_inputs(spec, b=2, h=1, nq=n, d=16, device="cpu", length=n + q_offset),
                     q_offset=q_offset)  # fmt: skip
    assert again is not geo and again.fold is geo.fold


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(["shaw", "txl", "t5_decoder"]),
    left=st.one_of(st.none(), st.integers(0, 40)),
    right=st.one_of(st.none(), st.integers(0, 40)),
    nq=st.integers(1, 70),
    nk=st.integers(1, 70),
    q_offset=st.integers(0, 30),
)
def test_saturated_tiles_and_scored_pairs_by_brute_force(name, left, right, nq, nk, q_offset):
    """The forward makes TMA descriptors only where some admitted pair lies beyond the band [low, high] (a
    saturated tile needs one), and sizes that choice by the pairs it scores: at least the admitted pairs counted
    one by one, and B·H·Nq·Nk without a window."""
    data = yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text())
    if left is not None or right is not None:
        data = {**data, "name": f"{name}_local", "window": {"left": left, "right": right}}
    spec = relgen.load_spec(data)
    length = max(nq + q_offset, nk)
    inputs = make_inputs(spec, b=1, h=2, nq=nq, nk=nk, d=16, device="cpu", length=length)
    module = relgen.compile_mechanism(spec).module_for(length)
    geo = geometry(module, inputs, q_offset=q_offset)
    causal = module.PLAN.causal
    admitted = [
        i + q_offset - j
        for i in range(nq)
        for j in range(nk)
        if (not causal or i + q_offset >= j)
        and (left is None or i + q_offset - j <= left)
        and (right is None or i + q_offset - j >= -right)
    ]
    beyond = any(d < geo.low or d > geo.high for d in admitted)
    assert geo.saturated_tiles == (geo.nk > geo.c and beyond)
    assert geo.scored_pairs >= 2 * len(admitted)
    if left is None and right is None and not causal:
        assert geo.scored_pairs == 2 * nq * nk


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(["shaw", "t5", "t5_decoder", "deberta_v3", "wav2vec2_bert"]),
    delta=st.lists(st.integers(-5000, 5000), min_size=1, max_size=40),
)
def test_offset_rows_are_the_maps_rows(name: str, delta: list[int]):
    """Mechanism.offset_rows (β(clip(δ, L, U) − L) on the device) gives the map's own row of every offset, far ones
    included; a causal plan's, of every offset its causality admits."""
    spec = relgen.load_spec(ROOT / "specs" / f"{name}.yaml")
    fn = relgen.compile_mechanism(spec)
    offsets = torch.tensor([d for d in delta if d >= 0 or not spec.causal] or [0])
    expected = torch.as_tensor(spec.map.row_ids(offsets.numpy(), 1))
    assert torch.equal(fn.offset_rows(offsets), expected)


def test_offset_rows_refuse_a_length_dependent_map():
    fn = relgen.compile_mechanism(relgen.load_spec(ROOT / "specs" / "txl.yaml"))
    with pytest.raises(NotImplementedError, match="depend on the length"):
        fn.offset_rows(torch.tensor([0, 1]))
