"""What the benchmark's parent, workers and report share: the protocol's constants, specs, FLOP credit, records.

Nothing here imports CUDA-only code, so the FLOP formulas, spec loading and record handling are testable on CPU.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any

from relgen.spec.model import MechanismSpec, load_spec

#: The paper's sweep (§5.2): a 16K-token budget, B = TOKENS / N.
SEQ_LENS: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_SEQ_LENS: tuple[int, ...] = (512, 8192)
#: The protocol's torch.compile mode for the compiled peers (peers.COMPILE_MODES: max-autotune-no-cudagraphs).
PROTOCOL_COMPILE_MODE = "max-autotune"
TOKENS = 16384
HEADS = 12
HEAD_DIM = 64
MECHANISMS: tuple[str, ...] = ("shaw", "txl", "deberta_v3", "t5")
PASSES: tuple[str, ...] = ("fwd", "bwd")

#: The paper's own kernels on an H200 at N = 8192, fp16 (its Tables 2 and 3): what relgen must at least match.
#: (TFLOP/s, peak MiB) per pass; a MiB figure given as "3.1K" is written 3.1 * 1024 and met at that precision.
TARGET_LENGTH = 8192
TARGETS: dict[str, dict[str, tuple[float, float]]] = {
    "shaw": {"fwd": (279, 222), "bwd": (166, 229)},
    "txl": {"fwd": (236, 3.1 * 1024), "bwd": (133, 3.1 * 1024)},
    "deberta_v3": {"fwd": (159, 804), "bwd": (101, 470)},
    "t5": {"fwd": (307, 24), "bwd": (174, 97)},
}
#: From this length on, relgen must beat every exact peer in both passes.
FASTEST_FROM = 512
#: Stretch: these mechanisms' forward at TARGET_LENGTH at least this fraction of plain SDPA's speed.
STRETCH_MECHANISMS, STRETCH_FRACTION = ("t5", "shaw"), 0.75

#: Systems, in the order the report lists them. `relative` is False only for the plain-SDPA ceiling.
SYSTEMS: dict[str, dict[str, Any]] = {
    "relgen": {"label": "relgen (ours)", "relative": True, "compiled": False},
    "eager": {"label": "PyTorch eager", "relative": True, "compiled": False},
    "compiled": {"label": "PyTorch compile", "relative": True, "compiled": True},
    "sdpa": {"label": "PyTorch SDPA (dense bias)", "relative": True, "compiled": False},
    "flex": {"label": "FlexAttention (dense bias)", "relative": True, "compiled": True},
    "flex_decomp": {"label": "FlexAttention + decomp.", "relative": True, "compiled": True},
    "sdpa_plain": {"label": "SDPA, no relative terms (ceiling)", "relative": False, "compiled": False},
}

#: Table 7's components, each switched off by one relgen variant, and the passes it changes.
ABLATIONS: dict[str, tuple[str, ...]] = {
    "atomic_gradients": ("bwd",),  # w/o atomic-free gradients
    "no_projections": ("fwd", "bwd"),  # relation products recomputed in every tile
    "no_reachable_ranges": ("fwd", "bwd"),
    "no_constant_range_reuse": ("fwd", "bwd"),
    "no_bucket_copies": ("fwd", "bwd"),
    "recompute_projections": ("bwd",),  # w/o retained projections
}

#: Final statuses of a measurement; only "ok" carries numbers.
STATUSES = ("ok", "oom", "error", "timeout", "unsupported")

#: Shipped specs, used only when specs/<name>.yaml is missing (the files are the source of truth).
FALLBACK_SPECS: dict[str, dict[str, Any]] = {
    "shaw": {"name": "shaw", "terms": ["query"], "map": {"kind": "clipped", "min": -256, "max": 256}},
    "txl": {"name": "txl", "terms": ["query"], "map": {"kind": "identity"}},
    "deberta_v3": {
        "name": "deberta_v3",
        "terms": ["query", "key"],
        "map": {"kind": "log", "position_buckets": 256, "max_position": 512},
        "scale": "1/sqrt(3*d)",
    },
    "t5": {
        "name": "t5",
        "terms": ["bias"],
        "map": {"kind": "t5", "num_buckets": 32, "max_distance": 128, "bidirectional": True},
        "scale": 1,
    },
}

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}

#: Marker of a worker's stdout lines that carry data for the parent.
RECORD_MARK = "RELGEN_BENCH_RECORD "
START_MARK = "RELGEN_BENCH_START "
#: The current measurement's system is built and warmed up (compiled, autotuned): timing starts.
BUILT_MARK = "RELGEN_BENCH_BUILT "


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def resolve_spec(name_or_path: str, specs_dir: Path | None = None) -> tuple[MechanismSpec, str]:
    """A mechanism by name (specs/<name>.yaml, else the built-in copy) or by YAML path; returns (spec, source)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        return load_spec(path), str(path)
    specs_dir = specs_dir or repo_root() / "specs"
    for suffix in (".yaml", ".yml"):
        candidate = specs_dir / f"{name_or_path}{suffix}"
        if candidate.exists():
            return load_spec(candidate), str(candidate.relative_to(specs_dir.parent))
    if name_or_path in FALLBACK_SPECS:
        return load_spec(FALLBACK_SPECS[name_or_path]), "relgen.bench.common.FALLBACK_SPECS"
    raise FileNotFoundError(f"no spec {name_or_path!r}: expected {specs_dir}/{name_or_path}.yaml or a YAML path")


