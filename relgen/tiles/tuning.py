"""Tuned tile configurations: lookup tables per compute capability, kernel family, dtype, head dim and
sequence-length bucket (written by `relgen tune`, committed under relgen/tiles/tuning_tables/).

A kernel family is what the table key takes from the plan: its relation terms, and whether its map saturates. A
map whose rows grow with N (the identity map of Transformer-XL) has no saturated tiles, so its best tiles differ
from those of a saturating map with the same terms (Shaw's): its family carries the suffix `@unsaturated`."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from relgen.tiles.configs import AttnTiles, KernelConfig, ProjectTiles, ReduceTiles

#: Upper ends of the sequence-length buckets; longer sequences use the last one.
BUCKETS = (64, 128, 384, 512, 768, 1024, 2048, 4096, 8192)
TABLES = Path(__file__).resolve().parent / "tuning_tables"
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def bucket(seq_len: int) -> int:
    return next((b for b in BUCKETS if seq_len <= b), BUCKETS[-1])


@functools.lru_cache(maxsize=8)
def _table(capability: str) -> dict[str, Any]:
    path = TABLES / f"sm{capability}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def in_tile(plan: Any) -> bool:
    """Whether a plan's (PlanInfo or Plan) band tiles form their relation products in-tile from Ã (ablation
    no_projections) instead of reading stored projections Z̃."""
    return plan.relations == "in_tile"


def plan_family(plan: Any) -> str:
    """The kernel family of a plan (PlanInfo or Plan): its terms, whether its map saturates, and whether its band
    tiles form their relation products in-tile (ablation no_projections: other register needs, no tuned entries)."""
    return (
        "+".join(plan.terms) + ("@unsaturated" if plan.length_dependent else "") + ("@in_tile" if in_tile(plan) else "")
    )


def table_key(family: str, dtype: torch.dtype, head_dim: int, seq_len: int) -> str:
    return f"{family}/{DTYPE_NAMES[dtype]}/d{head_dim}/n{bucket(seq_len)}"


@functools.lru_cache(maxsize=1)
def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def lookup(family: str, dtype: torch.dtype, head_dim: int, seq_len: int):
    """The tuned KernelConfig for this GPU, or None (then the resource heuristic decides)."""
    if not torch.cuda.is_available():
        return None
    major, minor = _capability()
    return table_config(f"{major}{minor}", family, dtype, head_dim, seq_len)


def table_config(capability: str, family: str, dtype: torch.dtype, head_dim: int, seq_len: int):
    """The committed entry of compute capability `capability` (e.g. "90") as a KernelConfig, or None."""

    entry = _table(capability).get(table_key(family, dtype, head_dim, seq_len))
    if entry is None:
        return None
    return KernelConfig(
        group=entry["group"],
        forward=AttnTiles(**entry["forward"]),
        backward=AttnTiles(**entry["backward"]),
        project=ProjectTiles(**entry["project"]),
        reduce=ReduceTiles(**entry["reduce"]),
        backward_kv=AttnTiles(**entry["backward_kv"]) if entry.get("backward_kv") else None,
    )
