"""The autograd.Function of a sharded call: the ring forward, the ring backward, and the sum of the table gradients
over the group (the tables are replicated: every rank gets the gathered call's whole gradient)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from relgen.distributed import schedule
from relgen.distributed.blocks import Blocks
from relgen.distributed.ring import Ring

__all__ = ["RingAttention", "RingCall"]


@dataclass(frozen=True)
class RingCall:
    """Everything of a sharded call but its differentiable tensors."""

    ring: Ring
    blocks: Blocks
    layout: schedule.Layout
    kpm: torch.Tensor | None


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, aq, ak, bias, call: RingCall):
        """(O, base-2 lse [B, H, nq]) of the local queries; q … bias passed apart so that autograd sees them."""
        o, lse2 = schedule.forward(call.ring, call.blocks, call.layout, q, k, v, (aq, ak, bias), call.kpm)
        ctx.save_for_backward(q, k, v, aq, ak, bias, o, lse2)
        ctx.call = call
        ctx.mark_non_differentiable(lse2)
        return o, lse2

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, aq, ak, bias, o, lse2 = ctx.saved_tensors
        call: RingCall = ctx.call
        tables = (aq, ak, bias)
        dq, dk, dv, dtables = schedule.backward(call.ring, call.blocks, call.layout, do, q, k, v, tables, call.kpm, o,
                                                lse2)  # fmt: skip
        grads = []
        for table, total, needed in zip(tables, dtables, ctx.needs_input_grad[3:6], strict=True):
            if table is None or not needed:
                grads.append(None)
                continue
            if total is None:  # no pair of this rank read the table
                total = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
            if call.ring.size > 1:  # fp32 on every rank, as each summed its pairs
                total = total.float()
                dist.all_reduce(total, group=call.ring.group)
            grads.append(total.to(table.dtype))
        return dq, dk, dv, *grads, None
