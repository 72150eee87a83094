"""`context_parallel(fn)`: a relgen mechanism over a sequence sharded across the ranks of a process group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relgen.distributed.autograd import RingAttention, RingCall
from relgen.distributed.blocks import ROW_DIMS, Blocks
from relgen.distributed.ring import Ring
from relgen.distributed.schedule import Layout
from relgen.distributed.sharding import check_sharding, chunk_count
from relgen.runtime.arguments import LN2, PACKING_OPTIONS, seed_snapshot
from relgen.runtime.mechanism import Mechanism, compile_mechanism
from relgen.runtime.memory import check_strategy
from relgen.spec.model import MechanismSpec

__all__ = ["ContextParallel", "context_parallel"]


def context_parallel(
    fn: Mechanism | MechanismSpec | dict | str | Path,
    group: dist.ProcessGroup | None = None,
    sharding: str = "contiguous",
) -> ContextParallel:
    """`fn` (what `relgen.compile_mechanism` returns, or a spec it accepts) over sequences sharded across `group`
    (default: the world). See `ContextParallel`."""
    return ContextParallel(fn if isinstance(fn, Mechanism) else compile_mechanism(fn), group, sharding)


class ContextParallel:
    """`cp_fn(q, k, v, aq=None, ak=None, bias=None, **options)` on every rank of a group, each holding its shard
    of the sequence dimension of q, k, v ([B, H, n, d], n = N / P; `relgen.distributed.shard`), equals `fn` on the
    gathered sequence: the local block of the output (and LSE), the gradients of the local q, k, v, and the whole
    gradient of the (replicated) tables on every rank. Tables are those of the gathered call: an identity map's
    have 2L − 1 rows with L the gathered length.

    Options as `fn`'s: `key_padding_mask` ([B, n] bool, sharded like k), `q_offset`, `k_offset` (positions of
    the gathered sequences' first query and key), `dropout_p`, `dropout_seed`, `scale`, `return_lse`, and
    `projections` ("auto", "stored", "tiled": relgen.runtime.memory), decided from one pair of chunks' memory (every
    pair has the same shapes).
    A ring of one in one chunk (`sharding="contiguous"` on a group of one) is the plain call, and runs as `fn`
    itself, `recompute_projections` included. Every other call recomputes its projections in its backward (a pair's
    windows of Z̃ depend on its offsets, and keeping every pair's would cost a rank the memory of the unsharded
    call), once per query chunk where its pairs share them (a Z̃^Q alone whose windows are the whole expansion).
    Packed sequences (`cu_seqlens`) are not supported.

    Dropout: the mask is the unsharded call's (`relgen.testing.dropout_keep_mask` over the gathered sequence, at
    its offsets), whatever the group size and the sharding: the kernels key it by absolute positions, and every
    pair of chunks draws with the call's seed at its own offsets.

    Every rank must call with the same shapes and options; the results repeat bit for bit for a given group
    size. Eager only: under torch.compile the call runs outside the graph.
    """

    def __init__(self, fn: Mechanism, group: dist.ProcessGroup | None, sharding: str):
        self.fn = fn
        self.sharding = check_sharding(sharding)
        self.ring = Ring(group)
        # a ring of one in one chunk is the plain call: it runs as fn itself, with fn's checks and host time
        self.plain = self.ring.size == 1 and chunk_count(self.sharding, 1) == 1

    @torch.compiler.disable  # P2P transfers and host-side scheduling: not traceable
    def __call__(
        self, q, k, v, aq=None, ak=None, bias=None, *, key_padding_mask=None, cu_seqlens=None, max_seqlen=None,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_offset=0, k_offset=0,
        dropout_p=0.0, dropout_seed=None, scale=None, recompute_projections=False, return_lse=False,
        projections="auto",
    ):  # fmt: skip
        packing = (cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if packing != (None,) * len(packing):
            given = [name for name, value in zip(PACKING_OPTIONS, packing, strict=True) if value is not None]
            raise NotImplementedError(
                f"{given[0]}: packed sequences are not supported by context_parallel; shard padded [B, H, N, d] "
                "sequences with a key_padding_mask instead"
            )
        if self.plain:
            return self.fn(
                q, k, v, aq, ak, bias, key_padding_mask=key_padding_mask, q_offset=q_offset, k_offset=k_offset,
                dropout_p=dropout_p, dropout_seed=dropout_seed, scale=scale,
                recompute_projections=recompute_projections, return_lse=return_lse, projections=projections,
            )  # fmt: skip
        if not isinstance(recompute_projections, bool):
            raise ValueError(f"recompute_projections: expected a bool, got {type(recompute_projections).__name__}")
        strategy = check_strategy(projections)
        layout = self._layout(q, k, v, key_padding_mask, q_offset, k_offset)
        length = max(q_offset + layout.nq * self.ring.size, k_offset + layout.nk * self.ring.size)
        module = self.fn.module_for(length)
        tables = (aq, ak, bias)
        if module.PLAN.length_dependent:
            _check_identity_rows(tables, 2 * length - 1, length)
        if isinstance(dropout_p, int | float) and not isinstance(dropout_p, bool) and dropout_p > 0:
            # one seed for the forward and the backward: drawn now if not given (a tensor seed is copied, as the
            # unsharded call does, so that the caller may update theirs in place)
            dropout_seed = (
                int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_seed is None else seed_snapshot(dropout_seed)
            )
        options: dict[str, Any] = {"scale": scale, "dropout_p": dropout_p, "dropout_seed": dropout_seed}
        blocks = Blocks(module, length, options)
        first_q, first_k = layout.queries(self.ring)[0], layout.keys(self.ring, self.ring.rank)[0]
        if strategy != "stored":  # every pair has the first's shapes: its call decides (the same on every rank)
            pair_kpm = first_k.of(key_padding_mask, 1) if key_padding_mask is not None else None
            chosen = self.fn.strategy_module(
                module, strategy, first_q.of(q, 2), first_k.of(k, 2), first_k.of(v, 2),
                *blocks.pair_tables(tables, first_q, first_k),
                {"key_padding_mask": pair_kpm, "q_offset": first_q.start, "k_offset": first_k.start, "scale": scale},
            )  # fmt: skip
            if chosen is not module:
                blocks = Blocks(chosen, length, options)
        if self.ring.size > 1:  # a ring of one transfers nothing: its first pair's call checks the same arguments
            blocks.check(
                first_q.of(q, 2), first_k.of(k, 2), first_k.of(v, 2), tables,
                first_k.of(key_padding_mask, 1) if key_padding_mask is not None else None, first_q, first_k,
            )  # fmt: skip
        call = RingCall(self.ring, blocks, layout, key_padding_mask)
        o, lse2 = RingAttention.apply(q, k, v, aq, ak, bias, call)
        return (o, lse2 * LN2) if return_lse else o

    def _layout(self, q, k, v, kpm, q_offset, k_offset) -> Layout:
        """The call's Layout, after the checks that only the sharded call can make (the pairs' calls check the
        rest, as the unsharded call would)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                got = f"shape [{', '.join(map(str, t.shape))}]" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected a tensor [B, H, n, d] (this rank's shard), got {got}")
        if v.shape[2] != k.shape[2]:
            raise ValueError(f"v: expected the length of k ({k.shape[2]}) along dim 2, got {v.shape[2]}")
        for name, off in (("q_offset", q_offset), ("k_offset", k_offset)):
            if not isinstance(off, int) or isinstance(off, bool) or off < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {off!r}")
        per_rank = chunk_count(self.sharding, self.ring.size) // self.ring.size
        for name, t in (("q", q), ("k", k)):
            if t.shape[2] % per_rank or t.shape[2] == 0:
                raise ValueError(
                    f"{name}: a {self.sharding} shard holds {per_rank} equal chunks, so its length must be a positive "
                    f"multiple of {per_rank}, got {t.shape[2]}"
                )
        if kpm is not None:
            want = (k.shape[0], k.shape[2])
            if not isinstance(kpm, torch.Tensor) or kpm.dtype != torch.bool or tuple(kpm.shape) != want:
                got = f"{list(kpm.shape)} {kpm.dtype}" if isinstance(kpm, torch.Tensor) else type(kpm).__name__
                raise ValueError(
                    f"key_padding_mask: expected this rank's shard, a bool tensor [{want[0]}, {want[1]}] sharded like "
                    f"k (True = a real key), got {got}"
                )
        return Layout(self.sharding, q.shape[2], k.shape[2], q_offset, k_offset)

    def __repr__(self) -> str:
        return f"<relgen context_parallel {self.fn.plan.spec_name}, {self.sharding} over {self.ring.size} ranks>"


def _check_identity_rows(tables, rows: int, length: int) -> None:
    for name, t, dim in zip(("aq", "ak", "bias"), tables, ROW_DIMS, strict=True):
        if isinstance(t, torch.Tensor) and t.dim() >= -dim and t.shape[dim] != rows:
            raise ValueError(
                f"{name}: expected {rows} rows in dim {t.dim() + dim} (the identity map over the gathered length "
                f"L = {length}: 2L − 1), got shape [{', '.join(map(str, t.shape))}]"
            )
