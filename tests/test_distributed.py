"""relgen.distributed: context-parallel calls over gloo (2 and 4 processes, the kernels in Triton's interpreter)
against the unsharded call on the gathered sequence; a ring of one, the sharding bookkeeping, the merge and the
argument errors in this process; and, marked gpu, a ring of one and of two GPUs over NCCL.

Spawning processes and the interpreter are slow, so each group size is spawned once, on first use, and runs every
one of its cases; the ranks write their results to files that the tests here judge.
"""

from __future__ import annotations

import math
import os
import re
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import SLOW, slow_values

ROOT = Path(__file__).resolve().parent.parent
D = 16
#: tests that run the kernels on CPU tensors, in Triton's interpreter (with a GPU, the gpu tests stand for them)
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors in Triton's interpreter")
#: small specs of the map kinds the shipped specs lack (and a log map whose interpreter runs are short: DeBERTa's
#: 512 log buckets take half a minute per chunk pair there)
LOG = {"name": "log_cp", "terms": ["query", "key"], "map": {"kind": "log", "position_buckets": 8, "max_position": 32}}
BOUNDARIES = {
    "name": "boundaries_cp",
    "terms": ["query", "bias"],
    "map": {"kind": "boundaries", "boundaries": [-6, -2, 0, 3, 9]},
    "heads_share_tables": True,
}
#: ±δ share rows: the atomic path
EXPRESSION = {
    "name": "expression_cp",
    "terms": ["key"],
    "map": {"kind": "expression", "expr": "Min(Abs(delta), 9)", "rows": 10},
    "causal": True,
}
IDENTITY_CAUSAL = {
    "name": "identity_causal_cp",
    "terms": ["query", "bias"],
    "map": {"kind": "identity", "offset": "key_minus_query"},
    "causal": True,
}


@dataclass(frozen=True)
class Case:
    name: str
    spec: str | dict
    sharding: str
    n: int = 32  # gathered length
    padding: bool = False
    offsets: tuple[int, int] = (0, 0)
    dropout: float = 0.0
    repeat: bool = False  # run twice: the second run must repeat the first bit for bit
    local_tables: bool = False  # identity tables sized for the shard, not the gathered sequence: a ValueError


CASES = {
    2: [
        Case("shaw-contiguous", "shaw", "contiguous"),
        # dropout: the unsharded call's mask; k_offset 3 (and 5 below) is not a multiple of eight: one Philox call
        # per score
        Case("txl-zigzag-offsets-dropout", "txl", "zigzag", offsets=(5, 3), dropout=0.25),
        Case("log-contiguous-padding", LOG, "contiguous", padding=True),
        Case("t5-contiguous-dropout", "t5", "contiguous", dropout=0.25),
        Case("t5_decoder-zigzag-repeat", "t5_decoder", "zigzag", repeat=True),
        Case("wav2vec2_bert-zigzag-padding", "wav2vec2_bert", "zigzag", padding=True),
        Case("boundaries-contiguous", BOUNDARIES, "contiguous"),
        # keys from position 5 on: the first five queries have no key to attend to (output 0, LSE −inf)
        Case("expression-contiguous-dropout-offsets", EXPRESSION, "contiguous", dropout=0.25, offsets=(0, 5)),
        Case("expression-zigzag-dropout", EXPRESSION, "zigzag", dropout=0.25),
        Case("txl-local-tables", "txl", "contiguous", local_tables=True),
    ],
    4: [
        Case("txl-contiguous-4-dropout", "txl", "contiguous", dropout=0.25),
        Case("identity_causal-zigzag-4-dropout", IDENTITY_CAUSAL, "zigzag", dropout=0.25),
    ],
}
ALL = [(world, case) for world, cases in CASES.items() for case in cases]


def _spec(case: Case):
    import relgen

    return relgen.load_spec(case.spec if isinstance(case.spec, dict) else ROOT / "specs" / f"{case.spec}.yaml")


