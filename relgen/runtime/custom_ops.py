"""torch.compile support: a generated module's two passes as torch.library custom ops.

TorchDynamo cannot trace the host code that launches relgen's kernels (relgen.runtime.launch keeps compiled kernels and
calls their launchers directly; under the interpreter the kernels themselves are Python). A custom op is opaque
to the compiler: it learns the outputs' shapes from a *fake* implementation, which runs the same argument checks
(relgen.runtime.arguments) and allocates the same buffers on shape-only tensors, and the compiled graph calls the real
kernels at run time. Both ops run the generated module's own forward and backward passes (`Passes`), so a
compiled call computes bit for bit what an eager one does.

Eager calls do not go through these ops: the dispatcher adds ~10 µs per op, and at N ≤ 1K a call is host-bound
(docs/performance.md). They take the module's autograd.Function, which runs the same passes.

Under torch.compile:
- dropout needs an explicit `dropout_seed` (a seed drawn inside the compiled graph would reach the backward only
  through a host synchronisation): an int (the op's `seed`), or a one-element tensor the kernels read (`seed_tensor`),
  which under CUDA graphs is the only kind a replay does not freeze;
- packed sequences need `max_seqlen` (the longest sequence cannot be read off the device while tracing), and
  take the shorthand `cu_seqlens` form only: separate query and key packing (`cu_seqlens_q` ≠ `cu_seqlens_k`)
  is eager-only;
- the ablation switches (`relgen bench --ablation`) and the in-tile relation products (`projections="tiled"`)
  are eager-only; `projections="auto"` stores the projections there (relgen.runtime.memory).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from relgen.runtime.arguments import (
    PACKING_OPTIONS,
    Call,
    capturing,
    check_layout,
    heads_major,
    lastdim_contiguous,
    packing_sides,
)

#: the op namespace: torch.ops.relgen.<module>_forward / _backward
NAMESPACE = "relgen"

#: (Z̃^Q, Z̃^K, Z̃^Q's end columns, Z̃^K's end columns, the largest entries an fp16 Z̃ is scaled by), None where absent —
#: what the forward keeps for the backward
Projections = tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class Passes:
    """The host functions of one generated module that the ops run."""

    #: relgen.runtime.arguments.prepare_call with the module's plan: (q, k, v, aq, ak, bias, **options) → Call
    prepare: Callable[..., Call]
    #: (call, keep_projections) → (o, lse2, projections or all None when not kept, expanded tables)
    forward: Callable[[Call, bool], tuple[torch.Tensor, torch.Tensor, Projections, Any]]
    #: (dO, call, o, lse2, projections or all None to recompute them) → (dq, dk, dv, daq, dak, dbias)
    backward: Callable[..., tuple[torch.Tensor | None, ...]]
    #: (geometry, device) → the kept projections' buffers, unwritten (their shapes, for the fake forward)
    buffers: Callable[[Any, torch.device], Projections]


def _absent(like: torch.Tensor) -> torch.Tensor:
    """A missing projection (the spec has no such side, or the backward recomputes it): an op cannot return None."""
    return like.new_empty(0)


def _present(projections: list[torch.Tensor]) -> Projections:
    return tuple(p if p.numel() > 0 else None for p in projections)  # type: ignore[return-value]


def _kept(projections: Projections, like: torch.Tensor) -> list[torch.Tensor]:
    return [p if p is not None else _absent(like) for p in projections]


#: the call's options after its tensors, as both ops take them. The ops take and return q, k, v, O and their
#: gradients in the caller's `layout` (relgen.runtime.arguments.LAYOUTS), the kernels reading them through
#: [B, H, N, d] views
_OPTIONS = (
    "SymInt? max_seqlen, SymInt q_offset, SymInt k_offset, float dropout_p, SymInt seed, Tensor? seed_tensor, "
    "float? scale, str layout"
)
#: (o, lse2, [Z̃^Q, Z̃^K, their end columns; empty where absent]) — lse2 and the projections feed the backward
FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? aq, Tensor? ak, Tensor? bias, Tensor? kpm, Tensor? cu_seqlens, "
    f"{_OPTIONS}, bool keep_projections) -> (Tensor, Tensor, Tensor[])"
)
#: [dq, dk, dv, then the gradient of each table the call passed, in the order aq, ak, bias]
BACKWARD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse2, Tensor[] projections, Tensor? aq, "
    f"Tensor? ak, Tensor? bias, Tensor? kpm, Tensor? cu_seqlens, {_OPTIONS}) -> Tensor[]"
)

_REGISTERED: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
#: an op name is defined once per process: two threads defining one would leave the first's registration
#: destroyed under the second's
_REGISTERING = threading.Lock()


def compiled_packing(packing: dict[str, Any]) -> dict[str, Any]:
    """A call's packing options as the ops take them: cu_seqlens and max_seqlen. The separate form is accepted
    when it describes equal packing (one tensor for both sides, equal max_seqlen_q and max_seqlen_k)."""
    separate = {name: packing[name] for name in PACKING_OPTIONS[2:]}
    if all(value is None for value in separate.values()):
        return {"cu_seqlens": packing["cu_seqlens"], "max_seqlen": packing["max_seqlen"]}
    if packing["cu_seqlens"] is not None or packing["max_seqlen"] is not None:
        packing_sides(*(packing[name] for name in PACKING_OPTIONS))  # raises: both forms given
    cu_q, cu_k, max_q, max_k = separate.values()
    if cu_q is not cu_k or max_q != max_k:
        raise NotImplementedError(
            "cu_seqlens_q, cu_seqlens_k: separate query and key packing is not supported under torch.compile "
            "(eager only); under torch.compile pass equal packing as cu_seqlens and max_seqlen"
        )
    return {"cu_seqlens": cu_q, "max_seqlen": max_q}


def register(module_name: str, passes: Passes) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Define (once per module name, whichever thread asks first) the module's forward and backward ops and the
    autograd formula that joins them; returns `apply(q, k, v, aq, ak, bias, **options) → (o, lse2)`, a
    differentiable call of the forward op."""
    stem = re.sub(r"\W", "_", module_name)
    with _REGISTERING:
        if stem not in _REGISTERED:  # else the same module imported again: same source (its name holds its hash)
            _REGISTERED[stem] = _define(stem, passes)
        return _REGISTERED[stem]


