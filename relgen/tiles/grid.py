"""Launch grids of the host: ⌈a / b⌉, and how many programs the projection and the table reductions split into
to fill the GPU."""

from __future__ import annotations

import functools
import math

import torch


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the host (triton.cdiv is a constexpr function now, ten times the cost per call)."""
    return -(-a // b)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def column_splits(token_programs: int, column_blocks: int, device: torch.device) -> int:
    """Into how many runs of columns the projection splits each window: one per token block when that alone
    fills the GPU (each program then streams its whole window), more when there are few token blocks."""
    if device.type != "cuda":
        return min(column_blocks, 2)
    return max(1, min(column_blocks, math.ceil(4 * _sm_count(device) / max(token_programs, 1))))


def table_chunks(items: int, column_programs: int, device: torch.device) -> int:
    """How many fp32 partials the table reductions write: enough programs to fill the GPU, no more."""
    if device.type != "cuda":
        return max(1, min(items, 2))  # at least one: an empty batch still writes its (zero) partial
    return max(1, min(items, math.ceil(2 * _sm_count(device) / max(column_programs, 1))))
