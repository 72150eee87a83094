"""Seventeenth session, call 4: the forward's and backward's host time per call of whichever relgen is first on
sys.path (the call-signature cache of aaedc77 against the tree before it, 71415e8), at the benchmark's shape.

    PYTHONPATH=TREE:$PYTHONPATH python3 2026-11-30_seventeenth_host_ab.py --spec t5 --seq-len 512 --tree new

Prints one JSON line: the median over five batches of the host's wall time per call, each batch as many calls
as keep at most ~20 ms of GPU work queued (so the host never waits for the GPU), synchronized around each batch.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import relgen
from relgen.verify import make_inputs


def host_us(fn, calls: int) -> float:
    batches = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(batches)


def gpu_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--tree", required=True)
    args = parser.parse_args()
    root = Path(relgen.__file__).resolve().parent.parent
    spec = relgen.load_spec(root / "specs" / f"{args.spec}.yaml")
    n, half = args.seq_len, torch.float16
    made = make_inputs(spec, b=max(1, 16384 // n), h=12, nq=n, d=64, dtype=half, device="cuda", bias_dtype=half)
    fn = relgen.compile_mechanism(spec)
    leaves = [made.q, made.k, made.v, *made.tables.values()]
    for t in leaves:
        t.requires_grad_(True)

    def forward():
        return fn(made.q, made.k, made.v, **made.tables)

    out = forward()
    do = torch.randn_like(out)

    def backward():
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    for _ in range(30):
        forward()
        backward()
    # a call's GPU time, then as many calls per batch as ~20 ms of it (at least one, at most 50)
    fwd_calls = max(1, min(50, int(20 / gpu_ms(forward))))
    bwd_calls = max(1, min(50, int(20 / gpu_ms(backward))))
    record = {
        "tree": args.tree,
        "relgen": str(root),
        "spec": args.spec,
        "seq_len": n,
        "host_us_fwd": host_us(forward, fwd_calls),
        "host_us_bwd": host_us(backward, bwd_calls),
        "calls": [fwd_calls, bwd_calls],
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