def projection_count(spec: MechanismSpec) -> int:
    """Relation projections credited: A^Q and A^K (a scalar bias table is no projection)."""
    return int(spec.has_query) + int(spec.has_key)


@functools.lru_cache(maxsize=256)
def plan_rows(spec: MechanismSpec, seq_len: int) -> int:
    """R of the plan at this length (TXL: 2N − 1, Shaw 513, DeBERTa 512, T5 32)."""
    from relgen.plan.analyze import analyze

    return analyze(spec, seq_len).rows


def credited_flops(spec: MechanismSpec, seq_len: int, batch: int, heads: int, head_dim: int, pass_: str) -> float:
    """The paper's credit (App. D): 4BHN²d + 2BHNRd per relation projection forward; backward twice that.

    Every system of a mechanism (the plain-SDPA ceiling included) is credited the same work, so throughput
    ratios are latency ratios.
    """
    rows = plan_rows(spec, seq_len)
    n, b, h, d = seq_len, batch, heads, head_dim
    forward = 4 * b * h * n * n * d + 2 * b * h * n * rows * d * projection_count(spec)
    if pass_ == "fwd":
        return float(forward)
    if pass_ == "bwd":
        return float(2 * forward)
    raise ValueError(f"pass must be 'fwd' or 'bwd', got {pass_!r}")


def batch_for(seq_len: int, tokens: int = TOKENS) -> int:
    if tokens % seq_len:
        raise ValueError(f"the token budget {tokens} is not a multiple of N={seq_len}")
    return tokens // seq_len


def record_key(record: dict[str, Any]) -> tuple:
    """What identifies one measurement; a newer record with the same key replaces an older one."""
    return (
        record.get("mechanism"),
        record.get("system"),
        record.get("variant"),
        int(record.get("seq_len", 0)),
        record.get("pass"),
        record.get("dtype"),
        record.get("batch"),
        record.get("heads"),
        record.get("head_dim"),
    )


def load_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records")
    return data


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Atomic write (temporary file + rename), so an interrupted run never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=False, allow_nan=False) + "\n")
    os.replace(tmp, path)


def merge_records(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`old` with every record of `new` replacing the one of the same key (order: first appearance)."""
    merged: dict[tuple, dict[str, Any]] = {record_key(r): r for r in old}
    for record in new:
        merged[record_key(record)] = record
    return list(merged.values())


def killed_while_building(record: dict[str, Any]) -> bool:
    """A timeout before the system was built (compiled, autotuned): it says nothing about the system's speed."""
    return record.get("status") == "timeout" and record.get("phase") == "build"


def newest_records(*lists: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Union of result files from runs that resumed one state in parallel (one GPU each): per key the record with
    the latest timestamp wins, so a share's fresh measurement beats another share's copy of the old state; but a
    timeout while building never displaces a measurement, whichever is newer."""
    merged: dict[tuple, dict[str, Any]] = {}
    for records in lists:
        for record in records:
            key = record_key(record)
            if key not in merged or _replaces(record, merged[key]):
                merged[key] = record
    return list(merged.values())


def _replaces(new: dict[str, Any], old: dict[str, Any]) -> bool:
    if killed_while_building(new) and old.get("status") == "ok":
        return False
    if killed_while_building(old) and new.get("status") == "ok":
        return True
    return str(new.get("timestamp", "")) > str(old.get("timestamp", ""))


def check_close(actual, expected, dtype, *, on_device: bool = True) -> tuple[bool, str]:
    """The paper's criterion: relgen.testing.check_close, evaluated in float64 on the tensors' own device
    (``on_device=False``: on the CPU, about a second per 12M-element tensor with many cores, several on few)."""
    from relgen.testing import check_close as relgen_check_close

    return relgen_check_close(actual, expected, dtype, device=None if on_device else "cpu")


def finite_or_none(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)
