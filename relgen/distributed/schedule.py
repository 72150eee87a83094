"""The ring schedule of a sharded call: P steps, in each of which every rank computes its queries against the key
chunks it holds while those chunks move on to the next rank.

Forward: at step s rank r holds the keys, values (and key padding mask) of rank r − s. It posts their transfer to
r + 1, runs the module's forward on each (query chunk, key chunk) pair that is not wholly in the causal future,
and merges the partial outputs through their log-sum-exp (`merge`), in step order: a fixed order, so the result
repeats bit for bit. After P steps every query has seen every key.

Backward: the same ring again, with the gathered output and log-sum-exp of the local queries. dQ sums on the
rank; dK and dV are summed on the chunk they belong to and travel one step behind it: after its last step the
chunk's gradients move once more and arrive back at their owner. Table gradients sum on each rank (the caller
adds them up over the group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relgen.distributed.blocks import Blocks, Tables
from relgen.distributed.merge import merge
from relgen.distributed.ring import Ring, Transfer
from relgen.distributed.sharding import Segment, segments

__all__ = ["Layout", "backward", "forward"]

SEQ = 2  # the sequence dimension of [B, H, N, d]


@dataclass(frozen=True)
class Layout:
    """Where each rank's queries and keys sit in the gathered sequences."""

    sharding: str
    nq: int  # local lengths (every rank's shard has the same)
    nk: int
    q_offset: int  # absolute position of the gathered sequences' first query and key
    k_offset: int

    def queries(self, ring: Ring) -> tuple[Segment, ...]:
        return segments(self.sharding, ring.rank, ring.size, self.nq, self.q_offset)

    def keys(self, ring: Ring, rank: int) -> tuple[Segment, ...]:
        return segments(self.sharding, rank, ring.size, self.nk, self.k_offset)


def _travelling(k: torch.Tensor, v: torch.Tensor, kpm: torch.Tensor | None) -> list[torch.Tensor]:
    """What a key chunk carries round the ring: K, V and its padding mask (as bytes: every backend sends those)."""
    return [k.contiguous(), v.contiguous()] + ([kpm.contiguous().view(torch.uint8)] if kpm is not None else [])


def _arrived(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    k, v, *rest = tensors
    return k, v, rest[0].view(torch.bool) if rest else None


def forward(ring: Ring, blocks: Blocks, layout: Layout, q, k, v, tables: Tables, kpm):
    """(O in q's dtype, base-2 lse fp32 [B, H, nq]) of the local queries over the gathered keys."""
    b, h, _, d = q.shape
    queries = layout.queries(ring)
    outs = [q.new_zeros((b, h, s.length, d), dtype=torch.float32) for s in queries]
    lses = [q.new_full((b, h, s.length), float("-inf"), dtype=torch.float32) for s in queries]
    travelling = _travelling(k, v, kpm)
    for step in range(ring.size):
        transfer = ring.pass_on(travelling) if step + 1 < ring.size else None
        k_cur, v_cur, kpm_cur = _arrived(travelling)
        for n, qs in enumerate(queries):
            for ks in layout.keys(ring, ring.source(step)):
                if not blocks.reaches(qs, ks):
                    continue
                o, lse2 = blocks.forward(
                    qs.of(q, SEQ), ks.of(k_cur, SEQ), ks.of(v_cur, SEQ), tables,
                    ks.of(kpm_cur, 1) if kpm_cur is not None else None, qs, ks,
                )  # fmt: skip
                outs[n], lses[n] = merge(outs[n], lses[n], o, lse2.view(b, h, qs.length))
        if transfer is not None:
            travelling = transfer.wait()
    return torch.cat(outs, SEQ).to(q.dtype), torch.cat(lses, SEQ)


def backward(ring: Ring, blocks: Blocks, layout: Layout, do, q, k, v, tables: Tables, kpm, o, lse2):
    """(dq, dk, dv in their inputs' dtypes, fp32 table gradients of this rank's pairs) for the local chunks; o and
    lse2 [B, H, nq] are the gathered call's, for the local queries."""
    queries = layout.queries(ring)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dtables = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if t is not None else None for t in tables]
    # per query chunk, once: the kernels take dO, O and the lse as contiguous rows of their own
    rows = [(qs, qs.of(do, SEQ).contiguous(), qs.of(o, SEQ), qs.of(lse2, SEQ).contiguous().view(-1)) for qs in queries]
    travelling = _travelling(k, v, kpm)
    gradients: Transfer | None = None
    dk = dv = None
    for step in range(ring.size):
        transfer = ring.pass_on(travelling) if step + 1 < ring.size else None
        k_cur, v_cur, kpm_cur = _arrived(travelling)
        parts = []
        for qs, do_s, o_s, lse_s in rows:
            for ks in layout.keys(ring, ring.source(step)):
                if not blocks.reaches(qs, ks):
                    continue
                dq_p, dk_p, dv_p, dt_p = blocks.backward(
                    do_s, qs.of(q, SEQ), ks.of(k_cur, SEQ), ks.of(v_cur, SEQ), tables,
                    ks.of(kpm_cur, 1) if kpm_cur is not None else None, qs, ks, o_s, lse_s,
                )  # fmt: skip
                qs.of(dq, SEQ).add_(dq_p)
                blocks.add_table_grads(dtables, dt_p, qs, ks)
                parts.append((ks, dk_p, dv_p))
        # the chunk's sums so far come from the previous rank while this step computed
        if gradients is None:
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        else:
            dk, dv = gradients.wait()
        for ks, dk_p, dv_p in parts:
            ks.of(dk, SEQ).add_(dk_p)
            ks.of(dv, SEQ).add_(dv_p)
        gradients = ring.pass_on([dk, dv]) if ring.size > 1 else None
        if transfer is not None:
            travelling = transfer.wait()
    if gradients is not None:
        dk, dv = gradients.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dtables
