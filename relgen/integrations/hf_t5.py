"""Hugging Face T5 and mT5 on relgen's kernels.

Matches `T5Attention` (`transformers.models.t5.modeling_t5`) and `MT5Attention` (`…mt5.modeling_mt5`) by class
name and module, without importing transformers: `T5Model`, `T5ForConditionalGeneration`, `T5EncoderModel`, every
head built on them and their MT5 twins. `patch` names the self-attention modules of both stacks; the decoder's
cross-attention modules are patched as helpers (unnamed): they have no relative term (relgen needs one) and run
torch's SDPA, given the padding as a [B, 1, 1, Nk] mask.

Self-attention scores are q_i·k_j + b_h[bucket(j − i)], τ = 1, b being block 0's `relative_attention_bias.weight.T`
[H, num_buckets], which every layer of the stack reads (the gradients of all layers sum into it, as in HF): map
`t5` with the config's `relative_attention_num_buckets` and `relative_attention_max_distance`, bidirectional in the
encoder, unidirectional and causal in the decoder, as relgen's `bias` table (cast to q's dtype under autocast).

Nothing [Nq, Nk]-sized is built beyond a short call's bias rows (below). HF's block 0 computes a dense [1, H, Nq, Nk]
bias that later layers reuse, cross-attention adds [1, H, Nq, Nk] zeros, and the stacks build [B, 1, Nq, Nk] masks.
Patching switches each stack's `config._attn_implementation` to ``relgen_t5`` (`unpatch` switches it back), registered
with transformers both as a mask function, which keeps the arguments HF's mask would be made from (the [B, Nk]
padding, the query offset the cache reports, the key length), and as the attention function. A patched module runs the
model's own forward (projections, cache updates) with a marker as `position_bias` (block 0's table; none in
cross-attention), so that no bias is computed; the attention function then calls relgen with `key_padding_mask` and
`q_offset` from the cache. A static cache's keys beyond its filled length lie after every query, so causality masks
them (and so does the padding mask, when one is given: HF pads it with False to the cache's length).

A call of at most `ROW_QUERIES` queries (a decode step of `generate()`, a short decoder) is served by torch's SDPA
over its bias rows b_h[φ(δ)], [1, H, Nq, Nk] ([B, H, Nq, Nk] where keys are padded), φ read from the mechanism's
plan (β(clip(δ, L, U) − L), as the kernels read it), finfo.min where HF masks a score. At that Nq the
rows are linear in Nk, and one SDPA launch a layer costs the host less than the checks and launches of a kernel
call, which decide a decode step. Without gradients a stack forms its rows once per call and its layers share them
(as HF's block 0 shares its bias).

A query with no key (decoder rows before the first real token under left padding) is what HF makes of it: every
score gets finfo.min, so its softmax is uniform over all Nk keys and its output mean_j v_j, and the backward
through that softmax reaches q and k (dS_ij = (do_i·(v_j − v̄))/Nk, torch SDPA's gradient; HF's eager attention
also sends it to the bias table). relgen's kernels give such rows 0; they are filled in O(N·d²).

These calls run the model's own code, with one warning per feature: `output_attentions` (keyword or config), head
masks, float64 inputs (HF's own float64 path is the exact one), a 3-D/4-D attention mask, a mask pattern other
than causal or bidirectional (packed sequences), a cache with a key offset, an attention implementation set after
patching, and queries without a key when the stack's own implementation is neither SDPA nor eager, or is eager
and gradients are on (its bias table's gradient). Refused at `patch`: head dims (`d_kv`) the kernels do not serve,
bucket settings relgen's `t5` map rejects. Attention dropout in training runs in the kernels from relgen's own
random stream (not HF's bits); a row without a key then gets its mean without dropout.
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from relgen.integrations._core import Adapter, Unsupported, fall_back, register, run_original, warn_once
from relgen.integrations._hf import wants_attentions

FAMILY = "t5"
#: the name under which the attention and mask functions are registered with transformers
IMPLEMENTATION = "relgen_t5"
#: calls of at most this many queries run SDPA over their bias rows (see the module's docstring): a decode step's
#: one query fills 1/64 of the kernels' smallest query tile, and its call is bound by the host
ROW_QUERIES = 16
_HF_CLASSES = frozenset(
    {("T5Attention", "transformers.models.t5.modeling_t5"), ("MT5Attention", "transformers.models.mt5.modeling_mt5")}
)
_HEAD_MASKS = ("head_mask", "layer_head_mask", "cross_attn_head_mask", "cross_attn_layer_head_mask")


def _is_hf(module: nn.Module) -> bool:
    # the exact class: a subclass may override the forward whose pieces this adapter relies on
    return (type(module).__name__, type(module).__module__) in _HF_CLASSES


def _is_cross(module: nn.Module) -> bool:
    # T5LayerCrossAttention builds its T5Attention with is_causal=False; the decoder's self-attention is causal
    return bool(module.is_decoder) and not module.is_causal and not module.has_relative_attention_bias


@dataclass(frozen=True)
class _State:
    original: str | None  # the stack's attention implementation before patching
    buckets: int
    max_distance: int
    bidirectional: bool
    mechanisms: dict[bool, Any] = field(default_factory=dict, compare=False)  # by causal

    def spec(self, causal: bool) -> dict[str, Any]:
        direction = "bidirectional" if self.bidirectional else "unidirectional"
        return {
            "name": "hf_t5",
            "description": f"Hugging Face T5Attention: b[bucket(j - i)], {self.buckets} {direction} buckets up to "
            f"distance {self.max_distance}, tau = 1",
            "terms": ["bias"],
            "map": {
                "kind": "t5",
                "num_buckets": self.buckets,
                "max_distance": self.max_distance,
                "bidirectional": self.bidirectional,
            },
            "scale": 1,
            "causal": causal,
        }

    def mechanism(self, causal: bool) -> Any:
        fn = self.mechanisms.get(causal)
        if fn is None:
            import relgen

            fn = self.mechanisms[causal] = relgen.compile_mechanism(self.spec(causal))
        return fn

    def __reduce__(self) -> tuple[Any, ...]:
        # a compiled mechanism holds its generated module, which cannot be copied: a deep copy (or a pickle) of a
        # patched model compiles (from relgen's cache) again
        return _State, (self.original, self.buckets, self.max_distance, self.bidirectional)


@dataclass(frozen=True, eq=False)
class _Relation:
    """What a patched T5Attention hands its own forward as `position_bias`, and the next layer receives: block 0's
    table [num_buckets, H] (None in cross-attention) and the module's state. HF computes no bias when one is given."""

    table: torch.Tensor | None
    state: _State


