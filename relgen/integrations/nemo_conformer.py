"""NeMo Conformers on relgen's kernels: the ``RelPositionMultiHeadAttention`` of FastConformer and Parakeet encoders
(``self_attention_model: rel_pos``).

Matched by class name and module (``nemo.collections.asr.parts.submodules.multi_head_attention``); NeMo is never
imported here, its classes are recognised by name. ``RelPositionMultiHeadAttentionLongformer``
(``rel_pos_local_attn``, sliding windows with global tokens) is matched only to be named as unsupported, as is a
head dimension the kernels do not serve (d_model / n_heads outside 16, 32, 64, 128).

The module scores τ·((q_i + u)·k_j + (q_i + v)·p_δ), τ = 1/sqrt(d_k), with p = ``linear_pos(pos_emb)`` and the
layer's (or the encoder's shared) ``pos_bias_u``, ``pos_bias_v``. Since (q + v)·p = (q + u)·p + (v − u)·p it runs
as terms [query, bias] on an identity map (the form of ``specs/txl_uv.yaml``): query q + u, table p, bias
(v − u)·p per head. NeMo's ``pos_emb`` holds 2L − 1 rows for relative positions L − 1 … −(L − 1), L the key
length; relgen's identity row r holds δ = r − (L − 1), so the rows are flipped. Nothing N×N is formed on this path:
p and the bias are [H, 2L − 1] tables.

Masks: NeMo passes a [B, T1, T2] bool mask, True = masked, built by the encoder as "query or key is padding" (and,
with a limited ``att_context_size`` or ``chunked_limited``, a band or chunks as well). Each call checks, in row
blocks with no N×N temporary, that the mask is exactly the outer form of its real queries (rows not all masked) and
real keys (columns not all masked); the keys go in as ``key_padding_mask`` and the padded query rows are zeroed
before ``linear_out``, as NeMo zeroes their attention. A mask that is not is checked for that outer form within a
local window: the smallest band holding every allowed pair (query i at position i + T2 − T1 sees keys back to
``left`` before and ``right`` after it, NeMo's ``att_context_size`` [left, right] of the "regular" style, a side
that masks no real pair left unbounded), which must reproduce the mask exactly. The call then runs the spec with
``window: {left, right}`` (compiled once per window). ``chunked_limited`` is such a band only when its chunks are
one frame long or its right context is unlimited; any other mask (chunks, ``chunked_limited_with_rc``) falls back
to NeMo's code for the call, with one warning naming it.

Streaming (cache-aware, ``cache_last_channel``): NeMo's own ``update_cache`` prepends the cache to the keys, and the
T1 queries are the last of T2 positions: ``q_offset = T2 − T1``.

Precision: under autocast NeMo casts the inputs to fp32 and then runs its projections and its attention's
products inside ``avoid_float16_autocast_context`` (fp16 autocast turned to bf16 where the GPU has it, else fp32),
so its attention computes in that autocast dtype: bf16 on the GPUs relgen targets. relgen's kernels run in the same
dtype by default (the dtype of the autocast NeMo's guard leaves active), so the patched model keeps NeMo's own
numerics; ``patch(model, attention_dtype=torch.float32)`` (or ``torch.bfloat16``, ``torch.float16``) runs the
kernels in that dtype instead. Without autocast the kernels run in the activations' dtype. A float64 call falls back to
NeMo's code (the kernels serve fp16, bf16 and fp32). Training-mode attention dropout runs inside the kernels
(relgen's own random stream). ``patch(model, recompute_projections=True)`` has the backward recompute the
relation projections instead of keeping them: an identity map keeps H·T1·T2 of them per layer, which at long
recordings is most of a training step's memory. The calls take ``projections="auto"`` (relgen.runtime.memory:
stored projections while they fit the budget, else relation products inside the tiles where the kernels serve
the call), budgeting in training for every layer the same `patch` call served (each keeps its projections until
its backward: the mechanism's ``layers``; where they do not fit together, the calls recompute them in the
backward); ``patch(model, projections="stored")`` or ``"tiled"`` forces one.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from relgen.integrations._core import Adapter, Unsupported, fall_back, register
from relgen.runtime.arguments import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from relgen.runtime.mechanism import Mechanism, compile_mechanism
from relgen.runtime.memory import check_strategy

_MODULE = "nemo.collections.asr.parts.submodules.multi_head_attention"
_SERVED = "RelPositionMultiHeadAttention"
_LOCAL = "RelPositionMultiHeadAttentionLongformer"

_TXL_UV = {
    "name": "txl_uv",
    "description": "Transformer-XL with u, v folded in: query q + u, table p, bias (v - u)·p (specs/txl_uv.yaml)",
    "terms": ["query", "bias"],
    "map": {"kind": "identity"},
}

_NOT_PADDING = "an attention mask that is not a padding mask"
_NOT_WINDOW = (
    "an attention mask that is neither padding nor padding within a local window (chunked_limited attention with "
    "chunks longer than one frame, or chunked_limited_with_rc: its chunks are a block mask, which no window "
    "expresses)"
)
#: mask elements compared at once by the padding check: bounds its temporaries (two bool blocks) at 32 MiB
_CHECK_BLOCK = 1 << 24

#: a local window (left, right): keys at most `left` positions before and `right` after the query; None: unbounded
Window = tuple[int | None, int | None]


@dataclass(frozen=True)
class _State:
    mechanism: Mechanism
    attention_dtype: torch.dtype | None  # None: NeMo's own (its autocast dtype), else the activations' dtype
    recompute_projections: bool
    projections: str  # the calls' projections= (relgen.runtime.memory): "auto" unless patch was given another
    windowed: dict[Window, Mechanism] = field(default_factory=dict)  # the spec with each window a call needed
    # [the layers patched with this one]: in training each keeps its stored projections until its backward, and
    # "auto" budgets for them together (the mechanism's `layers`)
    layers: list[int] = field(default_factory=lambda: [1])
    # [(u, v, their versions, dtype and device, (u, v − u) in that dtype)]: kept across calls without autograd
    biases: list = field(default_factory=lambda: [None])

    def biases_in(self, module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """u and v − u in `dtype` (each rounded to it before the difference, as the mechanism's call always did).
        Without autograd they are kept until u or v changes (their version counters advance with every in-place
        update: an optimizer step) or another dtype is asked for: three launches fewer per layer."""
        u, v = module.pos_bias_u, module.pos_bias_v
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or u.is_inference() or v.is_inference():
            u_d = u.to(dtype)
            return u_d, v.to(dtype) - u_d
        meta = (u._version, v._version, dtype, u.device)
        kept = self.biases[0]  # one read: another thread may replace it
        if kept is not None and kept[0] is u and kept[1] is v and kept[2] == meta:
            return kept[3]
        u_d = u.to(dtype)
        folded = (u_d, v.to(dtype) - u_d)
        self.biases[0] = (u, v, meta, folded)
        return folded

    def mechanism_for(self, window: Window | None) -> Mechanism:
        if window is None:
            return self.mechanism
        mechanism = self.windowed.get(window)
        if mechanism is None:  # compile_mechanism is itself cached and thread-safe: a race compiles once
            left, right = window
            mechanism = compile_mechanism({**_TXL_UV, "window": {"left": left, "right": right}})
            self.windowed[window] = mechanism
        return mechanism


def _matches(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__module__ == _MODULE and cls.__name__ in (_SERVED, _LOCAL)


def _prepare(
    module: nn.Module,
    *,
    attention_dtype: torch.dtype | None = None,
    recompute_projections: bool = False,
    projections: str = "auto",
) -> _State:
    if attention_dtype is not None and attention_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"attention_dtype: expected None or one of {SUPPORTED_DTYPES}, got {attention_dtype!r}")
    if not isinstance(recompute_projections, bool):
        raise ValueError(f"recompute_projections: expected a bool, got {type(recompute_projections).__name__}")
    if type(module).__name__ == _LOCAL:
        raise Unsupported(
            "self_attention_model='rel_pos_local_attn' (RelPositionMultiHeadAttentionLongformer: sliding windows "
            "with global tokens)"
        )
    if module.d_k not in SUPPORTED_HEAD_DIMS:
        raise Unsupported(f"head_dim={module.d_k} (d_model / n_heads; the kernels serve {SUPPORTED_HEAD_DIMS})")
    return _State(compile_mechanism(_TXL_UV), attention_dtype, recompute_projections, check_strategy(projections))


def _forward(
    module: nn.Module,
    state: _State,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    pos_emb: torch.Tensor,
    cache: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    def own_code(feature: str) -> Any:
        return fall_back(module, feature, query, key, value, mask, pos_emb, cache=cache)

    autocast = torch.is_autocast_enabled()  # NeMo's own test (CUDA autocast)
    if not autocast and query.dtype not in SUPPORTED_DTYPES:
        return own_code(f"{query.dtype} inputs")
    new_key, new_value, new_query, new_cache = module.update_cache(key=key, value=value, query=query, cache=cache)
    batch, t1, t2 = new_query.shape[0], new_query.shape[1], new_key.shape[1]
    if t1 > t2:
        return own_code("more queries than keys")
    if pos_emb.dim() != 3 or pos_emb.shape[0] != 1 or pos_emb.shape[1] != 2 * t2 - 1:
        return own_code("pos_emb not of shape [1, 2·T2 − 1, d_model]")
    key_valid, window, feature, query_padding = _layer_masks(mask, batch, t1, t2)
    if feature is not None:
        return own_code(feature)

    if autocast:
        new_query, new_key, new_value = (x.to(torch.float32) for x in (new_query, new_key, new_value))
    with _nemo_autocast(module):
        q, k, v = module.forward_qkv(new_query, new_key, new_value)
        p = module.linear_pos(pos_emb)
        dtype = state.attention_dtype
        if dtype is None:  # NeMo's own: the autocast its guard leaves active, else the activations'
            dtype = torch.get_autocast_dtype(q.device.type) if autocast else q.dtype
        # relgen's arithmetic in `dtype` exactly: autocast would lower the fold's einsum
        with torch.autocast(q.device.type, enabled=False):
            out = _attend(module, state, q, k, v, p, key_valid, t2 - t1, dtype, window).to(v.dtype)
        out = out.transpose(1, 2).reshape(batch, t1, module.h * module.d_k)
        if query_padding is not None:
            out = out.masked_fill(query_padding, 0.0)  # NeMo zeroes the attention of padded queries
        out = module.linear_out(out)
    return out if cache is None else (out, new_cache)


def _attend(
    module: nn.Module,
    state: _State,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    key_valid: torch.Tensor | None,
    q_offset: int,
    dtype: torch.dtype,
    window: Window | None = None,
) -> torch.Tensor:
    """relgen's attention [B, H, T1, d_k] of NeMo's projections: query q + u, table p in relgen's identity rows
    [H, 2·T2 − 1, d_k], bias (v − u)·p [H, 2·T2 − 1]; keys outside `window` masked."""
    heads, d_k = module.h, module.d_k
    table = p.view(p.shape[1], heads, d_k).flip(0).transpose(0, 1).to(dtype)
    u, v_minus_u = state.biases_in(module, dtype)
    bias = torch.einsum("hd,hrd->hr", v_minus_u, table)
    return state.mechanism_for(window)(
        (q.to(dtype) + u[None, :, None, :]),
        k.to(dtype),
        v.to(dtype),
        # contiguous here, as the kernels read it: a call with contiguous tables reuses the argument checks of an
        # earlier call of the same shapes (relgen.runtime.arguments.prepare_call), one per layer otherwise
        aq=table.contiguous(),
        bias=bias,
        key_padding_mask=key_valid,
        q_offset=q_offset,
        scale=1.0 / module.s_d_k,
        dropout_p=module.dropout_rate if module.training else 0.0,
        recompute_projections=state.recompute_projections,
        projections=state.projections,
        layers=state.layers[0],
    )


def _nemo_autocast(module: nn.Module) -> AbstractContextManager:
    """The context NeMo's forward runs its projections in (fp16 autocast turned to bf16 or fp32), taken from the
    module's own file so that both paths project alike."""
    guard = getattr(sys.modules.get(type(module).__module__), "avoid_float16_autocast_context", None)
    return guard() if guard is not None else nullcontext()


#: the last mask `_layer_masks` read, as (a weak reference to it, what identifies its contents, what it found)
_LAST_MASK: tuple[weakref.ref, tuple, tuple] | None = None


def _layer_masks(
    mask: Any, batch: int, t1: int, t2: int
) -> tuple[torch.Tensor | None, Window | None, str | None, torch.Tensor | None]:
    """(real keys, window, feature) as `_masks` finds them, and the padded queries [B, T1, 1] (None: none), for a
    mask the last call may have read already: an encoder hands one mask to each of its layers, and reading it costs
    the host a wait for the GPU (its checks end in values the host must see) and a dozen launches, per layer. The
    same tensor, unmodified (its version counter, which every in-place change advances; an inference-mode tensor
    has none and is read every time), reuses the last reading."""
    global _LAST_MASK
    key = None
    if isinstance(mask, torch.Tensor) and not mask.is_inference() and not torch.compiler.is_compiling():
        key = (mask._version, mask.data_ptr(), tuple(mask.shape), mask.dtype, mask.device, batch, t1, t2)
        last = _LAST_MASK
        if last is not None and last[0]() is mask and last[1] == key:
            return last[2]
    query_valid, key_valid, window, feature = _masks(mask, batch, t1, t2)
    found = (key_valid, window, feature, ~query_valid[:, :, None] if query_valid is not None else None)
    if key is not None:
        _LAST_MASK = (weakref.ref(mask), key, found)
    return found


def _masks(
    mask: Any, batch: int, t1: int, t2: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, Window | None, str | None]:
    """(real queries, real keys, local window or None, None) of a padding mask, or of one within a local window;
    else (None, None, None, the feature that keeps the call on NeMo's code)."""
    query_valid, key_valid, feature = _padding(mask, batch, t1, t2)
    if feature != _NOT_PADDING:
        return query_valid, key_valid, None, feature
    return _windowed_padding(mask, batch, t1, t2)


def _windowed_padding(
    mask: torch.Tensor, batch: int, t1: int, t2: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, Window | None, str | None]:
    """`_masks` for a mask that is not padding: its allowed pairs must be exactly (real queries × real keys) within
    the smallest window holding all of them, query row i at position a_i = i + T2 − T1.

    The window is read from each row's first and last allowed key (left = max a_i − first_i, right = max last_i −
    a_i, at least 0) and kept only on a side where some real pair lies beyond it, so that a context wider than the
    call's sequences compiles no window of its own. Any window that holds the mask contains this one, and every
    window between the two holds it too: the check of this one alone decides. Any pair the band admits but the mask
    masks (chunks) fails it. Like `_padding`, in blocks of rows, with no N×N temporary.
    """
    rows_of, device = mask.shape[0], mask.device
    query_valid, key_valid = ~mask.all(dim=2), ~mask.all(dim=1)
    position = torch.arange(t1, device=device) + (t2 - t1)
    columns = torch.arange(t2, device=device)
    first = torch.empty(rows_of, t1, dtype=torch.int64, device=device)
    last = torch.empty_like(first)
    rows = max(1, _CHECK_BLOCK // (rows_of * t2))
    for i in range(0, t1, rows):
        allowed = (~mask[:, i : i + rows]).to(torch.uint8)  # argmax gives the first of equal maxima; bool has none
        first[:, i : i + rows] = allowed.argmax(dim=2)
        last[:, i : i + rows] = t2 - 1 - allowed.flip(2).argmax(dim=2)
    far = 2 * (t1 + t2)  # beyond any offset: rows and batch entries without a real pair drop out of the maxima
    bounds = torch.stack(
        [
            torch.where(query_valid, position - first, -far).amax(),
            torch.where(query_valid, last - position, -far).amax(),
            # the farthest real pair on each side: real queries' positions against real keys'
            (torch.where(query_valid, position, -far).amax(1) - torch.where(key_valid, columns, far).amin(1)).amax(),
            (torch.where(key_valid, columns, -far).amax(1) - torch.where(query_valid, position, far).amin(1)).amax(),
        ]
    ).tolist()
    # a window's sides are ≥ 0: where every allowed pair lies on one side of the diagonal, the band that also
    # admits δ = 0 may still hold the mask (no real pair at δ = 0), which the check below decides
    left, right, farthest_left, farthest_right = (int(b) for b in bounds)
    left, right = max(left, 0), max(right, 0)
    window = (left if left < farthest_left else None, right if right < farthest_right else None)
    mismatch = torch.zeros((), dtype=torch.bool, device=device)
    for i in range(0, t1, rows):
        inside = torch.ones(1, dtype=torch.bool, device=device)
        if window[0] is not None:
            inside = inside & (columns[None, :] >= position[i : i + rows, None] - window[0])
        if window[1] is not None:
            inside = inside & (columns[None, :] <= position[i : i + rows, None] + window[1])
        outer = query_valid[:, i : i + rows, None] & key_valid[:, None, :] & inside
        mismatch |= (mask[:, i : i + rows] == outer).any()  # the mask must be outer's complement, as in _padding
    mismatched, all_queries, all_keys = _read(mismatch, query_valid.all(), key_valid.all())
    if mismatched:
        return None, None, None, _NOT_WINDOW
    return *_real(query_valid, key_valid, batch, all_queries, all_keys), window, None


def _padding(mask: Any, batch: int, t1: int, t2: int) -> tuple[torch.Tensor | None, torch.Tensor | None, str | None]:
    """(real queries [B, T1], real keys [B, T2], None) for a padding mask, None for "all real"; else (None, None,
    the feature that keeps the call on NeMo's code).

    NeMo's padding mask masks (i, j) iff query i or key j is padding. Its rows that are not all masked are the real
    queries and its columns that are not all masked the real keys; the mask is padding iff it equals the outer form
    of the two, checked in blocks of rows so that no N×N temporary exists beside NeMo's own mask.
    """
    if mask is None:
        return None, None, None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return None, None, f"an attention mask of type {getattr(mask, 'dtype', type(mask).__name__)}"
    if mask.dim() != 3 or mask.shape[0] not in (1, batch) or tuple(mask.shape[1:]) != (t1, t2):
        return None, None, "an attention mask not of shape [B, T1, T2]"
    if not bool(mask.any()):
        return None, None, None
    query_valid = ~mask.all(dim=2)
    key_valid = ~mask.all(dim=1)
    mismatch = torch.zeros((), dtype=torch.bool, device=mask.device)
    rows = max(1, _CHECK_BLOCK // (mask.shape[0] * t2))
    for i in range(0, t1, rows):
        outer = query_valid[:, i : i + rows, None] & key_valid[:, None, :]
        # the mask must be the complement of `outer`: agreeing anywhere is a real pair masked or a padded one not
        mismatch |= (mask[:, i : i + rows] == outer).any()
    mismatched, all_queries, all_keys = _read(mismatch, query_valid.all(), key_valid.all())
    if mismatched:
        return None, None, _NOT_PADDING
    return *_real(query_valid, key_valid, batch, all_queries, all_keys), None


def _read(*flags: torch.Tensor) -> list[bool]:
    """Device booleans on the host in one read: each read makes the host wait for the GPU, which then idles while
    the host issues the next launches."""
    return torch.stack(flags).tolist()  # a bool tensor's list holds Python bools


def _real(
    query_valid: torch.Tensor, key_valid: torch.Tensor, batch: int, all_queries: bool, all_keys: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The real queries [B, T1] and keys [B, T2] of a mask's (maybe batch-shared) rows and columns, given whether
    all of them are real (None then)."""
    query_valid, key_valid = query_valid.expand(batch, -1), key_valid.expand(batch, -1)
    return (None if all_queries else query_valid), (None if all_keys else key_valid.contiguous())


def _patched(states: list[_State]) -> None:
    for state in states:
        state.layers[0] = len(states)


register(
    Adapter(
        "nemo_conformer",
        _matches,
        _prepare,
        _forward,
        options=("attention_dtype", "recompute_projections", "projections"),
        patched=_patched,
    )
)
