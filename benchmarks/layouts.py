"""The [B, N, H, d] layout, grouped-query attention and wide head dims on a GPU: what each one saves, as a Markdown
table headed by the date, the commit and the GPU.

    python benchmarks/layouts.py [--spec shaw] [--seq-lens 1024,8192] [--heads 16] [--kv-heads 4] [--tokens 16384]

Rows (fp16; batch = tokens // N; times are medians of triton.testing.do_bench, forward and forward + backward):

  layout    relgen on [B, N, H, d] tensors in place (layout="bnhd"), against what a caller holding them paid before:
            a transpose to contiguous [B, H, N, d], the call, and the output transposed back; and against a
            [B, H, N, d] call (the kernels' own layout, no copy)
  gqa       relgen with H_kv key/value heads, against the same call with k and v repeated to H heads
            (repeat_interleave, whose backward sums dK and dV over each group)
  head dim  relgen at d = 96 and d = 256, against plain SDPA (no relative terms) at the same shape

A name in --spec is a shipped spec (specs/NAME.yaml) or a path to a spec file.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton

import relgen

ROOT = Path(__file__).resolve().parent.parent
DTYPE = torch.float16


def commit() -> str:
    """The checked-out commit, with '+changes' when tracked files differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def timed(run: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of `run`, the backward for a fixed dO."""
    do = torch.randn_like(run())

    def both() -> None:
        torch.autograd.grad(run(), leaves, do)

    with torch.no_grad():
        forward = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
    return forward, triton.testing.do_bench(both, warmup=25, rep=100, return_mode="median")


def tables(spec, n: int, heads: int, d: int) -> dict[str, torch.Tensor]:
    rows = spec.map.num_rows(n)
    shape = (rows, d) if spec.heads_share_tables else (heads, rows, d)
    made = {}
    for term, name in (("query", "aq"), ("key", "ak")):
        if term in spec.terms:
            made[name] = (0.5 * torch.randn(shape, device="cuda", dtype=DTYPE)).requires_grad_()
    if "bias" in spec.terms:
        made["bias"] = torch.randn(shape[:-1], device="cuda", dtype=DTYPE).requires_grad_()
    return made


def tensors(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(shape, device="cuda", dtype=DTYPE).requires_grad_() for shape in shapes]


def layout_rows(fn, spec, n: int, b: int, h: int, d: int) -> list[tuple]:
    t = tables(spec, n, h, d)
    q, k, v = tensors(*[(b, n, h, d)] * 3)
    in_place = timed(lambda: fn(q, k, v, **t, layout="bnhd"), [q, k, v])

    def copied() -> torch.Tensor:
        args = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        return fn(*args, **t).transpose(1, 2).contiguous()

    before = timed(copied, [q, k, v])
    qh, kh, vh = tensors(*[(b, h, n, d)] * 3)
    heads_major = timed(lambda: fn(qh, kh, vh, **t), [qh, kh, vh])
    shape = f"B={b} H={h} d={d}"
    return [
        ("layout", n, shape, 'layout="bnhd", in place', *in_place, "transpose + copy, bhnd call", *before),
        ("layout", n, shape, 'layout="bhnd" (kernels\' own)', *heads_major, 'layout="bnhd", in place', *in_place),
    ]


def gqa_rows(fn, spec, n: int, b: int, h: int, h_kv: int, d: int) -> list[tuple]:
    t = tables(spec, n, h, d)
    q, k, v = tensors((b, h, n, d), (b, h_kv, n, d), (b, h_kv, n, d))
    grouped = timed(lambda: fn(q, k, v, **t), [q, k, v])

    def repeated() -> torch.Tensor:
        return fn(q, k.repeat_interleave(h // h_kv, dim=1), v.repeat_interleave(h // h_kv, dim=1), **t)

    full = timed(repeated, [q, k, v])
    shape = f"B={b} H={h} H_kv={h_kv} d={d}"
    return [("gqa", n, shape, "k, v with H_kv heads", *grouped, "k, v repeated to H heads", *full)]


def head_dim_rows(fn, spec, n: int, b: int, h: int, d: int) -> list[tuple]:
    t = tables(spec, n, h, d)
    q, k, v = tensors(*[(b, h, n, d)] * 3)
    ours = timed(lambda: fn(q, k, v, **t), [q, k, v])
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), [q, k, v])
    return [("head dim", n, f"B={b} H={h} d={d}", "relgen", *ours, "SDPA (no relative terms)", *sdpa)]


def rows_at(fn, spec, n: int, b: int, h: int, h_kv: int) -> Iterator[tuple]:
    """The table's rows at length n, each case as soon as it is measured (a run cut short keeps what it reached)."""
    yield from layout_rows(fn, spec, n, b, h, 64)
    yield from gqa_rows(fn, spec, n, b, h, h_kv, 64)
    for d in (96, 256):
        yield from head_dim_rows(fn, spec, n, b, h, d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="shaw")
    parser.add_argument("--seq-lens", default="1024,8192")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens // N")
    args = parser.parse_args()
    path = Path(args.spec) if args.spec.endswith((".yaml", ".yml")) else ROOT / "specs" / f"{args.spec}.yaml"
    spec = relgen.load_spec(path)
    fn = relgen.compile_mechanism(spec)
    h = args.heads
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{spec.name}, fp16, {now}, commit {commit()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}\n")  # fmt: skip
    print("| case | N | shape | call | fwd ms | fwd+bwd ms | against | fwd ms | fwd+bwd ms | fwd+bwd ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for n in (int(x) for x in args.seq_lens.split(",")):
        for row in rows_at(fn, spec, n, max(1, args.tokens // n), h, args.kv_heads):
            name, n_, shape, ours, fwd, both, other, other_fwd, other_both = row
            print(f"| {name} | {n_} | {shape} | {ours} | {fwd:.3f} | {both:.3f} | {other} | {other_fwd:.3f} | "
                  f"{other_both:.3f} | {other_both / both:.2f}× |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