class _Mask:
    """What a patched stack's mask creation returns: the arguments HF's own mask function would build its mask
    from. The padding stays [B, Nk]; the dense mask is built only for a call on the model's own code."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

        offset = arguments.get("q_offset", 0)
        if isinstance(offset, torch.Tensor):
            # a static cache reports its live length, which the first layer's cache update advances in place
            offset = offset.clone()
            arguments = {**arguments, "q_offset": offset}
        self.arguments = arguments
        self.q_offset = int(offset)
        self.kv_offset = int(arguments.get("kv_offset", 0))
        self.q_length = int(arguments["q_length"])
        self.kv_length = int(arguments["kv_length"])
        self.padding = arguments.get("attention_mask")
        pattern = arguments.get("mask_function")
        self.causal = {causal_mask_function: True, bidirectional_mask_function: False}.get(pattern)
        self._dense: dict[str | None, Any] = {}
        self._additive: dict[torch.dtype, torch.Tensor | None] = {}
        self._rows: dict[torch.dtype, torch.Tensor] = {}

    def unserved(self) -> str | None:
        if self.causal is None:
            return "a mask pattern other than causal or bidirectional (e.g. packed sequences)"
        if self.padding is not None and (not isinstance(self.padding, torch.Tensor) or self.padding.dim() != 2):
            return "an attention mask that is not a [B, N] padding mask"
        if self.kv_offset:
            return "a cache with a key offset"
        return None

    @functools.cached_property
    def key_padding_mask(self) -> torch.Tensor | None:
        """[B, Nk] bool, True = a real key, as HF pads and slices it; None when no key is padding."""
        if self.padding is None:
            return None
        from transformers.masking_utils import prepare_padding_mask

        padded = prepare_padding_mask(self.padding, self.kv_length, self.kv_offset)
        mask = padded[:, self.kv_offset : self.kv_offset + self.kv_length].to(torch.bool)
        return None if bool(mask.all()) else mask.contiguous()

    @functools.cached_property
    def keyless_rows(self) -> torch.Tensor | None:
        """[B, Nq] bool, True = a query with no key to attend to; None when every query has one."""
        keys = self.key_padding_mask
        if keys is None:
            return None
        if self.causal:
            # the last key index causality lets query i see, and how many real keys lie up to it
            last = torch.arange(self.q_length, device=keys.device) + (self.q_offset - self.kv_offset)
            seen = keys.cumsum(dim=1).gather(1, last.clamp(0, keys.shape[1] - 1).expand(keys.shape[0], -1))
            rows = (seen == 0) | (last < 0)
        else:
            rows = (~keys.any(dim=1, keepdim=True)).expand(-1, self.q_length)
        return rows if bool(rows.any()) else None

    def additive(self, dtype: torch.dtype) -> torch.Tensor | None:
        """HF's additive padding mask as [B, 1, 1, Nk] (0, or finfo.min on a padded key), for SDPA; built once per
        stack call and dtype, not per cross-attention layer. None when no key is padding."""
        if dtype not in self._additive:
            keys, additive = self.key_padding_mask, None
            if keys is not None:
                additive = torch.zeros(keys.shape, dtype=dtype, device=keys.device)
                additive = additive.masked_fill(~keys, torch.finfo(dtype).min)[:, None, None, :]
            self._additive[dtype] = additive
        return self._additive[dtype]

    def bias_rows(self, relation: _Relation, dtype: torch.dtype) -> torch.Tensor:
        """The scores' additive term of a call served by SDPA: b_h[φ(δ)] where a key is visible, finfo.min where
        it is masked (causality, padding); [1, H, Nq, Nk], or [B, H, Nq, Nk] where keys are masked. Formed once per
        stack call and dtype without gradients (every layer reads block 0's table), per layer with them, so that
        the table's gradient is autograd's through each layer's use."""
        kept = not torch.is_grad_enabled()
        if kept and dtype in self._rows:
            return self._rows[dtype]
        table = relation.table  # [num_buckets, H]
        queries = torch.arange(self.q_length, device=table.device) + self.q_offset
        delta = queries[:, None] - torch.arange(self.kv_length, device=table.device)  # kv_offset is 0
        rows = relation.state.mechanism(bool(self.causal)).offset_rows(delta)
        # [1, H, Nq, Nk] with unit stride along the keys: on a GPU, torch's fused SDPA kernels take no mask without
        # it (the math path's launches would decide the step)
        bias = table.t()[:, rows][None].to(dtype).contiguous()
        visible = delta >= 0 if self.causal else None
        if self.key_padding_mask is not None:
            real = self.key_padding_mask[:, None, None, :]
            visible = real if visible is None else real & visible
        if visible is not None:
            bias = torch.where(visible, bias, torch.finfo(dtype).min)
        if kept:
            self._rows[dtype] = bias
        return bias

    def dense(self, implementation: str | None) -> Any:
        """The mask HF builds for `implementation` (None where HF builds none)."""
        if implementation not in self._dense:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

            # as masking_utils decides: an implementation without a mask function of its own gets no mask
            known = implementation in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
            self._dense[implementation] = (
                ALL_MASK_ATTENTION_FUNCTIONS[implementation](**self.arguments) if known else None
            )
        return self._dense[implementation]


def _deferred_mask(**arguments: Any) -> _Mask:
    return _Mask(arguments)


# the attention implementation each switched config had, by id (configs are not hashable), for the calls that run
# the model's own code in a patched stack
_SWITCHED: dict[int, tuple[weakref.ref, str | None]] = {}


def _remember(config: Any, original: str | None) -> None:
    entry = _SWITCHED.get(id(config))
    if entry is None or entry[0]() is not config:
        _SWITCHED[id(config)] = (weakref.ref(config), original)


def _original_implementation(config: Any) -> str | None:
    entry = _SWITCHED.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    return "eager" if config._attn_implementation == IMPLEMENTATION else config._attn_implementation


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _deferred_mask)


