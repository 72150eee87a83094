"""relgen called eagerly against the same call inside torch.compile (its custom ops, relgen.runtime.custom_ops), with
and without CUDA graphs, on the benchmark's problem (16K tokens, H = 12, d = 64, fp16).

At N ≤ 1K an eager call is host-bound on the H200 (docs/performance.md, host time: the host takes as long as the
kernels); under torch.compile(mode="reduce-overhead") the calls are captured once into a CUDA graph and replayed
with no host work per kernel, which is what such lengths need. The inputs are marked static, as activations
computed inside a model's graph are (a graph input is copied into the CUDA graph's own buffer at every replay:
+50–60 µs per forward at 16K tokens as measured on the H200). Times are
triton.testing.do_bench medians (L2 flushed) of the forward alone and of a step (forward, then every gradient),
one process per (spec, N), systems in alternating order, every compiled result checked bit for bit against the
eager call first.

With `--dropout P` every call draws a new seed, as a training step does: an int for the eager and the compiled
calls, a one-element tensor updated in place before each step for CUDA graphs (which would replay an int).

    python benchmarks/compiled_calls.py --specs t5,shaw --seq-lens 128,256,512,1024 [--dropout 0.1] [--out FILE.jsonl]
    python benchmarks/compiled_calls.py --report FILE.jsonl [FILE.jsonl ...] > compiled_calls.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_kernels import inputs

MODES = {"eager": None, "compile": "default", "compile_cudagraphs": "reduce-overhead"}


def measure(spec: str, n: int, rounds: int, dropout: float = 0.0) -> list[dict]:
    fn, qkv, tables = inputs(spec, n)
    leaves = [*qkv, *tables.values()]
    seed_tensor = torch.zeros(1, dtype=torch.int64, device=qkv[0].device)
    for t in [*leaves, seed_tensor]:  # as activations made inside a model's graph: CUDA graphs would otherwise
        torch._dynamo.mark_static_address(t)  # copy each input into their own buffer at every replay (~50 µs)
    do = torch.randn_like(qkv[0])
    calls = {
        name: fn if mode is None else torch.compile(lambda *a, **kw: fn(*a, **kw), mode=mode, fullgraph=True)
        for name, mode in MODES.items()
    }
    seeds = itertools.count(1)

    def options(name: str, seed: int | None = None) -> dict:
        """The call's dropout options: a new seed per call unless given."""
        if not dropout:
            return {}
        seed = next(seeds) if seed is None else seed
        if name == "compile_cudagraphs":
            seed_tensor.fill_(seed)
            return {"dropout_p": dropout, "dropout_seed": seed_tensor}
        return {"dropout_p": dropout, "dropout_seed": seed}

    def forward(name, seed=None):
        def run():
            torch.compiler.cudagraph_mark_step_begin()
            return calls[name](*qkv, **tables, **options(name, seed))

        return run

    def step(name, seed=None):
        def run():
            torch.compiler.cudagraph_mark_step_begin()
            return torch.autograd.grad(calls[name](*qkv, **tables, **options(name, seed)), leaves, do)

        return run

    for seed in (1234, 1235):  # (with dropout, a second seed: an int seed's recompilation happens here)
        want = step("eager", seed)()
        for name in calls:  # compiles, captures; then the result must be the eager one
            for _ in range(3):
                got = step(name, seed)()
            exact = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            assert exact, f"{spec} N={n}: {name} differs from the eager call"
    records = []
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(reversed(calls))
        for name in order:
            for kind, make in (("fwd", forward), ("step", step)):
                ms = triton.testing.do_bench(make(name), warmup=25, rep=200)
                record = {"mechanism": spec, "seq_len": n, "system": name, "pass": kind, "ms": ms, "round": r}
                records.append({**record, **({"dropout_p": dropout} if dropout else {})})
    return records


def report(paths: list[Path]) -> str:
    """The records as a Markdown table: ms per call (each round's median, rounds joined by /)."""
    times: dict[tuple, list[float]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "ms" in r:
                kind = r["pass"] + (f", dropout {r['dropout_p']}" if r.get("dropout_p") else "")
                times.setdefault((r["mechanism"], r["seq_len"], kind, r["system"]), []).append(r["ms"])
    cases = sorted(
        {key[:3] for key in times}, key=lambda c: (c[0], c[1], "dropout" in c[2], not c[2].startswith("fwd"))
    )
    lines = [
        "| mechanism | N | pass | " + " | ".join(MODES) + " | eager / CUDA graphs |",
        "|---|---|---|" + "---|" * (len(MODES) + 1),
    ]
    for case in cases:
        cells = ["/".join(f"{ms:.3f}" for ms in times.get((*case, system), [])) for system in MODES]
        eager, graphs = times.get((*case, "eager")), times.get((*case, "compile_cudagraphs"))
        ratio = f"{min(eager) / min(graphs):.2f}×" if eager and graphs else ""
        lines.append(f"| {case[0]} | {case[1]} | {case[2]} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="t5,shaw,txl,deberta_v3")
    parser.add_argument("--seq-lens", default="128,256,512,1024,4096")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p, a new seed per call")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help="(internal) spec:N measured in this process")
    parser.add_argument("--report", type=Path, nargs="+", help="print these records as a Markdown table")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return
    if args.one:
        spec, n = args.one.split(":")
        for record in measure(spec, int(n), args.rounds, args.dropout):
            print(json.dumps(record), flush=True)
        return
    for spec in args.specs.split(","):
        for n in map(int, args.seq_lens.split(",")):
            cmd = [sys.executable, __file__, "--one", f"{spec}:{n}", "--rounds", str(args.rounds)]
            cmd += ["--dropout", str(args.dropout)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
            if run.returncode != 0:
                lines.append(json.dumps({"mechanism": spec, "seq_len": n, "error": run.stderr[-2000:]}))
            for line in lines:
                print(line, flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(line + "\n")


if __name__ == "__main__":
    main()
