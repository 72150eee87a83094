"""Quick relgen-only timing on a GPU (a development aid; the benchmark that compares peers is `relgen bench`).

python benchmarks/quick_timing.py [--seq-lens 1024,8192] [--specs shaw,txl,deberta_v3,t5] [--json OUT] [--check]
    [--descriptors] [--dropout P] [--tiles forward.num_warps=8 ...]

A name in --specs is a shipped spec (specs/NAME.yaml) or a path to a spec file. --check adds "exact": the same
kernels (batch 1, two heads, fp16) against the FP64 reference, output and every gradient (relgen.check.verify);
with --descriptors, the check's calls take the tensor-descriptor paths whatever their size
(relgen.runtime.descriptors.forced), as the timed calls of 16K tokens at N ≥ 2K do. --dropout P times the calls with
attention dropout at rate P (a fixed seed: the kernels' work does not depend on it). --tiles times the kernels with the
tiles they would pick at each length, changed as given (KernelConfig.with_changes); --check then checks those tiles.
Under a tile override every call is checked in full (prepare_call keeps no signature then): at N ≤ 1K the times
include that host work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
import triton

import relgen
from relgen.check.verify import check_spec, make_inputs
from relgen.runtime import descriptors
from relgen.tiles.select import changed_tiles

ROOT = Path(__file__).resolve().parent.parent


def spec_path(name: str) -> Path:
    return Path(name) if name.endswith(".yaml") else ROOT / "specs" / f"{name}.yaml"


def measure(
    name: str, n: int, tokens: int = 16384, h: int = 12, d: int = 64, dtype=torch.float16, dropout: float = 0.0
) -> dict:
    spec = relgen.load_spec(spec_path(name))
    b = max(1, tokens // n)
    rows = spec.map.num_rows(n)
    # every table in the inputs' dtype, as the benchmark's
    made = make_inputs(spec, b=b, h=h, nq=n, d=d, dtype=dtype, device="cuda", bias_dtype=dtype)
    q, k, v, tables = made.q, made.k, made.v, made.tables
    mechanism = relgen.compile_mechanism(spec)
    options = {"dropout_p": dropout, "dropout_seed": 1234} if dropout else {}

    def fn(*args, **kwargs):
        return mechanism(*args, **kwargs, **options)

    t = time.time()
    out = fn(q, k, v, **tables)
    leaves = [q, k, v, *tables.values()]
    do = torch.randn_like(out)
    torch.autograd.grad(out, leaves, do, retain_graph=True)
    torch.cuda.synchronize()
    compile_s = time.time() - t
    fwd = triton.testing.do_bench(lambda: fn(q, k, v, **tables), warmup=25, rep=100, return_mode="median")
    bwd = triton.testing.do_bench(
        lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), warmup=25, rep=100, return_mode="median"
    )
    projections = int(spec.has_query) + int(spec.has_key)
    flops = 4 * b * h * n * n * d + 2 * b * h * n * rows * d * projections
    with torch.no_grad():
        qs, ks, vs = q.detach(), k.detach(), v.detach()
        sdpa = triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs),
            warmup=25,
            rep=100,
            return_mode="median",
        )
    return {
        "spec": name,
        "seq_len": n,
        "batch": b,
        "compile_s": round(compile_s, 1),
        "fwd_ms": fwd,
        "bwd_ms": bwd,
        "fwd_tflops": flops / fwd * 1e-9,
        "bwd_tflops": 2 * flops / bwd * 1e-9,
        "sdpa_fwd_ms": sdpa,
        **({"dropout_p": dropout} if dropout else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", default="1024,8192")
    parser.add_argument("--specs", default="shaw,txl,deberta_v3,t5")
    parser.add_argument("--json", default=None)
    parser.add_argument("--check", action="store_true", help="also compare with the FP64 reference")
    parser.add_argument("--descriptors", action="store_true", help="the check with descriptors forced on")
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout rate of the timed calls")
    parser.add_argument("--tiles", nargs="*", default=[], metavar="PART.FIELD=N", help="e.g. forward.num_warps=8")
    args = parser.parse_args()
    rows = []
    for name in args.specs.split(","):
        for n in (int(x) for x in args.seq_lens.split(",")):
            try:
                plan = relgen.compile_mechanism(relgen.load_spec(spec_path(name))).module.PLAN
                with changed_tiles(plan, torch.float16, 64, n, args.tiles):
                    r = measure(name, n, dropout=args.dropout)
                    if args.check:
                        with descriptors.forced(True) if args.descriptors else contextlib.nullcontext():
                            checked = check_spec(spec_path(name), [n], "cuda")
                        r["exact"] = all(c.ok for c in checked)
                        r["failed"] = [f"{c.tensor}: {c.message}" for c in checked if not c.ok]
                if args.tiles:
                    r["tiles"] = args.tiles
            except Exception as err:  # report and go on: one broken kernel must not hide the others
                r = {"spec": name, "seq_len": n, "error": f"{type(err).__name__}: {err}"[:400]}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
