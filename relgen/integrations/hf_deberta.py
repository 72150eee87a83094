"""Hugging Face DeBERTa-v2/v3 on relgen's kernels.

Matches `DisentangledSelfAttention` and `DebertaV2Encoder` of `transformers.models.deberta_v2.modeling_deberta_v2`
(so `DebertaV2Model` and every head built on it), by class name and module, without importing transformers.

The attention keeps its own parameters. Per call, the relation tables are the layer's own projections of the
encoder's (LayerNorm-ed) relative embeddings after the layer's position dropout, biases included: `key_proj` (or
`pos_key_proj` when `share_att_key` is false) gives the table dotted with the query (c2p, relgen's `query` term),
`query_proj` (or `pos_query_proj`) the one dotted with the key (p2c, the `key` term). The terms are those of
`pos_att_type`; the map is DeBERTa's log buckets (`log`, with `position_buckets` and `max_relative_positions`), or
offsets clipped to [−span, span − 1] when `position_buckets` ≤ 0; τ = 1/sqrt((1 + #terms)·d).

The encoder (a helper, not named by `patch`) hands its layers the [B, N] padding mask instead of HF's N×N one and
builds no `relative_pos`: the kernels take the mask as `key_padding_mask`. A padded query row gets what HF gives it,
a uniform softmax over all keys (mean_j v_j, gradients included). Attention dropout in training runs in the kernels
(`dropout_p`), from relgen's own random stream: a training step with attention dropout is not HF's bit for bit
(a padded row then gets its mean without dropout; only padded rows read it).

These run the model's own code for the call, with one warning per feature: `output_attentions`, `query_states` (the
enhanced mask decoder), an explicit `relative_pos`, a 3-D/4-D attention mask (also what every layer sees when its
encoder is not patched with it), float64 inputs (HF's own float64 path is the exact one) and any other argument.
Configurations refused at `patch`: `relative_attention=False`, no c2p/p2c in `pos_att_type`, head dims the kernels
do not serve, bucket settings relgen's `log` map rejects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from relgen.integrations._core import Adapter, Unsupported, fall_back, is_patched, register, run_original

FAMILY = "deberta_v2"
_HF_MODULE = "transformers.models.deberta_v2.modeling_deberta_v2"


def _is_hf(class_name: str) -> Callable[[nn.Module], bool]:
    def matches(module: nn.Module) -> bool:
        # the exact class: a subclass may override the forward this adapter reproduces
        return type(module).__name__ == class_name and type(module).__module__ == _HF_MODULE

    return matches


@dataclass(frozen=True)
class _State:
    spec: dict[str, Any]
    mechanism: Callable[..., torch.Tensor]

    @property
    def c2p(self) -> bool:  # relgen's `query` term: q_i · key_proj(E)[φ]
        return "query" in self.spec["terms"]

    @property
    def p2c(self) -> bool:  # relgen's `key` term: k_j · query_proj(E)[φ]
        return "key" in self.spec["terms"]

    def __reduce__(self) -> tuple[Any, ...]:
        # a compiled mechanism holds its generated module, which cannot be copied: a deep copy (or a pickle) of a
        # patched model takes it from relgen's cache again
        return _compiled, (self.spec,)


def _spec(module: nn.Module) -> dict[str, Any]:
    """The mechanism of one DisentangledSelfAttention, from the module's own configuration."""
    from relgen.runtime.arguments import SUPPORTED_HEAD_DIMS

    if not module.relative_attention:
        raise Unsupported("relative_attention=False (no relative term)")
    types = list(module.pos_att_type)
    terms = [term for kind, term in (("c2p", "query"), ("p2c", "key")) if kind in types]
    if not terms:
        raise Unsupported(f"pos_att_type={types} (neither c2p nor p2c)")
    head_dim = module.attention_head_size
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise Unsupported(f"head_dim={head_dim} (not among the kernels' relgen.runtime.arguments.SUPPORTED_HEAD_DIMS)")
    span = module.pos_ebd_size
    if module.position_buckets > 0:
        offset_map = {
            "kind": "log",
            "position_buckets": module.position_buckets,
            "max_position": module.max_relative_positions,
        }
    else:  # HF's rows clamp(δ + span, 0, 2·span − 1) of unbucketed offsets
        offset_map = {"kind": "clipped", "min": -span, "max": span - 1}
    return {
        "name": "hf_deberta_v2",
        "description": f"Hugging Face DeBERTa-v2 DisentangledSelfAttention, pos_att_type {types}",
        "terms": terms,
        "map": offset_map,
        "scale": f"1/sqrt({1 + len(terms)}*d)",
    }