def _define(stem: str, passes: Passes) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The ops torch.ops.relgen.<stem>_forward / _backward, and their differentiable call."""

    def prepare(q, k, v, aq, ak, bias, kpm, cu_seqlens, max_seqlen, q_offset, k_offset, dropout_p, seed, seed_tensor,
                scale, layout):  # fmt: skip
        dropout_seed = seed_tensor if seed_tensor is not None else seed if dropout_p else None
        return passes.prepare(
            q, k, v, aq, ak, bias, key_padding_mask=kpm, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            q_offset=q_offset, k_offset=k_offset, dropout_p=dropout_p, dropout_seed=dropout_seed, scale=scale,
            layout=layout,
        )  # fmt: skip

    @torch.library.custom_op(f"{NAMESPACE}::{stem}_forward", mutates_args=(), schema=FORWARD_SCHEMA)
    def forward(q, k, v, aq, ak, bias, kpm, cu_seqlens, max_seqlen, q_offset, k_offset, dropout_p, seed,
                seed_tensor, scale, layout, keep_projections):  # fmt: skip
        if dropout_p and seed_tensor is None and capturing():
            raise NotImplementedError(
                "dropout_seed: an int seed inside a CUDA graph (torch.compile mode='reduce-overhead') would be "
                "replayed at every step; pass a one-element int64 tensor on the device and update it in place "
                "between steps"
            )
        call = prepare(q, k, v, aq, ak, bias, kpm, cu_seqlens, max_seqlen, q_offset, k_offset, dropout_p, seed,
                       seed_tensor, scale, layout)  # fmt: skip
        o, lse2, projections, _ = passes.forward(call, keep_projections)
        return heads_major(o, layout), lse2, _kept(projections, lse2)

    @forward.register_fake
    def _(q, k, v, aq, ak, bias, kpm, cu_seqlens, max_seqlen, q_offset, k_offset, dropout_p, seed, seed_tensor,
          scale, layout, keep):  # fmt: skip
        # the real op's checks and allocations, on sizes that may be symbolic (torch.compile's dynamic shapes:
        # choosing the length bucket's tiles guards the graph on that bucket)
        call = prepare(q, k, v, aq, ak, bias, kpm, cu_seqlens, max_seqlen, q_offset, k_offset, dropout_p, seed,
                       seed_tensor, scale, layout)  # fmt: skip
        o = torch.empty_like(call.q)  # as the forward pass allocates it (its strides follow q's)
        lse2 = torch.empty(call.geo.token_rows(True), device=q.device, dtype=torch.float32)
        projections = passes.buffers(call.geo, q.device)
        if not keep:
            projections = (None,) * len(projections)
        return heads_major(o, layout), lse2, _kept(projections, lse2)

    @torch.library.custom_op(f"{NAMESPACE}::{stem}_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
    def backward(do, q, k, v, o, lse2, projections, aq, ak, bias, kpm, cu_seqlens, max_seqlen, q_offset, k_offset,
                 dropout_p, seed, seed_tensor, scale, layout):  # fmt: skip
        call = prepare(q, k, v, aq, ak, bias, kpm, cu_seqlens, max_seqlen, q_offset, k_offset, dropout_p, seed,
                       seed_tensor, scale, layout)  # fmt: skip
        do, o = heads_major(do, layout), heads_major(o, layout)
        dq, dk, dv, *dtables = passes.backward(do, call, o, lse2, _present(projections))
        tables = (call.aq, call.ak, call.bias)
        assert all((g is None) == (t is None) for g, t in zip(dtables, tables, strict=True)), "a table's gradient"
        return [*(heads_major(g, layout) for g in (dq, dk, dv)), *(g for g in dtables if g is not None)]

    @backward.register_fake
    def _(do, q, k, v, o, lse2, projections, aq, ak, bias, kpm, cu_seqlens, max_seqlen, q_offset, k_offset,
          dropout_p, seed, seed_tensor, scale, layout):  # fmt: skip
        tables = [torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (aq, ak, bias) if t is not None]
        # dq, dk, dv as the backward pass allocates them: like the Call's [B, H, N, d] views of q, k, v
        grads = [torch.empty_like(lastdim_contiguous(heads_major(x, layout))) for x in (q, k, v)]
        return [heads_major(g, layout) for g in grads] + tables

    def setup_context(ctx, inputs, output):
        q, k, v, aq, ak, bias, kpm, cu_seqlens = inputs[:8]
        max_seqlen, q_offset, k_offset, dropout_p, seed, seed_tensor, scale, layout, _keep = inputs[8:]
        o, lse2, projections = output
        ctx.save_for_backward(q, k, v, o, lse2, aq, ak, bias, kpm, cu_seqlens, seed_tensor, *projections)
        ctx.scalars = (max_seqlen, q_offset, k_offset, dropout_p, seed, scale, layout)
        ctx.mark_non_differentiable(lse2, *projections)

    def backward_formula(ctx, do, _dlse, _dprojections):
        q, k, v, o, lse2, aq, ak, bias, kpm, cu_seqlens, seed_tensor, *projections = ctx.saved_tensors
        max_seqlen, q_offset, k_offset, dropout_p, seed, scale, layout = ctx.scalars
        grads = iter(backward(do, q, k, v, o, lse2, projections, aq, ak, bias, kpm, cu_seqlens, max_seqlen,
                              q_offset, k_offset, dropout_p, seed, seed_tensor, scale, layout))  # fmt: skip
        dq, dk, dv = next(grads), next(grads), next(grads)
        dtables = [next(grads) if t is not None else None for t in (aq, ak, bias)]
        return dq, dk, dv, *dtables, *(None,) * 11

    forward.register_autograd(backward_formula, setup_context=setup_context)

    def apply(q, k, v, aq, ak, bias, *, key_padding_mask, cu_seqlens, max_seqlen, q_offset, k_offset, dropout_p,
              dropout_seed, scale, layout, keep_projections):  # fmt: skip
        if dropout_p and dropout_seed is None:
            raise NotImplementedError(
                "dropout_seed: required with dropout_p > 0 under torch.compile (the backward needs the forward's "
                "seed, which a seed drawn inside the graph could reach only through a host synchronisation); pass "
                "a new int per step, or under CUDA graphs a one-element int64 tensor updated in place"
            )
        as_tensor = isinstance(dropout_seed, torch.Tensor)
        layout = check_layout(layout)  # before the schema's str meets it
        if cu_seqlens is not None and max_seqlen is None:
            raise ValueError(
                "max_seqlen: required with cu_seqlens under torch.compile (the longest sequence cannot be read "
                "from the device while tracing), expected an int ≥ the longest sequence"
            )
        o, lse2, _ = forward(
            q, k, v, aq, ak, bias, key_padding_mask, cu_seqlens, max_seqlen, q_offset, k_offset, dropout_p,
            0 if as_tensor else dropout_seed or 0, dropout_seed if as_tensor else None, scale, layout,
            keep_projections,
        )  # fmt: skip
        return o, lse2

    return apply
