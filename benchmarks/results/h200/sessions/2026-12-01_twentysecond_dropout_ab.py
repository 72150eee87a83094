"""Twenty-second session: attention dropout's cost, four draws per Philox call (relgen.dropout, landed) against
one per score (the previous stream), in one process on the same kernels otherwise.

The generated module is loaded twice: as built, and with its `relgen.dropout` import pointed at PER_SCORE below
(the previous code's per-score `tl.rand`, behind the new signature), so the two differ only in the random draws.
Beside them the same call without dropout. The benchmark's problem (16K tokens, H = 12, d = 64, fp16), a new int
seed per call, triton.testing.do_bench medians, rounds in alternating order.

    python3 …_dropout_ab.py --specs t5,deberta_v3 --seq-lens 1024 [--rounds 2] > records.jsonl
"""

import argparse
import importlib.util
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from profile_kernels import inputs

PER_SCORE = """
import triton
import triton.language as tl

from relgen.dropout import seed_value


@triton.jit
def dropout_keep(seed, bh, offs_m, j_first, Nq, Nk, dropout_p, BLOCK_N: tl.constexpr, DESCENDING: tl.constexpr,
                 KEY_MAJOR: tl.constexpr):
    u = tl.arange(0, BLOCK_N)
    if DESCENDING:
        j = j_first - u
    else:
        j = j_first + u
    if KEY_MAJOR:
        counter = (bh.to(tl.int64) * Nq + offs_m[None, :]) * Nk + j[:, None]
    else:
        counter = (bh.to(tl.int64) * Nq + offs_m[:, None]) * Nk + j[None, :]
    return tl.rand(seed, counter) >= dropout_p
"""
IMPORT = "from relgen.dropout import dropout_keep, seed_value"


def per_score_module(module, folder: Path):
    """The generated module again, drawing one number per score."""
    (folder / "per_score_dropout.py").write_text(PER_SCORE)
    source = Path(module.__file__).read_text()
    assert source.count(IMPORT) == 1, "the generated module's import of relgen.dropout moved"
    path = folder / f"{module.__name__}_per_score.py"
    path.write_text(source.replace(IMPORT, "from per_score_dropout import dropout_keep, seed_value"))
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def measure(name: str, n: int, rounds: int, p: float, folder: Path) -> list[dict]:
    fn, qkv, tables = inputs(name, n)
    leaves = [*qkv, *tables.values()]
    do = torch.randn_like(qkv[0])
    seeds = itertools.count(1)
    variants = {
        "four_per_call": (fn.module.attention, p),
        "one_per_score": (per_score_module(fn.module, folder).attention, p),
        "no_dropout": (fn.module.attention, 0.0),
    }

    def call(variant):
        attention, dropout_p = variants[variant]
        return attention(*qkv, **tables, dropout_p=dropout_p, dropout_seed=next(seeds) if dropout_p else None)

    passes = {"fwd": lambda v: lambda: call(v), "step": lambda v: lambda: torch.autograd.grad(call(v), leaves, do)}
    for variant in variants:  # compile
        passes["step"](variant)()
    records = []
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else reversed(list(variants)):
            for kind, make in passes.items():
                ms = triton.testing.do_bench(make(variant), warmup=25, rep=100)
                records.append(
                    {
                        "mechanism": name,
                        "seq_len": n,
                        "variant": variant,
                        "pass": kind,
                        "ms": ms,
                        "dropout_p": variants[variant][1],
                        "round": r,
                    }
                )
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--specs", default="t5,deberta_v3")
    parser.add_argument("--seq-lens", default="1024")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--p", type=float, default=0.1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for name in args.specs.split(","):
            for n in map(int, args.seq_lens.split(",")):
                for record in measure(name, n, args.rounds, args.p, Path(folder)):
                    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
