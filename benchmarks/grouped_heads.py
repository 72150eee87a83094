"""Where grouped-query attention's step goes on a GPU: per-kernel CUDA times (torch.profiler, the mean of --steps
steps) of one forward + backward with k and v of H heads, of H_kv heads, and of those H_kv heads repeated to H
(repeat_interleave, whose backward sums dK and dV over each group). A development aid beside
benchmarks/layouts.py, which times the same three calls end to end.

    python benchmarks/grouped_heads.py [--spec shaw] [--seq-len 8192] [--batch 2] [--heads 16] [--kv-heads 4]
        [--head-dim 64] [--key-tiles BMxBN[xWARPSxSTAGES[xKEY_MAJORxGROUP_SPLIT]]] [--group-split S]

--key-tiles replaces the key pass's tiles for all three calls (relgen.tiles.select.override_config), --group-split
only their AttnTiles.group_split (a group's heads over S programs per key tile; 0: as relgen.tiles.grid chooses).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

import relgen
from relgen.check.verify import make_inputs
from relgen.tiles.configs import AttnTiles
from relgen.tiles.grid import cdiv, group_splits
from relgen.tiles.select import override_config, select_config

ROOT = Path(__file__).resolve().parent.parent


def kernel_times(step, steps: int) -> dict[str, float]:
    """Mean CUDA ms per step of each kernel, by name, largest first."""
    step()  # compiled and warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_time_total > 0:
            totals[event.key[:48]] += event.device_time_total / 1000 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="shaw")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--key-tiles", default=None, help="BMxBN[xWARPSxSTAGES[xKEY_MAJORxGROUP_SPLIT]] (AttnTiles)")
    parser.add_argument("--group-split", type=int, default=None, help="the key pass's group_split (0: by the grid)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grouped_heads.py: no CUDA GPU")
    if args.heads % args.kv_heads:
        raise SystemExit(f"--kv-heads: expected a divisor of --heads ({args.heads}), got {args.kv_heads}")
    spec = relgen.load_spec(ROOT / "specs" / f"{args.spec}.yaml")
    fn = relgen.compile_mechanism(spec)
    made = make_inputs(spec, b=args.batch, h=args.heads, nq=args.seq_len, d=args.head_dim, dtype=torch.float16,
                       device="cuda")  # fmt: skip
    q, k, v, tables = made.q, made.k, made.v, made.tables
    k_kv, v_kv = (t.detach()[:, : args.kv_heads].clone().requires_grad_() for t in (k, v))
    group = args.heads // args.kv_heads
    cases = {
        f"{args.heads} heads": lambda: (k, v),
        f"{args.kv_heads} key/value heads": lambda: (k_kv, v_kv),
        "repeated": lambda: (k_kv.repeat_interleave(group, 1), v_kv.repeat_interleave(group, 1)),
    }
    config = select_config(fn.module.PLAN, torch.float16, args.head_dim, args.seq_len)
    if args.key_tiles:
        config = replace(config, backward_kv=AttnTiles(*(int(x) for x in args.key_tiles.split("x"))))
    if args.group_split is not None:
        config = replace(config, backward_kv=replace(config.key_pass, group_split=args.group_split))
    programs = cdiv(args.seq_len, config.key_pass.block_n) * args.batch * args.kv_heads
    split = group_splits(config.key_pass.group_split, group, programs, torch.device("cuda"), fn.module.WHOLE_GROUPS)
    print(f"{args.spec}, fp16, B={args.batch} H={args.heads} H_kv={args.kv_heads} N={args.seq_len} "
          f"d={args.head_dim}; key pass {config.key_pass}, {split} part(s) a group")  # fmt: skip
    with override_config(config):
        for name, kv in cases.items():

            def step(kv=kv) -> None:
                out = fn(q, *kv(), **tables)
                out.backward(torch.ones_like(out))

            times = kernel_times(step, args.steps)
            print(f"\n{name}: {sum(times.values()):.3f} ms a step")
            for kernel, ms in times.items():
                if ms >= 0.01:
                    print(f"  {kernel:48s} {ms:7.3f}")


if __name__ == "__main__":
    main()
