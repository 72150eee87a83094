"""Which tile configuration a call runs: an override (tests, tuning), else the tuned table entry for this GPU,
else the resource heuristic; the interpreter always runs its own small tiles."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from relgen.backend import interpreting
from relgen.tiles import tuning
from relgen.tiles.configs import KernelConfig, default_config

_override: list[KernelConfig] = []


class override_config:
    """Force a kernel configuration (tests, tuning): `with override_config(cfg): fn(...)`."""

    def __init__(self, config: KernelConfig):
        config.check()
        self.config = config

    def __enter__(self) -> KernelConfig:
        _override.append(self.config)
        return self.config

    def __exit__(self, *exc: object) -> None:
        _override.pop()


def overridden() -> bool:
    """Whether an override_config is active (select_config then ignores the tables)."""
    return bool(_override)


def changed_tiles(
    plan: Any, dtype: torch.dtype, head_dim: int, seq_len: int, changes: list[str]
) -> contextlib.AbstractContextManager:
    """The tiles `plan` would run at `seq_len`, changed as given (KernelConfig.with_changes), forced for the calls in
    the block (benchmarks' what-ifs); nothing forced without changes."""
    if not changes:
        return contextlib.nullcontext()
    return override_config(select_config(plan, dtype, head_dim, seq_len).with_changes(changes))


def select_config(plan: Any, dtype: torch.dtype, head_dim: int, seq_len: int) -> KernelConfig:
    """An override (tests, tuning), else the tuned table entry for this GPU, else the resource heuristic."""
    if _override:
        return _override[-1]
    family = tuning.plan_family(plan)
    return _selected(plan.terms, family, tuning.in_tile(plan), dtype, head_dim, tuning.bucket(seq_len), interpreting())


@functools.lru_cache(maxsize=256)
def _selected(
    terms: tuple[str, ...],
    family: str,
    in_tile: bool,
    dtype: torch.dtype,
    head_dim: int,
    bucket: int,
    interpreted: bool,
):
    """select_config once per (kernel family, dtype, head dim, length bucket): every length of a bucket shares it."""
    return tuning.lookup(family, dtype, head_dim, bucket) or default_config(dtype, head_dim, bucket, terms, in_tile)
