"""The ring schedule of a sharded call: P steps, in each of which every rank computes its queries against the key
chunks it holds while those chunks move on to the next rank.

Forward: at step s rank r holds the keys, values (and key padding mask) of rank r − s. It posts their transfer to
r + 1, runs the module's forward on each (query chunk, key chunk) pair that is not wholly in the causal future,
and merges the partial outputs through their log-sum-exp (`merge`), in step order: a fixed order, so the result
repeats bit for bit. A query chunk's first pair starts its total (no merge into zeros), so a ring of one in one
contiguous chunk is the plain call: one pair, its output and gradients as they come. After P steps every query
has seen every key.

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
    """What a key chunk carries round the ring: K, V and its padding mask (as bytes: every backend sends those).
    Ring.pass_on makes them contiguous when they leave: a ring of one reads them in place."""
    return [k, v] + ([kpm.view(torch.uint8)] if kpm is not None else [])


def _arrived(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    k, v, *rest = tensors
    return k, v, rest[0].view(torch.bool) if rest else None


def _add(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """total + part: the first part as it came (no zeros to add it to, no conversion: a chunk that one pair
    reaches gets that pair's result itself), fp32 from the second part on, parts added in the schedule's order.
    0 + x = x, so the sums are those of fp32 zeros plus every part in that order."""
    if total is None:
        return part
    return (total if total.dtype == torch.float32 else total.float()).add_(part)


def _gathered(sums: list[torch.Tensor | None], like: torch.Tensor, lengths: list[int], dtype: torch.dtype):
    """The chunks' sums one after the other along SEQ in `dtype` (zeros for a chunk no pair reached)."""
    b, h, _, d = like.shape
    parts = [
        (s if s is not None else like.new_zeros((b, h, n, d), dtype=torch.float32)).to(dtype)
        for s, n in zip(sums, lengths, strict=True)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, SEQ)


def forward(ring: Ring, blocks: Blocks, layout: Layout, q, k, v, tables: Tables, kpm):
    """(O in q's dtype, base-2 lse fp32 [B, H, nq]) of the local queries over the gathered keys. A query chunk's
    first pair gives its running (O, lse) as it comes; each later pair merges into them (`merge`)."""
    b, h = q.shape[:2]
    queries = layout.queries(ring)
    totals: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(queries)
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
                lse2 = lse2.view(b, h, qs.length)
                totals[n] = (o, lse2) if totals[n] is None else merge(*totals[n], o, lse2)
        if transfer is not None:
            travelling = transfer.wait()
    lengths = [qs.length for qs in queries]
    o = _gathered([t[0] if t is not None else None for t in totals], q, lengths, q.dtype)
    lses = [t[1] if t is not None else q.new_full((b, h, n), float("-inf"), dtype=torch.float32)
            for t, n in zip(totals, lengths, strict=True)]  # fmt: skip
    return o, lses[0] if len(lses) == 1 else torch.cat(lses, SEQ)


def backward(ring: Ring, blocks: Blocks, layout: Layout, do, q, k, v, tables: Tables, kpm, o, lse2):
    """(dq, dk, dv in their inputs' dtypes, the table gradients of this rank's pairs: fp32 sums, or a single
    pair's own in the table's dtype; None for a table no pair reached) for the local chunks; o and lse2
    [B, H, nq] are the gathered call's, for the local queries."""
    queries = layout.queries(ring)
    dq_sums: list[torch.Tensor | None] = [None] * len(queries)
    dtables: list[torch.Tensor | None] = [None] * len(tables)
    # per query chunk, once: the kernels read dO and O through their strides, the lse as contiguous rows
    rows = [(qs, qs.of(do, SEQ), qs.of(o, SEQ), qs.of(lse2, SEQ).contiguous().view(-1)) for qs in queries]
    travelling = _travelling(k, v, kpm)
    gradients: Transfer | None = None
    dk = dv = None
    shared: dict = {}  # a query chunk's projections where all its pairs share them (Blocks.backward)
    for step in range(ring.size):
        transfer = ring.pass_on(travelling) if step + 1 < ring.size else None
        k_cur, v_cur, kpm_cur = _arrived(travelling)
        key_chunks = layout.keys(ring, ring.source(step))
        parts = []
        for n, (qs, do_s, o_s, lse_s) in enumerate(rows):
            for m, ks in enumerate(key_chunks):
                if not blocks.reaches(qs, ks):
                    continue
                dq_p, dk_p, dv_p, dt_p = blocks.backward(
                    do_s, qs.of(q, SEQ), ks.of(k_cur, SEQ), ks.of(v_cur, SEQ), tables,
                    ks.of(kpm_cur, 1) if kpm_cur is not None else None, qs, ks, o_s, lse_s, shared,
                )  # fmt: skip
                dq_sums[n] = _add(dq_sums[n], dq_p)
                dtables = blocks.add_table_grads(dtables, dt_p, tables, qs, ks)
                parts.append((m, dk_p, dv_p))
        if gradients is None:  # the first step: the chunks' sums start from this step's parts
            dk_sums: list[torch.Tensor | None] = [None] * len(key_chunks)
            dv_sums: list[torch.Tensor | None] = [None] * len(key_chunks)
            for m, dk_p, dv_p in parts:
                dk_sums[m], dv_sums[m] = _add(dk_sums[m], dk_p), _add(dv_sums[m], dv_p)
            lengths = [ks.length for ks in key_chunks]
            if ring.size == 1:  # nothing travels: the sums are the gradients
                dk, dv = _gathered(dk_sums, k, lengths, k.dtype), _gathered(dv_sums, v, lengths, v.dtype)
                break
            dk = _gathered(dk_sums, k, lengths, torch.float32)  # fp32, as they travel and add up
            dv = _gathered(dv_sums, v, lengths, torch.float32)
        else:  # the chunk's sums so far came from the previous rank while this step computed
            dk, dv = gradients.wait()
            for m, dk_p, dv_p in parts:
                key_chunks[m].of(dk, SEQ).add_(dk_p)
                key_chunks[m].of(dv, SEQ).add_(dv_p)
        gradients = ring.pass_on([dk, dv])
        if transfer is not None:
            travelling = transfer.wait()
    if gradients is not None:
        dk, dv = gradients.wait()
    dq = _gathered(dq_sums, q, [qs.length for qs in queries], q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dtables
