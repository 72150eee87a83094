"""Where a relgen call spends its time on the GPU: per-kernel CUDA time (torch.profiler), the host-side cost of
one call, and optionally a sweep of forward / backward tiles. A development aid (the peer comparison is
`relgen bench`); writes one JSON line per measurement.

python benchmarks/profile_kernels.py [--seq-lens 1024,8192] [--specs shaw,txl,deberta_v3,t5] [--sweep] [--json F]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import triton

import relgen
from relgen.check.verify import make_inputs
from relgen.tiles.configs import AttnTiles, default_config
from relgen.tiles.select import override_config

ROOT = Path(__file__).resolve().parent.parent
TOKENS, HEADS, HEAD_DIM = 16384, 12, 64
FORWARD_SWEEP = ((128, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3))
BACKWARD_SWEEP = ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 2))


def inputs(name: str, n: int, batch: int | None = None, heads: int = HEADS):
    spec = relgen.load_spec(ROOT / "specs" / f"{name}.yaml")
    b = batch or max(1, TOKENS // n)
    made = make_inputs(
        spec, b=b, h=heads, nq=n, d=HEAD_DIM, dtype=torch.float16, device="cuda", bias_dtype=torch.float16
    )
    return relgen.compile_mechanism(spec), (made.q, made.k, made.v), made.tables


def kernel_times(run, iters: int = 5) -> dict[str, float]:
    """Mean CUDA time per call of each kernel (ms), by kernel name."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_time_total > 0:
            totals[evt.key[:60]] += evt.device_time_total / 1000 / iters
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def host_ms(fn, qkv, tables, calls: int = 200) -> float:
    """Wall time per forward call on a problem too small for the GPU to be the bottleneck."""
    with torch.no_grad():
        for _ in range(10):
            fn(*qkv, **tables)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn(*qkv, **tables)
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1000


def host_profile(fn, qkv, tables, calls: int = 200) -> list[str]:
    """The Python functions a forward call spends its host time in (cProfile, by own time)."""
    with torch.no_grad():
        fn(*qkv, **tables)
        torch.cuda.synchronize()
        return profile_calls(lambda: fn(*qkv, **tables), calls)


def profile_calls(run, calls: int = 200, rows: int = 25, sync_every: int | None = None) -> list[str]:
    """cProfile of `calls` calls of `run`: the `rows` functions with the most own time, per call. sync_every: a
    sync after every so many calls, so that a full launch queue (the GPU behind) does not show up as the host's
    time in whichever launch waited for it (the syncs' own time is then listed as such)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(calls):
        run()
        if sync_every and (i + 1) % sync_every == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    profiler.disable()
    ranked = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in pstats.Stats(profiler).stats.items():
        ranked.append(
            (
                tottime,
                f"{tottime / calls * 1e6:8.1f} us own {cumtime / calls * 1e6:8.1f} us cum "
                f"{ncalls // calls:3d}x {Path(path).name}:{line}({name})",
            )
        )
    return [text for _, text in sorted(ranked, reverse=True)[:rows]]


def bench(run) -> float:
    return triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median")


def profile(name: str, n: int, sweep: bool, host: bool = False) -> list[dict]:
    fn, (q, k, v), tables = inputs(name, n)
    leaves = [q, k, v, *tables.values()]
    out = fn(q, k, v, **tables)
    do = torch.randn_like(out)

    def fwd():
        return fn(q, k, v, **tables)

    def bwd():
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    records = [
        {"spec": name, "seq_len": n, "what": "fwd_kernels", "ms": kernel_times(fwd), "total_ms": bench(fwd)},
        {"spec": name, "seq_len": n, "what": "bwd_kernels", "ms": kernel_times(bwd), "total_ms": bench(bwd)},
    ]
    if sweep:
        base = default_config(torch.float16, HEAD_DIM, n)
        for tiles in FORWARD_SWEEP:
            cfg = replace(base, forward=AttnTiles(*tiles))
            try:
                with override_config(cfg):
                    ms = bench(fwd)
            except Exception as err:  # out of resources: record and go on
                ms = f"{type(err).__name__}: {str(err)[:120]}"
            records.append({"spec": name, "seq_len": n, "what": "fwd_tiles", "tiles": tiles, "ms": ms})
        for tiles in BACKWARD_SWEEP:
            cfg = replace(base, backward=AttnTiles(*tiles))
            try:
                with override_config(cfg):
                    out2 = fn(q, k, v, **tables)
                    ms = bench(lambda o=out2: torch.autograd.grad(o, leaves, do, retain_graph=True))
            except Exception as err:
                ms = f"{type(err).__name__}: {str(err)[:120]}"
            records.append({"spec": name, "seq_len": n, "what": "bwd_tiles", "tiles": tiles, "ms": ms})
    small_fn, small_qkv, small_tables = inputs(name, 128, batch=1, heads=1)
    records.append(
        {"spec": name, "seq_len": 128, "what": "host_ms_per_fwd_call", "ms": host_ms(small_fn, small_qkv, small_tables)}
    )
    if host:
        top = host_profile(small_fn, small_qkv, small_tables)
        records.append({"spec": name, "seq_len": 128, "what": "host_profile", "top": top})
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", default="1024,8192")
    parser.add_argument("--specs", default="shaw,txl,deberta_v3,t5")
    parser.add_argument("--sweep", action="store_true", help="also time the forward / backward tile candidates")
    parser.add_argument("--host-profile", action="store_true", help="also cProfile the host side of a small call")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name in args.specs.split(","):
        for n in (int(x) for x in args.seq_lens.split(",")):
            try:
                longest = n == max(int(x) for x in args.seq_lens.split(","))
                recs = profile(name, n, args.sweep and longest, args.host_profile and longest)
            except Exception as err:  # one broken kernel must not hide the others
                recs = [{"spec": name, "seq_len": n, "error": f"{type(err).__name__}: {err}"[:400]}]
            for r in recs:
                print(json.dumps(r), flush=True)
            rows += recs
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