def _gathered(case: Case):
    """The case's inputs over the gathered sequence, the same in every process: (spec, inputs, dO, key padding
    mask or None, options)."""
    from relgen.check.verify import make_inputs

    spec = _spec(case)
    q_offset, k_offset = case.offsets
    length = max(q_offset, k_offset) + case.n
    inputs = make_inputs(spec, b=1, h=2, nq=case.n, d=D, seed=len(case.name), length=length)
    do = torch.randn(1, 2, case.n, D, generator=torch.Generator().manual_seed(7))
    kpm = None
    if case.padding:  # keys 16-23: the whole of zigzag's third chunk (P = 2); keys 5-10 across chunk boundaries
        kpm = torch.ones(1, case.n, dtype=torch.bool)
        kpm[0, 5:11] = kpm[0, 16:24] = False
    options = {"q_offset": q_offset, "k_offset": k_offset}
    if case.dropout:
        options.update(dropout_p=case.dropout, dropout_seed=1234)
    return spec, inputs, do, kpm, options


def _sharded_call(case: Case, group_size: int):
    """One run of the case on this rank: the gathered output, LSE and q, k, v gradients (unsharded), and this
    rank's table gradients."""
    import relgen
    import relgen.distributed as rd

    spec, inputs, do, kpm, options = _gathered(case)
    fn = relgen.compile_mechanism(spec)
    cp_fn = rd.context_parallel(fn, sharding=case.sharding)
    q, k, v = (rd.shard(x.detach(), None, case.sharding).requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
    tables = dict(inputs.tables)
    if case.local_tables:
        tables = {name: t[:, : 2 * (case.n // group_size) - 1] for name, t in tables.items()}
    if kpm is not None:
        options["key_padding_mask"] = rd.shard(kpm, None, case.sharding, dim=1)
    out, lse = cp_fn(q, k, v, **tables, return_lse=True, **options)
    grads = torch.autograd.grad(out, [q, k, v, *tables.values()], rd.shard(do, None, case.sharding))
    gathered = [rd.unshard(x, None, case.sharding) for x in (out, lse, *grads[:3])]
    return dict(zip(("out", "lse", "dq", "dk", "dv"), gathered, strict=True)), dict(zip(tables, grads[3:], strict=True))


def _worker(rank: int, world: int, store: str, out_dir: str, cases: list[Case]) -> None:
    if not torch.cuda.is_available():  # before triton is imported: the kernels run in the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    results: dict[str, Any] = {}
    progress = Path(out_dir) / f"rank{rank}.log"
    for case in cases:
        with progress.open("a") as log:
            log.write(f"{case.name}\n")
        try:
            tensors, tables = _sharded_call(case, world)
            result = {"tensors": tensors, "tables": tables}
            if case.repeat:
                again, again_tables = _sharded_call(case, world)
                result["repeats"] = all(torch.equal(tensors[n], again[n]) for n in tensors) and all(
                    torch.equal(tables[n], again_tables[n]) for n in tables
                )
        except Exception as error:  # judged by the test: some cases expect an error on every rank
            result = {"error": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
        results[case.name] = result
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # every rank's transfers are done before any rank leaves
    dist.destroy_process_group()
    # The results are on disk: leave without the interpreter's and the C++ libraries' teardown, where gloo's
    # threads can end the process with SIGABRT ("terminate called without an active exception") after the work
    # is done.
    os._exit(0)


_RESULTS: dict[int, list[dict[str, Any]]] = {}


def _results(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of the group of `world` processes (spawned on first use)."""
    if world not in _RESULTS:
        out_dir = tmp_path_factory.mktemp(f"ring{world}")
        try:
            mp.start_processes(
                _worker,
                args=(world, str(out_dir / "store"), str(out_dir), CASES[world]),
                nprocs=world,
                start_method="spawn",
                join=True,
            )
        except mp.ProcessExitedException as error:
            reached = {r: _last_case(out_dir / f"rank{r}.log") for r in range(world)}
            raise AssertionError(f"{error}; each rank's last case begun: {reached}") from error
        _RESULTS[world] = [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
    return _RESULTS[world]


def _last_case(log: Path) -> str:
    lines = log.read_text().split() if log.exists() else []
    return lines[-1] if lines else "none"


def _expected(case: Case):
    """(out, lse, dq, dk, dv, {table: gradient}) of the unsharded call on the gathered sequence (dropout: with the
    same seed, so the same mask)."""
    import relgen

    spec, inputs, do, kpm, options = _gathered(case)
    leaves = [inputs.q, inputs.k, inputs.v, *inputs.tables.values()]
    fn = relgen.compile_mechanism(spec)
    out, lse = fn(*leaves[:3], **inputs.tables, key_padding_mask=kpm, return_lse=True, **options)
    grads = torch.autograd.grad(out, leaves, do.to(out.dtype))
    return (out, lse, *grads[:3]), dict(zip(inputs.tables, grads[3:], strict=True))


@SLOW
@INTERPRETED
@pytest.mark.parametrize(("world", "case"), ALL, ids=[f"P{w}-{c.name}" for w, c in ALL])
def test_sharded_call_equals_the_gathered_call(world: int, case: Case, tmp_path_factory):
    from relgen.testing import assert_close

    ranks = [r[case.name] for r in _results(world, tmp_path_factory)]
    if case.local_tables:
        for r, result in enumerate(ranks):
            assert result.get("error") == "ValueError", f"rank {r}: {result.get('traceback', result)}"
            assert "aq: expected 63 rows" in result["message"] and "gathered length" in result["message"]
        return
    for r, result in enumerate(ranks):
        assert "error" not in result, f"rank {r}:\n{result['traceback']}"
    (out, lse, dq, dk, dv), tables = _expected(case)
    got = ranks[0]["tensors"]
    for name, expected in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(got[name], expected, torch.float32, f"{case.name} {name}")
    for name, expected in tables.items():
        assert_close(ranks[0]["tables"][name], expected, torch.float32, f"{case.name} d{name}")
    for r, result in enumerate(ranks[1:], 1):  # every rank: the same gathered results, the same table gradients
        for name in got:
            assert torch.equal(result["tensors"][name], got[name]), f"rank {r}'s {name} differs from rank 0's"
        for name in tables:
            assert torch.equal(result["tables"][name], ranks[0]["tables"][name]), f"rank {r}'s d{name} differs"
    if case.offsets[1] > case.offsets[0] and _spec(case).causal:  # queries before the first key: 0 and −inf
        no_key = slice(0, case.offsets[1] - case.offsets[0])
        assert torch.all(got["out"][:, :, no_key] == 0) and torch.all(got["lse"][:, :, no_key] == float("-inf"))
    if case.repeat:
        assert all(result["repeats"] for result in ranks), "a second run did not repeat the first bit for bit"


# ------------------------------------------------------------------------------------------------------------
# in this process: a ring of one (no process group), the bookkeeping, the merge, the errors
# ------------------------------------------------------------------------------------------------------------
def _leaves(spec, nq, nk, length, seed=3):
    from relgen.check.verify import make_inputs

    inputs = make_inputs(spec, b=1, h=2, nq=nq, nk=nk, d=D, seed=seed, length=length)
    return inputs, [inputs.q, inputs.k, inputs.v, *inputs.tables.values()]


@INTERPRETED
def test_a_ring_of_one_is_the_unsharded_call_bit_for_bit():
    """One contiguous chunk: the same kernel calls, so the same bits (the backward recomputes the projections)."""
    import relgen
    import relgen.distributed as rd

    spec = _spec(Case("txl", "txl", "contiguous"))
    fn = relgen.compile_mechanism(spec)
    inputs, leaves = _leaves(spec, 24, 24, 24)
    do = torch.randn(1, 2, 24, D, generator=torch.Generator().manual_seed(1))
    expected = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, return_lse=True)
    got = rd.context_parallel(fn)(inputs.q, inputs.k, inputs.v, **inputs.tables, return_lse=True)
    for name, a, e in zip(("out", "lse"), got, expected, strict=True):
        assert torch.equal(a, e), name
    for a, e in zip(torch.autograd.grad(got[0], leaves, do), torch.autograd.grad(expected[0], leaves, do), strict=True):
        assert torch.equal(a, e)


@INTERPRETED
@pytest.mark.parametrize("recompute", slow_values([False, True], slow=[True]))
def test_a_ring_of_one_keeps_its_projections_and_merges_nothing(monkeypatch, recompute):
    """One contiguous chunk is one pair: its forward's output is the ring's (no merge), and its backward reuses the
    forward's projections as the plain call does (recompute_projections=True: formed again, as the plain call's),
    bit for bit the plain call's either way. In two zigzag chunks each query chunk merges once: its first pair
    starts its total."""
    import relgen
    import relgen.distributed as rd
    from relgen.distributed import schedule
    from relgen.distributed.merge import merge

    spec = _spec(Case("txl", "txl", "contiguous"))
    fn = relgen.compile_mechanism(spec)
    inputs, leaves = _leaves(spec, 24, 24, 24)
    do = torch.randn(1, 2, 24, D, generator=torch.Generator().manual_seed(1))
    merges, projections = [], []
    monkeypatch.setattr(schedule, "merge", lambda *a: merges.append(1) or merge(*a))
    real = fn.module._projections
    monkeypatch.setattr(fn.module, "_projections", lambda *a, **kw: projections.append(1) or real(*a, **kw))

    options = {"recompute_projections": recompute}
    got = rd.context_parallel(fn)(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    got_grads = torch.autograd.grad(got, leaves, do)
    assert (merges, len(projections)) == ([], 1 + recompute)
    expected = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    assert torch.equal(got, expected)
    for a, e in zip(got_grads, torch.autograd.grad(expected, leaves, do), strict=True):
        assert torch.equal(a, e)
    rd.context_parallel(fn, sharding="zigzag")(inputs.q, inputs.k, inputs.v, **inputs.tables)
    assert len(merges) == 2  # 2 query chunks × 2 key chunks, non-causal


@INTERPRETED
@pytest.mark.parametrize("terms", slow_values([["query"], ["query", "key"]], slow=[["query", "key"]]))
def test_query_chunks_share_their_projections_across_key_chunks(monkeypatch, terms):
    """Clipped at ±3, every query's window is the whole expansion (W = C = 7): a query chunk's Z̃^Q is the same
    for each key chunk, and the backward forms it once per query chunk (two of zigzag's four pairs), where the spec
    stores no Z̃^K; with one (which is each key chunk's), once per pair. Both close to the unsharded call. The
    projections a pair forms are at one scale: none is written again (_rescale_projections, which only the
    forward's own rows of Z̃^Q need)."""
    import relgen
    import relgen.distributed as rd
    from relgen.testing import assert_close

    spec = relgen.load_spec({"name": f"clip3_{len(terms)}", "terms": terms, "map": {"kind": "clipped", "min": -3,
                                                                                    "max": 3}})  # fmt: skip
    fn = relgen.compile_mechanism(spec)
    inputs, leaves = _leaves(spec, 32, 32, 32)
    do = torch.randn(1, 2, 32, D, generator=torch.Generator().manual_seed(4))
    expected = fn(inputs.q, inputs.k, inputs.v, **inputs.tables)
    expected_grads = torch.autograd.grad(expected, leaves, do)
    got = rd.context_parallel(fn, sharding="zigzag")(inputs.q, inputs.k, inputs.v, **inputs.tables)
    assert_close(got, expected, torch.float32, "out")
    formed = []
    real = fn.module._projections
    monkeypatch.setattr(fn.module, "_projections", lambda *a, **kw: formed.append(1) or real(*a, **kw))
    rescaled = []
    if hasattr(fn.module, "_rescale_projections"):
        monkeypatch.setattr(fn.module, "_rescale_projections", lambda *a, **kw: rescaled.append(1))
    names = ["dq", "dk", "dv", *(f"d{t}" for t in inputs.tables)]
    for name, a, e in zip(names, torch.autograd.grad(got, leaves, do), expected_grads, strict=True):
        assert_close(a, e, torch.float32, name)
    assert len(formed) == (2 if terms == ["query"] else 4)
    assert not rescaled


@SLOW
@INTERPRETED
def test_a_ring_of_one_in_zigzag_chunks_with_offsets_and_unequal_lengths():
    """Two chunks of queries (16 from position 16) against two chunks of keys (32 from 0): four chunk pairs, each
    with its own offsets and identity rows, merged; the result is the unsharded call's."""
    import relgen
    import relgen.distributed as rd
    from relgen.testing import assert_close

    spec = _spec(Case("txl", "txl", "zigzag"))
    fn = relgen.compile_mechanism(spec)
    inputs, leaves = _leaves(spec, 16, 32, 32)
    do = torch.randn(1, 2, 16, D, generator=torch.Generator().manual_seed(2))
    expected = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, q_offset=16, return_lse=True)
    got = rd.context_parallel(fn, sharding="zigzag")(
        inputs.q, inputs.k, inputs.v, **inputs.tables, q_offset=16, return_lse=True
    )
    for name, a, e in zip(("out", "lse"), got, expected, strict=True):
        assert_close(a, e, torch.float32, name)
    grads = zip(torch.autograd.grad(got[0], leaves, do), torch.autograd.grad(expected[0], leaves, do), strict=True)
    for name, (a, e) in zip(("dq", "dk", "dv", "daq"), grads, strict=True):
        assert_close(a, e, torch.float32, name)


@settings(deadline=None)  # the first example imports relgen.distributed
@given(
    sharding=st.sampled_from(["contiguous", "zigzag"]),
    size=st.integers(1, 8),
    chunk=st.integers(1, 6),
    offset=st.integers(0, 40),
)
def test_the_ranks_chunks_tile_the_gathered_sequence(sharding, size, chunk, offset):
    from relgen.distributed.sharding import segments

    local = chunk if sharding == "contiguous" else 2 * chunk
    held = [s for rank in range(size) for s in segments(sharding, rank, size, local, offset)]
    assert sorted(s.start for s in held) == list(range(offset, offset + size * local, chunk))  # each chunk once
    assert all(s.length == chunk and s.start == offset + s.chunk * chunk for s in held)
    for rank in range(size):
        mine = segments(sharding, rank, size, local, offset)
        assert [s.local for s in mine] == list(range(0, local, chunk))  # stored one after the other
        # contiguous: rank r holds chunk r; zigzag: chunks r and 2P − 1 − r of 2P
        assert [s.chunk for s in mine] == ([rank] if sharding == "contiguous" else [rank, 2 * size - 1 - rank])


def test_shard_and_unshard_on_a_ring_of_one():
    import relgen.distributed as rd

    x = torch.arange(2 * 3 * 8 * 2.0).reshape(2, 3, 8, 2)
    for sharding in ("contiguous", "zigzag"):
        local = rd.shard(x, None, sharding)
        assert torch.equal(local, x) and local.data_ptr() != x.data_ptr()
        assert torch.equal(rd.unshard(local, None, sharding), x)


@settings(max_examples=40, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 19), max_size=5, unique=True).map(sorted),
    seed=st.integers(0, 2**16),
    hidden=st.floats(0.0, 0.9),
)
def test_merging_chunk_partials_gives_the_softmax_over_every_key(cuts, seed, hidden):
    """The partials of a softmax over key chunks (rows without any key in a chunk, one row without any key at
    all) merge to the softmax over every key; merging into the empty total is exact."""
    from relgen.distributed.merge import merge

    gen = torch.Generator().manual_seed(seed)
    n, nk, d = 6, 20, 4
    s = torch.randn(n, nk, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(nk, d, generator=gen, dtype=torch.float64)
    visible = torch.rand(n, nk, generator=gen) >= hidden
    visible[0, :10] = False
    visible[1] = False
    s = s.masked_fill(~visible, float("-inf"))
    o_all = torch.nan_to_num(torch.softmax(s, 1)) @ v
    o, lse2 = torch.zeros(n, d), torch.full((n,), float("-inf"))
    for n_chunk, keys in enumerate(torch.tensor_split(torch.arange(nk), cuts)):
        lse_b = torch.logsumexp(s[:, keys], 1)
        o_b = (torch.nan_to_num(torch.softmax(s[:, keys], 1)) @ v[keys]).float()
        o, lse2 = merge(o, lse2, o_b, (lse_b / math.log(2)).float())
        if n_chunk == 0:
            assert torch.equal(o, o_b)
    torch.testing.assert_close(o.double(), o_all, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse2.double() * math.log(2), torch.logsumexp(s, 1), rtol=1e-5, atol=1e-6)
    assert torch.all(o[1] == 0) and lse2[1] == float("-inf")


@SLOW
@INTERPRETED
def test_a_ring_of_one_in_zigzag_chunks_draws_the_unsharded_dropout_mask():
    """Four chunk pairs at their own offsets (keys from position 2: no chunk starts on a multiple of eight) draw
    the unsharded call's mask: the same output and gradients, and the mask `dropout_keep_mask` regenerates."""
    import relgen
    import relgen.distributed as rd
    from relgen import reference
    from relgen.testing import assert_close, dropout_keep_mask

    spec = _spec(Case("t5", "t5", "zigzag"))
    fn = relgen.compile_mechanism(spec)
    inputs, leaves = _leaves(spec, 16, 16, 18)
    do = torch.randn(1, 2, 16, D, generator=torch.Generator().manual_seed(3))
    options = {"q_offset": 1, "k_offset": 2, "dropout_p": 0.3, "dropout_seed": 21}
    expected = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, return_lse=True, **options)
    got = rd.context_parallel(fn, sharding="zigzag")(inputs.q, inputs.k, inputs.v, **inputs.tables, return_lse=True,
                                                     **options)  # fmt: skip
    keep = dropout_keep_mask((1, 2, 16, 16), 0.3, 21, q_offset=1, k_offset=2)
    ref = reference.attention(spec, *leaves[:3], **inputs.tables, keep_mask=keep, q_offset=1, k_offset=2, dropout_p=0.3)
    assert_close(got[0], ref, torch.float32, "out against the FP64 reference with the regenerated mask")
    for name, a, e in zip(("out", "lse"), got, expected, strict=True):
        assert_close(a, e, torch.float32, name)
    grads = zip(torch.autograd.grad(got[0], leaves, do), torch.autograd.grad(expected[0], leaves, do), strict=True)
    for name, (a, e) in zip(("dq", "dk", "dv", *(f"d{t}" for t in inputs.tables)), grads, strict=True):
        assert_close(a, e, torch.float32, name)


_X = torch.zeros(1, 2, 16, D)
#: a good call of txl on a ring of one (16 tokens: 31 identity rows). A ring of one in one chunk (contiguous) is the
#: plain call and gives its errors; the ring's own checks are met with zigzag chunks (two on a ring of one)
_GOOD = {"q": _X, "k": _X, "v": _X, "aq": torch.zeros(2, 31, D)}
_BAD_CALLS = [
    ("striped", {}, ValueError, "sharding: expected one of"),
    ("contiguous", {"cu_seqlens": torch.tensor([0, 16], dtype=torch.int32)}, NotImplementedError, "cu_seqlens"),
    ("contiguous", {"cu_seqlens_q": torch.tensor([0, 16], dtype=torch.int32)}, NotImplementedError, "cu_seqlens_q"),
    ("contiguous", {"max_seqlen_k": 16}, NotImplementedError, "max_seqlen_k"),
    ("zigzag", {"q": torch.zeros(1, 2, 16)}, ValueError, "q: expected a tensor [B, H, n, d]"),
    ("zigzag", {"q": torch.zeros(1, 2, 15, D)}, ValueError, "q: a zigzag shard holds 2 equal chunks"),
    ("zigzag", {"v": torch.zeros(1, 2, 8, D)}, ValueError, "v: expected the length of k"),
    ("zigzag", {"aq": torch.zeros(2, 29, D)}, ValueError, "aq: expected 31 rows"),
    ("contiguous", {"aq": torch.zeros(2, 31, D, dtype=torch.float16)}, ValueError, "aq: dtype must match q"),
    ("contiguous", {"key_padding_mask": torch.ones(1, 8, dtype=torch.bool)}, ValueError, "key_padding_mask"),
    ("contiguous", {"q_offset": -1}, ValueError, "q_offset"),
    ("contiguous", {"dropout_p": 0.1, "dropout_seed": "x"}, ValueError, "dropout_seed"),
    ("contiguous", {"dropout_p": 1.5}, ValueError, "dropout_p"),
    ("contiguous", {"scale": -1.0}, ValueError, "scale"),
    ("contiguous", {"recompute_projections": 1}, ValueError, "recompute_projections: expected a bool"),
]


@pytest.mark.parametrize(("sharding", "change", "error", "words"), _BAD_CALLS, ids=[c[3] for c in _BAD_CALLS])
def test_bad_calls_name_the_argument(sharding, change, error, words):
    import relgen
    import relgen.distributed as rd

    fn = relgen.compile_mechanism(_spec(Case("txl", "txl", "contiguous")))
    with pytest.raises(error, match=re.escape(words)):
        rd.context_parallel(fn, sharding=sharding)(**{**_GOOD, **change})


def test_a_ring_of_one_in_one_chunk_is_the_plain_call():
    """A contiguous ring of one runs fn itself: the same bits (forward and every gradient) and fn's own errors."""
    import relgen
    import relgen.distributed as rd

    fn = relgen.compile_mechanism(_spec(Case("txl", "txl", "contiguous")))
    cp_fn = rd.context_parallel(fn)
    assert cp_fn.plain and not rd.context_parallel(fn, sharding="zigzag").plain
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(1, 2, 16, D, generator=gen, requires_grad=True) for _ in range(3)]
    table = torch.randn(2, 31, D, generator=gen, requires_grad=True)
    do = torch.randn(1, 2, 16, D, generator=gen)
    results = []
    for call in (fn, cp_fn):
        out = call(*leaves, aq=table)
        results.append((out, *torch.autograd.grad(out, [*leaves, table], do)))
    for a, e in zip(*results, strict=True):
        assert torch.equal(a, e)
    bad = torch.zeros(2, 29, D)
    with pytest.raises(ValueError) as plain_error:
        fn(*leaves, aq=bad)
    with pytest.raises(ValueError, match=re.escape(str(plain_error.value))):
        cp_fn(*leaves, aq=bad)


def test_shard_errors():
    import relgen.distributed as rd

    with pytest.raises(ValueError, match="dim"):
        rd.shard(torch.zeros(2, 3), None, "contiguous", dim=2)
    with pytest.raises(ValueError, match="group"):
        rd.shard(torch.zeros(2, 3), "world", "contiguous", dim=1)
    with pytest.raises(ValueError, match="multiple of 2"):
        rd.shard(torch.zeros(2, 3), None, "zigzag", dim=1)


# ------------------------------------------------------------------------------------------------------------
# GPU: a ring of one over NCCL for every shipped spec, and a ring of two GPUs
# ------------------------------------------------------------------------------------------------------------
GPU_SPECS = ["shaw", "txl", "deberta_v3", "t5", "t5_decoder", "wav2vec2_bert"]


def _reference_failures(spec, inputs, out, lse, grads, do, **options) -> list[str]:
    """What of (out, lse, grads of q, k, v and the tables) is not close to the FP64 reference by relgen's criterion
    for q's dtype."""
    from relgen import reference
    from relgen.testing import check_close

    leaves = [inputs.q, inputs.k, inputs.v, *inputs.tables.values()]
    ref, ref_lse = reference.attention(spec, *leaves[:3], **inputs.tables, return_lse=True, **options)
    want = torch.autograd.grad(ref, leaves, do.double())
    names = ["out", "lse", "dq", "dk", "dv", *(f"d{t}" for t in inputs.tables)]
    pairs = zip(names, [out, lse, *grads], [ref, ref_lse, *want], strict=True)
    checks = [check_close(a, e, inputs.q.dtype, n) for n, a, e in pairs]
    return [message for ok, message in checks if not ok]


@pytest.fixture
def nccl_ring_of_one():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", GPU_SPECS)
def test_gpu_ring_of_one_over_nccl(name, sharding, dtype, nccl_ring_of_one):
    """The world of one GPU: exact by the FP64 criterion; in one contiguous chunk, the plain call's output and LSE
    bit for bit."""
    import relgen
    import relgen.distributed as rd
    from relgen.check.verify import make_inputs

    spec = _spec(Case(name, name, sharding))
    fn = relgen.compile_mechanism(spec)
    inputs = make_inputs(spec, b=1, h=2, nq=1024, d=64, dtype=dtype, device="cuda", seed=0)
    leaves = [inputs.q, inputs.k, inputs.v, *inputs.tables.values()]
    do = torch.randn(1, 2, 1024, 64, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    out, lse = rd.context_parallel(fn, sharding=sharding)(inputs.q, inputs.k, inputs.v, **inputs.tables,
                                                          return_lse=True)  # fmt: skip
    grads = torch.autograd.grad(out, leaves, do)
    if sharding == "contiguous":
        plain, plain_lse = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, return_lse=True)
        assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    failures = _reference_failures(spec, inputs, out, lse, grads, do)
    assert not failures, "\n".join(failures)


def _gpu_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    import relgen
    import relgen.distributed as rd
    from relgen.check.verify import make_inputs

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    failures = []
    for name in ("shaw", "txl", "t5_decoder"):
        for sharding in ("contiguous", "zigzag"):
            spec = _spec(Case(name, name, sharding))
            fn = relgen.compile_mechanism(spec)
            inputs = make_inputs(spec, b=1, h=2, nq=1024, d=64, dtype=torch.float16, device="cuda", seed=0)
            do = torch.randn(1, 2, 1024, 64, generator=torch.Generator().manual_seed(1)).to("cuda", torch.float16)
            cp_fn = rd.context_parallel(fn, sharding=sharding)
            q, k, v = (rd.shard(x.detach(), None, sharding).requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
            runs = []
            for _ in range(2):
                out, lse = cp_fn(q, k, v, **inputs.tables, return_lse=True)
                grads = torch.autograd.grad(out, [q, k, v, *inputs.tables.values()], rd.shard(do, None, sharding))
                runs.append([rd.unshard(x, None, sharding) for x in (out, lse, *grads[:3])] + list(grads[3:]))
            if not all(torch.equal(a, b) for a, b in zip(*runs, strict=True)):
                failures.append(f"{name} {sharding}: a second run differs")
            if rank == 0:
                out, lse, *grads = runs[0]
                failures += [f"{name} {sharding}: {m}" for m in _reference_failures(spec, inputs, out, lse, grads, do)]
    (Path(out_dir) / f"rank{rank}.txt").write_text("\n".join(failures))
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_ring_of_two_over_nccl(tmp_path):
    """Two GPUs, both shardings, causal and not, identity tables: exact by the FP64 criterion and repeatable."""
    mp.start_processes(
        _gpu_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn", join=True
    )
    failures = [line for r in range(2) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
    assert not failures, "\n".join(failures)
