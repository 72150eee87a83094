"""compile_mechanism and calls from several threads: one Mechanism per spec, modules written and imported once,
custom ops defined once, and every thread's result the single-threaded one."""

from __future__ import annotations

import threading

import pytest
import torch
from tiers import SLOW

import relgen
from relgen.runtime import custom_ops
from relgen.runtime import mechanism as runtime

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
THREADS = 8
#: specs no other test compiles, so that their modules and custom ops are new to this process
SPECS = [
    {"name": "threads_clipped", "terms": ["query"], "map": {"kind": "clipped", "min": -6, "max": 6}},
    {"name": "threads_buckets", "terms": ["bias"], "map": {"kind": "t5", "num_buckets": 8, "max_distance": 20}},
    {"name": "threads_identity", "terms": ["key"], "map": {"kind": "identity"}, "heads_share_tables": True},
]
N, D = 16, 16


def _inputs(index: int) -> dict[str, torch.Tensor]:
    """Thread `index`'s inputs for its spec SPECS[index % 3] (leaves; a few threads share a spec, not inputs)."""
    spec = relgen.load_spec(SPECS[index % len(SPECS)])
    gen = torch.Generator().manual_seed(index)
    rows = spec.map.num_rows(N)
    table = (rows, D) if spec.heads_share_tables else (2, rows, D)
    shapes = {"q": (1, 2, N, D), "k": (1, 2, N, D), "v": (1, 2, N, D)}
    shapes.update({"aq": table} if spec.has_query else {"ak": table} if spec.has_key else {"bias": table[:-1]})
    return {name: torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_() for name, shape in shapes.items()}


def _run(index: int) -> tuple[relgen.runtime.mechanism.Mechanism, list[torch.Tensor]]:
    """Compile thread `index`'s spec, call it, and return the Mechanism, the output and every gradient."""
    fn = relgen.compile_mechanism(SPECS[index % len(SPECS)])
    leaves = _inputs(index)
    out = fn(**leaves)
    grads = torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out))
    return fn, [out.detach(), *grads]


@pytest.fixture
def fresh_process_state(tmp_path, monkeypatch):
    """An empty cache directory and no compiled mechanism or imported module: what a new process starts from."""
    monkeypatch.setenv("RELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "_MECHANISMS", {})
    monkeypatch.setattr(runtime, "_COMPILING", {})
    monkeypatch.setattr(runtime, "_MODULES", {})
    return tmp_path


@SLOW
def test_eight_threads_compile_and_call_as_one(fresh_process_state):
    start = threading.Barrier(THREADS)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            start.wait()  # all at once: the compiles race on the same cache files, imports and op names
            results[index] = _run(index)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    by_spec: dict[int, set[int]] = {}
    for index, (fn, _) in results.items():
        by_spec.setdefault(index % len(SPECS), set()).add(id(fn))
    assert all(len(ids) == 1 for ids in by_spec.values()), "one Mechanism per spec"
    written = sorted(p.name for p in fresh_process_state.iterdir() if p.is_file())  # (and Python's __pycache__)
    assert len(written) == len(SPECS) and all(name.endswith(".py") for name in written), written  # no temp files
    for spec in SPECS:
        stem = next(name for name in custom_ops._REGISTERED if f"_{spec['name']}_" in name)
        assert hasattr(torch.ops.relgen, f"{stem}_forward")

    for index, (_, got) in sorted(results.items()):  # now one thread at a time
        _, want = _run(index)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), f"thread {index}"


def test_calls_from_eight_threads_share_kept_kernels_and_signatures():
    """Calls of one compiled spec from several threads at once, each on its own inputs."""
    fn = relgen.compile_mechanism(SPECS[0])
    want = {index: _run(index)[1] for index in range(0, THREADS, len(SPECS))}
    start = threading.Barrier(len(want))
    got: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                result = _run(index)
                assert result[0] is fn
                got[index] = result[1]
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for index, tensors in want.items():
        assert all(torch.equal(a, b) for a, b in zip(got[index], tensors, strict=True)), f"thread {index}"