def _compiled(spec: dict[str, Any]) -> _State:
    import relgen

    return _State(spec, relgen.compile_mechanism(spec))


def _prepare_attention(module: nn.Module) -> _State:
    from relgen.spec.model import SpecError

    try:
        return _compiled(_spec(module))
    except SpecError as why:  # e.g. position_buckets and max_relative_positions the log map does not define
        raise Unsupported(
            f"position_buckets={module.position_buckets} with max_relative_positions="
            f"{module.max_relative_positions} ({why})"
        ) from None


def _hf_mask(padding: torch.Tensor) -> torch.Tensor:
    """HF's N×N mask of a [B, N] padding mask, for a call that runs the model's own code."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import DebertaV2Encoder

    # get_attention_mask does not use its instance; calling it keeps HF's own construction
    return DebertaV2Encoder.get_attention_mask(None, padding)


def _unserved(
    hidden_states: torch.Tensor,
    attention_mask: Any,
    output_attentions: bool,
    query_states: Any,
    relative_pos: Any,
    rel_embeddings: Any,
    extra: dict[str, Any],
) -> str | None:
    """The feature of this call that the kernels cannot serve, or None."""
    if extra:
        return f"argument {', '.join(sorted(extra))}"
    if output_attentions:
        return "output_attentions=True"
    if query_states is not None:
        return "query_states (the enhanced mask decoder)"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return "an N×N attention_mask (a 3-D/4-D mask, or DebertaV2Encoder not patched with its layers)"
    if relative_pos is not None:
        return "an explicit relative_pos"
    if hidden_states.dtype == torch.float64:
        return "float64 inputs"
    if rel_embeddings is None:
        return "rel_embeddings=None"
    return None


def _attention_forward(
    module: nn.Module,
    state: _State,
    hidden_states: torch.Tensor,
    attention_mask: Any,
    output_attentions: bool = False,
    query_states: torch.Tensor | None = None,
    relative_pos: torch.Tensor | None = None,
    rel_embeddings: torch.Tensor | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    feature = _unserved(
        hidden_states, attention_mask, output_attentions, query_states, relative_pos, rel_embeddings, extra
    )
    if feature is not None:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            attention_mask = _hf_mask(attention_mask)
        return fall_back(
            module,
            feature,
            hidden_states,
            attention_mask,
            output_attentions,
            query_states=query_states,
            relative_pos=relative_pos,
            rel_embeddings=rel_embeddings,
            **extra,
        )
    batch, length, _ = hidden_states.shape
    heads, head_dim = module.num_attention_heads, module.attention_head_size

    def split(x: torch.Tensor) -> torch.Tensor:  # [B, N, H·d] → [B, H, N, d], last dim contiguous
        return x.view(batch, length, heads, head_dim).transpose(1, 2)

    q = split(module.query_proj(hidden_states))
    k = split(module.key_proj(hidden_states))
    v = split(module.value_proj(hidden_states))
    # HF's order: the position dropout over the whole table, then its first 2·span rows
    rel = module.pos_dropout(rel_embeddings)[: 2 * module.pos_ebd_size]

    def table(proj: nn.Module) -> torch.Tensor:  # [2·span, H·d] → [H, 2·span, d], in q's dtype (autocast)
        return proj(rel).view(-1, heads, head_dim).transpose(0, 1).to(q.dtype)

    aq = table(module.key_proj if module.share_att_key else module.pos_key_proj) if state.c2p else None
    ak = table(module.query_proj if module.share_att_key else module.pos_query_proj) if state.p2c else None
    real = attention_mask.bool()  # the encoder hands its layers a bool mask: no cast here, none per layer
    dropout_p = module.dropout.p if module.dropout.training else 0.0
    out = state.mechanism(q, k, v, aq=aq, ak=ak, key_padding_mask=real, dropout_p=dropout_p)
    out = _PaddedRows.apply(out, v, (~real)[:, None, :, None])
    # out keeps q's [B, N, H, d] storage order (the kernels' O follows q's strides): a view, not a copy
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim), None


class _PaddedRows(torch.autograd.Function):
    """HF masks a padded query's every score: its softmax is uniform over all N keys, padded ones included, so its
    output is v̄ = mean_j v_j, and its gradient reaches v only, (1/N)·Σ_{padded i} dO_i on every key.

    torch.where(padded, v̄, o) differentiated by autograd would materialise that gradient as a [B, H, N, d] tensor
    in [B, H, N, d] order, summed with the kernels' dV into a tensor of that order too, which the view back to
    value_proj's [B, N, H·d] output then copies: here the gradient stays a broadcast [B, H, 1, d], and dO's other
    part keeps dO's order."""

    @staticmethod
    def forward(ctx: Any, o: torch.Tensor, v: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(padded)
        ctx.v_shape = v.shape
        return torch.where(padded, v.mean(dim=2, keepdim=True), o)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (padded,) = ctx.saved_tensors
        rows = padded[:, 0, :, 0].to(grad.dtype)  # [B, N]
        dvbar = torch.einsum("bhid,bi->bhd", grad, rows).unsqueeze(2) / ctx.v_shape[2]
        return grad.masked_fill(padded, 0), dvbar.expand(ctx.v_shape), None


def _prepare_encoder(encoder: nn.Module) -> None:
    if not encoder.relative_attention:
        raise Unsupported("relative_attention=False")


def _encoder_forward(
    encoder: nn.Module,
    state: None,
    hidden_states: torch.Tensor,
    attention_mask: Any,
    output_hidden_states: bool = True,
    output_attentions: bool = False,
    query_states: torch.Tensor | None = None,
    relative_pos: torch.Tensor | None = None,
    return_dict: bool = True,
    **extra: Any,
) -> Any:
    """DebertaV2Encoder.forward with the [B, N] mask handed to the layers (nothing N×N built); HF's own forward for
    what this loop does not cover (the layers then fall back and name the feature)."""
    if (
        extra
        or query_states is not None
        or not isinstance(attention_mask, torch.Tensor)
        or attention_mask.dim() != 2
        or not all(is_patched(layer.attention.self) for layer in encoder.layer)
    ):
        return run_original(
            encoder,
            hidden_states,
            attention_mask,
            output_hidden_states,
            output_attentions,
            query_states,
            relative_pos,
            return_dict,
            **extra,
        )
    from transformers.modeling_outputs import BaseModelOutput

    rel_embeddings = encoder.get_rel_embedding()
    real = attention_mask.bool()  # once per forward (the convolution layer takes the caller's mask)
    all_hidden_states = (hidden_states,) if output_hidden_states else None
    all_attentions = () if output_attentions else None
    states = hidden_states
    for i, layer in enumerate(encoder.layer):
        states, weights = layer(
            states,
            real,
            relative_pos=relative_pos,
            rel_embeddings=rel_embeddings,
            output_attentions=output_attentions,
        )
        if output_attentions:
            all_attentions = (*all_attentions, weights)
        if i == 0 and encoder.conv is not None:
            states = encoder.conv(hidden_states, states, attention_mask)
        if output_hidden_states:
            all_hidden_states = (*all_hidden_states, states)
    if not return_dict:
        return tuple(x for x in (states, all_hidden_states, all_attentions) if x is not None)
    return BaseModelOutput(last_hidden_state=states, hidden_states=all_hidden_states, attentions=all_attentions)


register(Adapter(FAMILY, _is_hf("DisentangledSelfAttention"), _prepare_attention, _attention_forward))
register(Adapter(f"{FAMILY}_encoder", _is_hf("DebertaV2Encoder"), _prepare_encoder, _encoder_forward, attention=False))