def _prepare(module: nn.Module) -> _State:
    from relgen.runtime.arguments import SUPPORTED_HEAD_DIMS
    from relgen.spec.model import SpecError

    head_dim = module.key_value_proj_dim
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise Unsupported(f"head_dim={head_dim} (d_kv; the kernels serve {', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
    config = module.config
    current = config._attn_implementation
    entry = _SWITCHED.get(id(config))
    switched = current == IMPLEMENTATION and entry is not None and entry[0]() is config
    if current == IMPLEMENTATION and not switched:
        raise Unsupported(f"attn_implementation={IMPLEMENTATION!r} set by hand (relgen.integrations.patch sets it)")
    state = _State(
        original=entry[1] if switched else current,
        buckets=module.relative_attention_num_buckets,
        max_distance=module.relative_attention_max_distance,
        bidirectional=not module.is_decoder,
    )
    try:
        # the stack's self-attention mechanism, also for cross-attention: a stack relgen cannot serve stays whole
        state.mechanism(causal=bool(module.is_decoder))
    except SpecError as why:
        raise Unsupported(
            f"relative_attention_num_buckets={state.buckets} with relative_attention_max_distance="
            f"{state.max_distance} ({why})"
        ) from None
    _register()
    _remember(config, state.original)
    config._attn_implementation = IMPLEMENTATION
    return state


def _restore(module: nn.Module, state: _State) -> None:
    config = module.config
    if config._attn_implementation == IMPLEMENTATION:
        config._attn_implementation = state.original
    entry = _SWITCHED.get(id(config))
    if entry is not None and entry[0]() is config:
        del _SWITCHED[id(config)]


def _forward(
    module: nn.Module,
    state: _State,
    hidden_states: torch.Tensor,
    mask: Any = None,
    key_value_states: torch.Tensor | None = None,
    position_bias: Any = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[Any, ...]:
    # a deep copy of a patched model switched a config this process has not seen
    _remember(module.config, state.original)
    call = {"mask": mask, "key_value_states": key_value_states, "past_key_values": past_key_values, **kwargs}
    feature = _unserved(module, hidden_states, mask, key_value_states, position_bias, kwargs)
    if feature is not None and not _is_cross(module):
        return fall_back(module, feature, hidden_states, position_bias=position_bias, **call)
    if feature is not None:
        # a helper: its warning is the family's, so that a call falling back in both kinds of module warns once
        warn_once(FAMILY, feature, f"{feature} is not served by relgen's kernels; this call runs the model's own code")
        return run_original(module, hidden_states, position_bias=position_bias, **call)
    if key_value_states is not None:
        relation = _Relation(None, state)
    elif module.has_relative_attention_bias:
        relation = _Relation(module.relative_attention_bias.weight, state)
    else:
        relation = _Relation(position_bias.table, state)
    # the model's own projections and cache updates; given a position_bias it builds none, and its attention call
    # reaches _attention, the stack's attention implementation while patched
    return run_original(module, hidden_states, position_bias=relation, **call)


def _unserved(
    module: nn.Module,
    hidden_states: torch.Tensor,
    mask: Any,
    key_value_states: Any,
    position_bias: Any,
    kwargs: dict[str, Any],
) -> str | None:
    """The feature of this call that keeps it on the model's own code, or None. Each depends only on the stack's
    call, so every layer of a stack takes the same road (a layer's position_bias comes from block 0's)."""
    if wants_attentions(kwargs):
        return "output_attentions"
    for name in _HEAD_MASKS:
        if kwargs.get(name) is not None:
            return name
    if hidden_states.dtype == torch.float64:
        return "float64 inputs"
    implementation = module.config._attn_implementation
    if implementation != IMPLEMENTATION:
        return f"attn_implementation={implementation!r} set after patching"
    if isinstance(mask, _Mask):
        feature = mask.unserved()
        if feature is not None:
            return feature
        if mask.keyless_rows is not None:
            # relgen fills these rows as SDPA and eager attention do; the eager backward also sends their softmax's
            # gradient to the bias table
            original = _original_implementation(module.config)
            table_gradient = original == "eager" and key_value_states is None and torch.is_grad_enabled()
            if original not in ("sdpa", "eager") or table_gradient:
                return f"a query without a key under attn_implementation={original!r}" + (
                    " with gradients" if table_gradient else ""
                )
    elif isinstance(mask, torch.Tensor):
        return f"a {mask.dim()}-D attention mask"
    elif mask is None:
        # HF's implementations differ there (SDPA's adds causality from the module): only its own code is HF's
        return "a call without its stack's mask"
    else:
        return f"an attention mask of type {type(mask).__name__}"
    if key_value_states is not None:  # layer 0's cross-attention gets None, the later ones its _Relation
        if position_bias is not None and not (isinstance(position_bias, _Relation) and position_bias.table is None):
            return "a position_bias passed in"
    elif module.has_relative_attention_bias:
        if position_bias is not None:
            return "a position_bias passed in"
    elif not (isinstance(position_bias, _Relation) and position_bias.table is not None):
        return "a position_bias from a block 0 on the model's own code"
    return None


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_bias: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function of a patched stack: relgen (or SDPA, without a relative term) for a patched module's
    call, else the model's own attention with the mask HF would have built."""
    if not isinstance(position_bias, _Relation):
        kwargs.update(dropout=dropout, scaling=scaling, position_bias=position_bias)
        return _own_attention(module, query, key, value, attention_mask, **kwargs)
    mask: _Mask = attention_mask  # the patched forward let only its stack's _Mask through
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    keys = mask.key_padding_mask
    if position_bias.table is None:
        out = _plain(query, key, value, mask.additive(query.dtype), dropout, scale)
    elif mask.q_length <= ROW_QUERIES:
        out = _plain(query, key, value, mask.bias_rows(position_bias, query.dtype), dropout, scale)
    else:
        fn = position_bias.state.mechanism(causal=bool(mask.causal))
        out = fn(
            query,
            key,
            value,
            bias=position_bias.table.t().to(query.dtype),
            key_padding_mask=keys,
            q_offset=mask.q_offset,
            k_offset=mask.kv_offset,
            dropout_p=dropout,
            scale=scale,
        )
        if mask.keyless_rows is not None:
            out = _keyless(out, query, key, value, mask.keyless_rows, scale)
    return out.transpose(1, 2).contiguous(), None


def _own_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
) -> Any:
    """The model's own attention, for a call on its own code in a patched stack: the mask HF would have built for
    the implementation the stack had."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = _original_implementation(module.config)
    if isinstance(mask, _Mask):
        mask = mask.dense(original)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(original, eager)(module, query, key, value, mask, **kwargs)


def _plain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive: torch.Tensor | None, dropout: float, scale: float
) -> torch.Tensor:
    """SDPA with an additive term: cross-attention's padding mask as [B, 1, 1, Nk] (_Mask.additive) rather than
    [B, H, Nq, Nk], or a short call's bias rows (_Mask.bias_rows). A query whose keys are all masked gets HF's
    uniform softmax, its scores all being finfo.min."""
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=dropout, scale=scale)


def _keyless(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float
) -> torch.Tensor:
    """HF's answer on the rows without a key (relgen gives them 0): mean_j v_j, with the gradient of HF's uniform
    softmax, dS_ij = (do_i·(v_j − v̄))/Nk, to q_i and k_j, by a term that is zero in the forward."""
    vbar = v.mean(dim=2, keepdim=True)
    # Σ_j (v_j − v̄) k_jᵀ · τ/Nk: its product with q_i has HF's derivatives in q_i and k_j, none in v beyond v̄
    spread = torch.einsum("bhjd,bhje->bhde", (v - vbar).detach(), k) * (scale / k.shape[2])
    tangent = torch.einsum("bhde,bhie->bhid", spread, q)
    fill = vbar + (tangent - tangent.detach())
    # `out` first: the result takes its [B, Nq, H, d] storage order (the fill's is [B, H, Nq, d]), so that the
    # caller's transpose back to [B, Nq, H, d] is a view. The fill's gradients (to q, k) keep the einsums' order.
    return torch.where(~rows[:, None, :, None], out, fill.to(out.dtype))


def _matches_self(module: nn.Module) -> bool:
    return _is_hf(module) and not _is_cross(module)


def _matches_cross(module: nn.Module) -> bool:
    return _is_hf(module) and _is_cross(module)


register(Adapter(FAMILY, _matches_self, _prepare, _forward, restore=_restore))
register(Adapter(f"{FAMILY}_cross", _matches_cross, _prepare, _forward, attention=False, restore=_restore))
