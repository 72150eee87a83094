"""Launch grids of the host: ⌈a / b⌉, and how many programs the projection, the key pass of grouped-query heads
and the table reductions split into to fill the GPU."""

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


#: programs per SM the table reductions aim for (each streams its dZ̃ rows one dependent load after another); more
#: parts would add fp32 partials at the backward's peak
TABLE_PROGRAMS_PER_SM = 2


def table_partials(items: int, groups: int, column_programs: int, device: torch.device) -> tuple[int, int]:
    """How the table reductions split each column block's work, one fp32 partial per part: (chunks of the
    batch[·head] items, runs of a sequence's token groups). Enough parts to fill the GPU, no more: whole items
    first, then runs of groups (a long sequence at B = 1 is one item). The interpreter splits both in two where
    it can, so that tests meet every form."""
    if device.type != "cuda":
        return max(1, min(items, 2)), max(1, min(groups, 2))  # ≥ 1: an empty batch still writes its zero partial
    wanted = math.ceil(TABLE_PROGRAMS_PER_SM * _sm_count(device) / max(column_programs, 1))
    chunks = max(1, min(items, wanted))
    return chunks, max(1, min(groups, -(-wanted // chunks)))


def group_splits(requested: int, kv_group: int, programs: int, device: torch.device, whole_groups: bool) -> int:
    """Into how many parts the key pass splits each grouped-query group's heads (AttnTiles.group_split: at most
    that many, the largest divisor of the group's size up to it; 0: chosen here). Each part writes fp32 partial
    dK and dV of the group's key/value head, which the host adds in a fixed order.

    Chosen here: one query head a program, unless `whole_groups`. A program that runs over its group's heads
    compiles one copy of the query-tile loops per head, and ran Shaw's key pass 14 % slower than a program per head
    (fp16, N = 8K, B = 2, H = 16, H_kv = 4: 3.642 ms against 3.168 in parts of one head and 3.184 with 16 full heads;
    H100, docs/performance.md section 19). The partials take 8 bytes per query head, token and head-dim entry:
    at d = 64 half of Shaw's stored dZ̃ (2 bytes per query head, token and its 513 columns). `whole_groups` (a key
    pass that writes dZ̃^K, whose group loop was not slower than full heads, or relation products formed in the
    tiles, where the partials would be the backward's largest buffers) keeps a group in one program while the GPU
    has at least as many programs as SMs, and splits it only as far as that needs. The interpreter splits groups
    of 4 and more in two, so that tests meet both forms."""
    if requested:
        return max(p for p in range(1, min(requested, kv_group) + 1) if kv_group % p == 0)
    if kv_group == 1:
        return 1
    if device.type != "cuda":
        return 2 if kv_group >= 4 else 1
    if not whole_groups:
        return kv_group
    wanted = _sm_count(device)
    for parts in range(1, kv_group + 1):
        if kv_group % parts == 0 and programs * parts >= wanted:
            return parts
    return kv_group
