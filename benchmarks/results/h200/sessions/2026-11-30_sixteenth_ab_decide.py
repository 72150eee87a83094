"""Sixteenth session, call 1: the rule, fixed before the run, that decides whether the b̃-in-the-table's-dtype
variant (branch btilde2, one line of relgen/geometry.py) replaces the tree's for call 2's benchmark.

    python3 2026-11-30_sixteenth_ab_decide.py DIR   # DIR: host_path.jsonl, quick_{cur,b}_R.json, check_b.json

Adopted ("b") only if all hold: the branch is exact (FP64 reference, every gradient, T5 and T5 decoder at
N = 1000); its kernels' CUDA time for T5's forward at 512 (median over rounds, torch.profiler) is at least 1 %
below the tree's; and no quick timing of T5 (median over rounds) is more than 1 % slower forward or 2 % slower
backward. Prints the figures and the decision; the decision's word is the last line.
"""

import json
import statistics
import sys
from pathlib import Path

d = Path(sys.argv[1])
host = [json.loads(line) for line in (d / "host_path.jsonl").read_text().splitlines() if line.startswith("{")]
quick: dict[tuple[str, str, int], list[dict]] = {}
for tree in ("cur", "b"):
    for f in sorted(d.glob(f"quick_{tree}_*.json")):
        for r in json.loads(f.read_text()):
            if "fwd_ms" in r:
                quick.setdefault((tree, r["spec"], r["seq_len"]), []).append(r)


def med(rows, key):
    return statistics.median(r[key] for r in rows) if rows else float("nan")


reasons = []
gpu = {t: med([r for r in host if r["tree"] == t], "gpu_ms_fwd") for t in ("cur", "b")}
bench = {t: med([r for r in host if r["tree"] == t], "bench_ms_fwd") for t in ("cur", "b")}
print(
    f"T5 fwd 512 kernels' CUDA time: cur {gpu['cur']:.4f} ms, b {gpu['b']:.4f} ms; do_bench cur {bench['cur']:.4f}, "
    f"b {bench['b']:.4f}"
)
if not gpu["b"] <= 0.99 * gpu["cur"]:
    reasons.append("kernels not 1 % faster at 512")
for (tree, spec, n), rows in sorted(quick.items()):
    if tree != "b":
        continue
    cur = quick.get(("cur", spec, n), [])
    fb, fc, bb, bc = med(rows, "fwd_ms"), med(cur, "fwd_ms"), med(rows, "bwd_ms"), med(cur, "bwd_ms")
    print(f"{spec} {n}: fwd cur {fc:.4f} b {fb:.4f} ({fb / fc:.3f}); bwd cur {bc:.4f} b {bb:.4f} ({bb / bc:.3f})")
    if not (fb <= 1.01 * fc and bb <= 1.02 * bc):
        reasons.append(f"{spec} {n} slower")
check = d / "check_b.json"
exact = check.exists() and all(r.get("exact") for r in json.loads(check.read_text()))
print(f"branch exact at N = 1000: {exact}")
if not exact:
    reasons.append("not shown exact")
print("; ".join(reasons) or "every condition holds")
print("cur" if reasons else "b")
