"""Tensor descriptors (TMA on Hopper) over K and V for the forward's saturated key tiles, where a call allows them.

A saturated tile reads K and V whole, in any key order, and all its keys exist: one TMA box each, with no address
tensors in registers and no predicates. Band tiles keep their pointer loads (their keys run in descending order so
that each query's Z̃ entries form one ascending run; see the template's `_key_tile`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from relgen.backend import interpreting

#: descriptors on where a call allows them; off, every tile loads through pointers (tests run both paths)
enabled = True

#: query-key pairs (B·H·Nq·Nk) of a call below which its saturated tiles load through pointers. Triton encodes
#: each descriptor on the host at every launch (~40 µs of host time per forward on the H200's host,
#: docs/performance.md), while TMA saves 1-3 % of the forward's GPU time: that pays only where the GPU, not the
#: host, bounds the call. The benchmark's 1K forward (2^27.6 pairs, 0.22 ms for T5) is host-bound, its 2K
#: forward is not.
MIN_PAIRS = 1 << 28


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """Descriptors for every call that allows them whatever its size (on), or for none (off): `relgen warmup`
    compiles the forward both ways, as calls of other batch sizes at the same length would launch it."""
    global enabled, MIN_PAIRS
    saved = enabled, MIN_PAIRS
    enabled, MIN_PAIRS = on, (0 if on else MIN_PAIRS)
    try:
        yield
    finally:
        enabled, MIN_PAIRS = saved


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _supported(device: torch.device) -> bool:
    if interpreting():
        return True
    return device.type == "cuda" and _hopper_or_later(device.index if device.index is not None else 0)


def _readable(t: torch.Tensor) -> bool:
    """TMA's layout rules: a unit last stride, every other stride and the base address on 16 bytes."""
    size = t.element_size()
    return (
        t.dim() == 4
        and t.stride(-1) == 1
        and all(s * size % 16 == 0 for s in t.stride()[:-1])
        and t.data_ptr() % 16 == 0
    )


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, *, varlen: bool, pairs: int) -> tuple[Any, Any]:
    """Host-side descriptors over K and V [B, H, N, d] with boxes [1, 1, BN, d], or (None, None) where TMA cannot
    read them or would not pay: descriptors switched off, fewer than MIN_PAIRS query-key pairs, packed sequences,
    a GPU before Hopper, a head dim that is not a power of two, or a layout TMA does not accept.

    k and v are the views the kernels index, and each descriptor takes its view's own strides: TMA addresses a box
    through any strides that are multiples of 16 bytes, so a 'bnhd' call's K and V (tokens H·d elements apart, heads
    d apart) are read in place like contiguous [B, H, N, d] ones."""
    if not enabled or pairs < MIN_PAIRS or varlen or not _supported(k.device):
        return None, None
    if k.shape[-1] & (k.shape[-1] - 1):
        # a padded head dim (relgen.tiles.configs.head_block): a box is a power of two wide, wider than the rows
        # here, and those tiles keep the pointer loads, whose masks zero the padding
        return None, None
    if not (_readable(k) and _readable(v)):
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    box = [1, 1, block_n, k.shape[-1]]
    return (
        TensorDescriptor(k, list(k.shape), list(k.stride()), box),
        TensorDescriptor(v, list(v.shape), list(v.stride()), box),
    )
