"""One relgen call at the benchmark's shape, taken apart on the GPU: host time per call, GPU time of its kernels,
and what `relgen bench` reads (do_bench, L2 flushed), with the launch fast path and the TMA descriptors each
switchable. At N ≤ 1K the benchmark reads the host path; run each configuration in a fresh process, as the
benchmark does, and several times (the host's cost per call varies between processes).

    python benchmarks/host_path.py --spec t5 --seq-len 512 [--triton-launch] [--no-descriptors] [--profile]

Prints one JSON line: host_us_fwd / host_us_bwd (wall time per call over calls issued without a sync, as many
as the benchmark's host_ms issues: host_calls), gpu_ms_fwd / gpu_ms_bwd (the kernels' CUDA time, torch.profiler;
kernels_fwd / kernels_bwd per kernel), bench_ms_fwd / bench_ms_bwd (triton.testing.do_bench median), the CPU the
process ran on and the load average; with --profile, profile_fwd / profile_bwd (cProfile, per call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

import relgen
import relgen.runtime.descriptors
from relgen.bench.worker import host_ms, queued_calls
from relgen.runtime.launch import Launcher

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_kernels import inputs, kernel_times, profile_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--triton-launch", action="store_true", help="every launch through Triton's own path")
    parser.add_argument("--no-descriptors", action="store_true", help="no TMA descriptors (pointer loads)")
    parser.add_argument("--profile", action="store_true", help="add a cProfile of 200 forwards and backwards")
    args = parser.parse_args()
    if args.triton_launch:
        Launcher.launch = lambda self, grid, a, kw: self.kernel[grid](*a, **kw)
    relgen.runtime.descriptors.enabled = not args.no_descriptors

    n = args.seq_len
    fn, qkv, tables = inputs(args.spec, n)  # the benchmark's problem: 16K tokens, 12 heads, d = 64, fp16 tables
    leaves = [*qkv, *tables.values()]  # make_inputs' leaves require grad

    def forward():
        return fn(*qkv, **tables)

    out = forward()
    do = torch.randn_like(out)

    def backward():
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    for _ in range(20):
        forward()
        backward()
    kernels_fwd, kernels_bwd = kernel_times(forward, iters=10), kernel_times(backward, iters=10)
    # as many calls as the benchmark's host_ms issues: ~20 ms of GPU work at most, or a full launch queue makes
    # the host wait for the GPU and the figure is the GPU's (the first version issued 200 backwards: ~0.6 s)
    calls_fwd = queued_calls(sum(kernels_fwd.values()))
    calls_bwd = queued_calls(sum(kernels_bwd.values()))
    record = {
        "spec": args.spec,
        "seq_len": n,
        "launch": "triton" if args.triton_launch else "relgen",
        "descriptors": not args.no_descriptors,
        "host_us_fwd": host_ms(forward, torch.device("cuda"), calls_fwd) * 1e3,
        "host_us_bwd": host_ms(backward, torch.device("cuda"), calls_bwd) * 1e3,
        "host_calls": [calls_fwd, calls_bwd],
        "gpu_ms_fwd": sum(kernels_fwd.values()),
        "gpu_ms_bwd": sum(kernels_bwd.values()),
        "kernels_fwd": {name: round(ms, 5) for name, ms in kernels_fwd.items()},
        "kernels_bwd": {name: round(ms, 5) for name, ms in kernels_bwd.items()},
        "bench_ms_fwd": triton.testing.do_bench(forward, warmup=50, rep=100, return_mode="median"),
        "bench_ms_bwd": triton.testing.do_bench(backward, warmup=50, rep=100, return_mode="median"),
        "cpu": int(Path("/proc/self/stat").read_text().split()[38]),
        "load": os.getloadavg()[0],
    }
    if args.profile:
        record["profile_fwd"] = profile_calls(forward, rows=25, sync_every=calls_fwd)
        record["profile_bwd"] = profile_calls(backward, rows=40, sync_every=calls_bwd)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
