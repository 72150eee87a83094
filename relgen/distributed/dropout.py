"""Dropout in a sharded call: the seed each (query chunk, key chunk) pair draws with, and the keep mask that a
sharded call draws as a whole.

The kernels key their Philox counter by a call's own query and key indices and its own sizes (relgen.runtime.dropout),
not by absolute positions, so two pairs of equal chunks given the same seed would draw the same mask. Each pair
therefore draws with a seed of its own, an affine function of the call's seed modulo the prime 2³¹ − 1 that is
one-to-one in the pair: a proper dropout mask, the same in the forward and the backward and from run to run,
but not the unsharded call's (except with a single chunk, which keeps the seed) and not the same for another
group size or sharding.
"""

from __future__ import annotations

from typing import Any

import torch

from relgen.distributed.sharding import chunk_count

__all__ = ["keep_mask", "pair_seed"]

_PRIME = 2**31 - 1
_MULTIPLIER = 48271  # a primitive root modulo the prime


def pair_seed(seed: Any, q_chunk: int, k_chunk: int, chunks: int) -> Any:
    """The seed of the pair (query chunk `q_chunk`, key chunk `k_chunk`) of a sequence cut into `chunks` chunks:
    an int for an int seed, a one-element int64 tensor on the seed's device for a tensor seed (no host read)."""
    if chunks == 1:
        return seed
    pair = q_chunk * chunks + k_chunk + 1
    if isinstance(seed, torch.Tensor):
        return (seed.to(torch.int64) % _PRIME * _MULTIPLIER + pair) % _PRIME
    return (seed % _PRIME * _MULTIPLIER + pair) % _PRIME


def keep_mask(
    shape: tuple[int, int, int, int], p: float, seed: int | torch.Tensor, group_size: int, sharding: str, device="cpu"
) -> torch.Tensor:
    """The bool keep mask [B, H, Nq, Nk] (True = kept) over the gathered sequences that a sharded call with
    `dropout_p=p, dropout_seed=seed` on `group_size` ranks with `sharding` draws (`relgen.testing.
    dropout_keep_mask` pair by pair)."""
    from relgen.testing import dropout_keep_mask

    b, h, nq, nk = shape
    chunks = chunk_count(sharding, group_size)
    if nq % chunks or nk % chunks:
        raise ValueError(f"shape: Nq and Nk must be multiples of {chunks} ({sharding} over {group_size}), got {shape}")
    cq, ck = nq // chunks, nk // chunks
    mask = torch.empty(shape, dtype=torch.bool, device=device)
    for i in range(chunks):
        for j in range(chunks):
            block = dropout_keep_mask((b, h, cq, ck), p, int(pair_seed(seed, i, j, chunks)), device)
            mask[:, :, i * cq : (i + 1) * cq, j * ck : (j + 1) * ck] = block
    return mask
