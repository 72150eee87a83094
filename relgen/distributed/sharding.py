"""Which part of the gathered sequence each rank of a group holds, and `shard` / `unshard` for users.

The gathered sequence is cut into equal chunks. `"contiguous"`: P chunks, rank r holds chunk r. `"zigzag"`: 2P
chunks, rank r holds chunks r and 2P − 1 − r, one early and one late, so that under a causal mask every rank has
about the same number of (query, key) pairs to compute. A rank's shard is its chunks one after the other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["SHARDINGS", "Segment", "check_sharding", "group_rank_and_size", "segments", "shard", "unshard"]

SHARDINGS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """One chunk of a rank's shard: chunk number `chunk` of the gathered sequence, `length` tokens at the absolute
    position `start`, stored from index `local` on in the shard."""

    chunk: int
    start: int
    local: int
    length: int

    @property
    def end(self) -> int:
        """The absolute position after the chunk's last token."""
        return self.start + self.length

    def of(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The chunk's part of a shard `x` along `dim` (a view; x itself for a chunk that is the whole shard)."""
        if self.local == 0 and self.length == x.shape[dim]:
            return x
        return x.narrow(dim, self.local, self.length)


def check_sharding(sharding: object) -> str:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding: expected one of {SHARDINGS}, got {sharding!r}")
    return sharding  # type: ignore[return-value]


def chunk_count(sharding: str, size: int) -> int:
    """How many chunks the gathered sequence is cut into."""
    return size if check_sharding(sharding) == "contiguous" else 2 * size


def chunk_ids(sharding: str, rank: int, size: int) -> tuple[int, ...]:
    """The chunks rank `rank` of `size` holds, in the order its shard stores them."""
    return (rank,) if check_sharding(sharding) == "contiguous" else (rank, 2 * size - 1 - rank)


@functools.lru_cache(maxsize=256)  # a pure function of ints, asked a few times per call
def segments(sharding: str, rank: int, size: int, local_length: int, offset: int = 0) -> tuple[Segment, ...]:
    """The chunks of rank `rank`'s shard of `local_length` tokens, with absolute positions from `offset` on (the
    gathered sequence's first position)."""
    ids = chunk_ids(sharding, rank, size)
    length = local_length // len(ids)
    return tuple(Segment(c, offset + c * length, n * length, length) for n, c in enumerate(ids))


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in `group` and the group's size; without an initialised process group the default group
    is a ring of one."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    return rank, dist.get_world_size(group)


def _dim(x: object, dim: object) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected an int in [{-x.dim()}, {x.dim()}) for a tensor of rank {x.dim()}, got {dim!r}")
    return dim % x.dim()


def shard(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, sharding: str = "contiguous", dim: int = 2
) -> torch.Tensor:
    """This rank's shard of `x`, the whole sequence (the same on every rank), along `dim` (default 2: the sequence
    dimension of [B, H, N, d]; 1 for a key padding mask [B, N]). A new tensor, not a view of `x`."""
    dim = _dim(x, dim)
    rank, size = group_rank_and_size(group)
    count = chunk_count(sharding, size)
    if x.shape[dim] % count:
        raise ValueError(
            f"x: the length along dim {dim} ({x.shape[dim]}) must be a multiple of {count} ({sharding} sharding over "
            f"{size} ranks cuts it into {count} equal chunks)"
        )
    segs = segments(sharding, rank, size, x.shape[dim] // size)
    return torch.cat([x.narrow(dim, s.start, s.length) for s in segs], dim)


def unshard(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, sharding: str = "contiguous", dim: int = 2
) -> torch.Tensor:
    """The whole sequence from every rank's shard `x` along `dim` (all-gather; every rank gets it). The shards must
    have equal shapes. Not differentiable: it is bookkeeping for results (outputs, gradients), not a layer."""
    dim = _dim(x, dim)
    rank, size = group_rank_and_size(group)
    if x.shape[dim] % len(chunk_ids(sharding, rank, size)):
        raise ValueError(f"x: a {sharding} shard holds two equal chunks, so its length along dim {dim} must be even")
    if size == 1:
        parts = [x.detach()]
    else:
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
        dist.all_gather(parts, x.detach().contiguous(), group=group)
    by_chunk = {
        s.chunk: s.of(part, dim) for r, part in enumerate(parts) for s in segments(sharding, r, size, x.shape[dim])
    }
    return torch.cat([by_chunk[c] for c in sorted(by_chunk)], dim)
