"""One (query chunk, key chunk) pair of a sharded call, run through a generated module's own two passes.

relgen's kernels take the absolute positions of a call's first query and first key (`q_offset`, `k_offset`), so
a pair of chunks is an ordinary call of the module: its offsets δ, rows φ(δ), causal mask and saturated runs are
those of the gathered sequence. Only the identity map's rows depend on the length a call sees (δ reads row
δ + L − 1 of 2L − 1): a pair whose positions end at Lb reads rows L − Lb … L + Lb − 2 of the gathered call's table,
and its table gradient lands there.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from relgen.distributed.sharding import Segment
from relgen.runtime.arguments import Call, prepare_call

__all__ = ["Blocks", "Tables"]

#: (aq, ak, bias), None for a term the spec lacks
Tables = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
#: the row dimension of aq, ak ([H, R, d] or [R, d]) and bias ([H, R] or [R])
ROW_DIMS = (-2, -2, -1)


class Blocks:
    """The passes of `module` (planned for the gathered length) over chunk pairs of one sharded call.

    `length`: the gathered call's L (identity maps: its tables have 2L − 1 rows); `options`: the call's `scale`,
    `dropout_p`, `dropout_seed` (an int or a one-element tensor). Every pair draws with the call's seed: dropout
    keys its stream by absolute positions (relgen.runtime.dropout), so a pair at its offsets draws its part of the
    gathered call's mask, whatever the sharding and the group size."""

    def __init__(self, module: ModuleType, length: int, options: dict[str, Any]):
        self.module = module
        self.plan = module.PLAN
        self.length = length
        self.scale = options.get("scale")
        self.dropout_p = options.get("dropout_p", 0.0)
        self.seed = options.get("dropout_seed")

    def reaches(self, qs: Segment, ks: Segment) -> bool:
        """Whether a query of `qs` may attend to a key of `ks`: a causal call skips key chunks wholly in the future."""
        return not self.plan.causal or ks.start < qs.end

    def table_rows(self, qs: Segment, ks: Segment) -> tuple[int, int] | None:
        """(first row, row count) of the gathered table that the pair's call reads; None: the whole table."""
        if not self.plan.length_dependent:
            return None
        pair_length = max(qs.end, ks.end)
        return self.length - pair_length, 2 * pair_length - 1

    def pair_tables(self, tables: Tables, qs: Segment, ks: Segment) -> Tables:
        """The gathered tables as the pair's call reads them (an identity map's: the rows of its length)."""
        rows = self.table_rows(qs, ks)
        if rows is None:
            return tables
        return tuple(t.narrow(dim, *rows) if t is not None else None for t, dim in zip(tables, ROW_DIMS, strict=True))

    def _call(self, q, k, v, tables: Tables, kpm, qs: Segment, ks: Segment) -> Call:
        return prepare_call(
            self.plan, q, k, v, *self.pair_tables(tables, qs, ks), key_padding_mask=kpm, q_offset=qs.start,
            k_offset=ks.start, dropout_p=self.dropout_p, dropout_seed=self.seed, scale=self.scale,
        )  # fmt: skip

    def check(self, q, k, v, tables: Tables, kpm, qs: Segment, ks: Segment) -> None:
        """relgen's own argument checks (each problem a ValueError naming the argument) on one pair of chunks: run
        before any transfer, so that a bad call fails on every rank alike."""
        self._call(q, k, v, tables, kpm, qs, ks)

    def forward(self, q, k, v, tables: Tables, kpm, qs: Segment, ks: Segment):
        """(O, base-2 lse [B·H·n]) of the queries q of chunk `qs` over the keys k, v (mask kpm) of chunk `ks`."""
        call = self._call(q, k, v, tables, kpm, qs, ks)
        o, lse2, _, _ = self.module._forward_pass(call, False)
        return o, lse2

    def backward(self, do, q, k, v, tables: Tables, kpm, qs: Segment, ks: Segment, o, lse2, shared=None):
        """(dq, dk, dv, (daq, dak, dbias)) of the pair, given the GATHERED call's O and base-2 lse of the queries
        `qs` (the backward's D = rowsum(dO ∘ O) and P = exp2(s − lse) are then those of the softmax over every
        key, so the pair's contributions are exact parts of the gathered gradients). Projections are recomputed,
        unless `shared` (a dict the backward's pairs share) holds those of an earlier pair of the same query chunk
        that are this pair's too (`_shared_window`)."""
        call = self._call(q, k, v, tables, kpm, qs, ks)
        if shared is None or not self._shared_window(call):
            dq, dk, dv, *dtables = self.module._backward_pass(do, call, o, lse2)
            return dq, dk, dv, tuple(dtables)
        kept = shared.get(qs.chunk)
        if kept is None:
            geo = call.geo
            expanded = geo.expand(call.aq, call.ak, call.bias)
            kept = (self.module._projections(call.q, call.k, expanded, geo, geo.config), expanded)
            if kept[0][1] is None:  # no Z̃^K: the projections are the query chunk's alone
                shared[qs.chunk] = kept
        dq, dk, dv, *dtables = self.module._backward_formed(do, call, o, lse2, *kept)
        return dq, dk, dv, tuple(dtables)

    def _shared_window(self, call: Call) -> bool:
        """Whether the pair's Z̃^Q is its query chunk's whatever the key chunk: a map whose expansion does not depend
        on the pair's length (not an identity map), with each query's window the whole expansion (W = C: every
        window starts at column 0 whatever the offsets), stored by offset. Its bounds (fp16 storage) are then the
        same too where the spec stores no Z̃^K: they read q and Ã^Q only."""
        geo = call.geo
        plan = geo.plan
        return (
            not plan.length_dependent
            and geo.wq == geo.c
            and plan.projections == "by_offset"
            and plan.relations == "projected"
        )

    def add_table_grads(self, totals: list, dtables, tables: Tables, qs: Segment, ks: Segment) -> list:
        """The gathered tables' gradient sums with a pair's added (in the pairs' order): while one pair's gradient
        of the whole table is all there is, that gradient as it came; fp32 from the second pair on, or from the
        first that reads only some rows (an identity map's shorter pair)."""
        rows = self.table_rows(qs, ks)
        summed = []
        for total, grad, table, dim in zip(totals, dtables, tables, ROW_DIMS, strict=True):
            if grad is not None and table is not None:
                if total is None and grad.shape == table.shape:
                    total = grad
                else:
                    if total is None:
                        total = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
                    elif total.dtype != torch.float32:
                        total = total.float()
                    (total if rows is None or grad.shape == table.shape else total.narrow(dim, *rows)).add_(grad)
            summed.append(total)
        return summed
