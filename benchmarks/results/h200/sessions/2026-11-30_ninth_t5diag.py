"""T5's backward at N = 128 and 256: the benchmark's own problem (fp16 bias) timed as the benchmark times it, then
the same with the bias table in fp32 (the tuner's inputs), each with a per-kernel profile."""

import json

import torch
import triton

from relgen.bench.cli import data_seed
from relgen.bench.common import resolve_spec
from relgen.bench.peers import build_system, make_problem

spec, _ = resolve_spec("t5")
for n in (128, 256):
    for bias_dtype in ("fp16", "fp32"):
        p = make_problem(spec, n, 16384 // n, 12, 64, torch.float16, "cuda", data_seed("t5", n))
        if bias_dtype == "fp32":
            p.bias = p.bias.detach().float().requires_grad_(True)
        built = build_system("relgen", p, "max-autotune", None)
        tensors = [t for _, t in built.inputs]
        out = built.forward()

        def run(out=out, tensors=tensors, d_out=p.d_out):
            return torch.autograd.grad(out, tensors, d_out, retain_graph=True)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        bwd = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        fwd = triton.testing.do_bench(built.forward, warmup=25, rep=200, return_mode="median")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                run()
            torch.cuda.synchronize()
        kernels = {
            e.key: round(e.device_time_total / 10 / 1e3, 4) for e in prof.key_averages() if e.device_time_total > 0
        }
        print(
            json.dumps(
                {
                    "seq_len": n,
                    "bias": bias_dtype,
                    "fwd_ms": fwd,
                    "bwd_ms": bwd,
                    "inputs": [(nm, str(t.dtype), list(t.shape)) for nm, t in built.inputs],
                    "kernels_ms": kernels,
                }
            ),
            flush=True,
        )
