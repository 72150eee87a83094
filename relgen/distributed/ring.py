"""The ring of a process group: each rank's neighbours and the point-to-point transfers between them.

Rank r of P sends to r + 1 and receives from r − 1 (mod P). A transfer is posted (`pass_on`) before the kernels
that read the current tensors run and waited for (`Transfer.wait`) after them, so the next chunk's keys and values
are on their way while this one's are computed on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from relgen.distributed.sharding import group_rank_and_size

__all__ = ["Ring", "Transfer"]


class Transfer:
    """Tensors on their way from the previous rank: `wait()` returns them once they have arrived."""

    def __init__(self, works: list, sent: list[torch.Tensor], received: list[torch.Tensor]):
        self._works = works
        self._sent = sent  # held until the sends are done: their memory must not be reused before
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._sent = []
        return self._received


class Ring:
    """This process's place in the ring of `group` (default: the world; without an initialised process group, a
    ring of one)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank, self.size = group_rank_and_size(group)
        if self.size > 1:
            self.next = self._global_rank((self.rank + 1) % self.size)
            self.prev = self._global_rank((self.rank - 1) % self.size)

    def _global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def source(self, step: int) -> int:
        """The rank whose keys this rank holds after `step` transfers."""
        return (self.rank - step) % self.size

    def pass_on(self, tensors: Sequence[torch.Tensor]) -> Transfer:
        """Send `tensors` to the next rank and receive the previous rank's tensors of the same shapes and dtypes
        (every rank of the ring calls this with the same shapes), without waiting."""
        outgoing = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in outgoing]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in outgoing]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return Transfer(dist.batch_isend_irecv(ops), outgoing, received)
