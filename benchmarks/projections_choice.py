"""The `projections=` choice on a GPU: for each length, the strategy "auto" runs, the peak memory each strategy
allocates beyond the inputs against relgen.runtime.memory.projection_memory's figures (what `relgen explain`
prints), the time of a forward and of a forward + backward per strategy, and the host time "auto" adds to a short
call (its choice is kept per kind of call).

    python benchmarks/projections_choice.py [--spec specs/txl.yaml] [--seq-lens 1024,8192,32768] [--batch 1]
        [--heads 12] [--head-dim 64] [--strategies stored,tiled,auto] [--budget 20GiB]

One JSON line per (length, strategy): seq_len, strategy, runs (what "auto" chose), model_fwd / model_bwd (the
model's bytes for that strategy), peak_fwd (torch.cuda.max_memory_allocated beyond the inputs and the output,
without autograd), peak_bwd (beyond the inputs and dO, with O, the LSE and the gradients, which the model leaves
out: both strategies need them), fwd_ms, fwd_bwd_ms; then one line: the per-call host time of "stored" and "auto"
at the shortest length without autograd (200 calls each after warm-up, the launches queueing: host-bound). A
strategy whose memory does not fit the device is reported with "error": "out of memory".
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import relgen
from relgen.check.verify import make_inputs
from relgen.runtime import memory

DTYPE = torch.float16


def _timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def measure(fn, spec, n: int, batch: int, heads: int, head_dim: int, strategy: str) -> dict:
    inputs = make_inputs(spec, b=batch, h=heads, nq=n, d=head_dim, dtype=DTYPE, device="cuda", seed=n)
    args, tables = (inputs.q, inputs.k, inputs.v), inputs.tables
    geo = fn.geometry(fn.module_for(n), *args, tables.get("aq"), tables.get("ak"), tables.get("bias"), {})
    model = memory.projection_memory(geo)
    row = {"seq_len": n, "strategy": strategy, "runs": fn.strategy(*args, **tables, projections=strategy)}
    ran = row["runs"]
    row["model_fwd"], row["model_bwd"] = model.of(ran, False), model.of(ran, True)
    do = torch.randn_like(inputs.q)
    try:
        with torch.no_grad():
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = fn(*args, **tables, projections=strategy)
            torch.cuda.synchronize()
            row["peak_fwd"] = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
            del out
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args, **tables, projections=strategy)
        torch.autograd.grad(out, list(inputs.leaves.values()), do)
        torch.cuda.synchronize()
        row["peak_bwd"] = torch.cuda.max_memory_allocated() - base
        del out
        with torch.no_grad():
            row["fwd_ms"] = _timed(lambda: fn(*args, **tables, projections=strategy))

        def step():
            o = fn(*args, **tables, projections=strategy)
            torch.autograd.grad(o, list(inputs.leaves.values()), do)

        row["fwd_bwd_ms"] = _timed(step)
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    torch.cuda.empty_cache()
    return row


def host_time(fn, spec, n: int, batch: int, heads: int, head_dim: int) -> dict:
    inputs = make_inputs(spec, b=batch, h=heads, nq=n, d=head_dim, dtype=DTYPE, device="cuda", seed=1)
    args = (inputs.q, inputs.k, inputs.v)
    result = {"seq_len": n}
    with torch.no_grad():
        for strategy in ("stored", "auto"):
            for _ in range(20):
                fn(*args, **inputs.tables, projections=strategy)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                fn(*args, **inputs.tables, projections=strategy)
            result[f"{strategy}_host_us"] = (time.perf_counter() - start) / 200 * 1e6  # launches queue: host-bound
            torch.cuda.synchronize()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="specs/txl.yaml")
    parser.add_argument("--seq-lens", default="1024,8192,32768")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--strategies", default="stored,tiled,auto")
    parser.add_argument("--budget", default=None, help="relgen.config.set_projection_budget's argument")
    args = parser.parse_args()
    if args.budget is not None:
        memory.set_projection_budget(args.budget)
    spec = relgen.load_spec(args.spec)
    fn = relgen.compile_mechanism(spec)
    lengths = [int(n) for n in args.seq_lens.split(",")]
    print(json.dumps({"budget": memory.projection_budget("cuda"), "origin": memory.budget_origin("cuda")}))
    for n in lengths:
        for strategy in args.strategies.split(","):
            print(json.dumps(measure(fn, spec, n, args.batch, args.heads, args.head_dim, strategy)), flush=True)
    print(json.dumps(host_time(fn, spec, min(lengths), args.batch, args.heads, args.head_dim)))


if __name__ == "__main__":
    main()
