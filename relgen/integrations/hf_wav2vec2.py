"""Hugging Face speech conformers on relgen's kernels: Wav2Vec2-BERT, SeamlessM4T-v2's speech encoder and
Wav2Vec2-Conformer.

Matched by class name and module (transformers is imported only when a model is patched), each module by its own
``position_embeddings_type``:

* family ``wav2vec2_bert``: ``Wav2Vec2BertSelfAttention`` (transformers.models.wav2vec2_bert), ``relative_key`` and
  ``relative``;
* family ``seamless_m4t_v2``: ``SeamlessM4Tv2ConformerSelfAttention`` (transformers.models.seamless_m4t_v2, the
  speech encoder), ``relative_key``;
* family ``wav2vec2_conformer``: ``Wav2Vec2ConformerSelfAttention`` (transformers.models.wav2vec2_conformer),
  ``relative``.

Rotary layers, layers without position embeddings and the adapters' attention have no relative term and are not
matched (a model made only of them has nothing relgen supports).

* ``relative_key``: the model adds scaling·q_i·E[clip(j − i, −left, right) + left] to scaling·q_i·k_j, E being the
  layer's ``distance_embedding`` (one table shared by the heads): map ``clipped`` with ``offset: key_minus_query``,
  terms [query], ``heads_share_tables``, τ = the module's ``scaling``.
* ``relative`` (Transformer-XL with u, v): scaling·((q_i + u)·k_j + (q_i + v)·p_δ) with p = ``linear_pos`` of the
  sinusoids the encoder passes as ``relative_position_embeddings``. Since (q + v)·p = (q + u)·p + (v − u)·p, it runs
  as terms [query, bias] (the form of ``specs/txl_uv.yaml``) with query q + u, table p and bias (v − u)·p per head.
  The model's row s holds δ = N − 1 − s (its rel_shift reads row N − 1 − (i − j)); relgen's identity row r holds
  δ = r − (N − 1): the rows are flipped. Nothing N×N is formed: p and the bias are [H, 2N − 1] tables.

Masks: the encoder turns the 2-D padding mask into a [B, 1, N, N] mask whose query rows are all the same; its
first row becomes ``key_padding_mask``. Padded query rows attend to the real frames in the model as they do in
relgen, so every row matches. A call falls back to the model's own code, with one warning per feature, for
``output_attentions``, float64 inputs, an ``attn_implementation`` other than sdpa and eager, a mask that is not
padding (SeamlessM4T-v2's chunk attention when a chunk is shorter than the input, a per-head or additive mask; under
eager attention SeamlessM4T-v2's boolean mask, which eager adds to the scores as 0 or 1) and a sequence padded
throughout (the model's answer there depends on its attention implementation). Training-mode attention dropout
runs inside the kernels (relgen's own random stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from relgen.integrations._core import Adapter, Unsupported, fall_back, register
from relgen.integrations._hf import wants_attentions
from relgen.runtime.arguments import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from relgen.runtime.mechanism import Mechanism, compile_mechanism

_TXL_UV = {
    "name": "txl_uv",
    "description": "Transformer-XL with u, v folded in: query q + u, table p, bias (v - u)·p (specs/txl_uv.yaml)",
    "terms": ["query", "bias"],
    "map": {"kind": "identity"},
}


@dataclass(frozen=True)
class _State:
    kind: str  # the module's position_embeddings_type
    mechanism: Mechanism


def _relative_key_spec(left: int, right: int) -> dict[str, Any]:
    return {
        "name": "wav2vec2_bert",
        "description": f"relative_key: clip(j - i, -{left}, {right}) + {left} into one table shared by the heads",
        "terms": ["query"],
        "map": {"kind": "clipped", "min": -left, "max": right, "offset": "key_minus_query"},
        "heads_share_tables": True,
    }


def _matcher(class_name: str, module_name: str, kinds: frozenset[str]):
    def matches(module: nn.Module) -> bool:
        cls = type(module)
        return (
            cls.__name__ == class_name
            and cls.__module__ == module_name
            and getattr(module, "position_embeddings_type", None) in kinds
        )

    return matches


def _prepare(module: nn.Module) -> _State:
    if module.head_size not in SUPPORTED_HEAD_DIMS:
        raise Unsupported(
            f"head_dim={module.head_size} (hidden_size / num_attention_heads; the kernels serve {SUPPORTED_HEAD_DIMS})"
        )
    kind = module.position_embeddings_type
    if kind == "relative_key":
        spec = _relative_key_spec(module.left_max_position_embeddings, module.right_max_position_embeddings)
    else:
        spec = _TXL_UV
    return _State(kind, compile_mechanism(spec))


def _forward(
    module: nn.Module,
    state: _State,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    relative_position_embeddings: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    def own_code(feature: str) -> Any:
        # SeamlessM4T-v2's forward has no relative_position_embeddings parameter: pass it on only when given
        if relative_position_embeddings is not None:
            kwargs["relative_position_embeddings"] = relative_position_embeddings
        return fall_back(module, feature, hidden_states, attention_mask=attention_mask, **kwargs)

    if wants_attentions(kwargs):
        return own_code("output_attentions")
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        return own_code(f"{hidden_states.dtype} inputs")
    batch, length, _ = hidden_states.shape
    key_padding_mask, feature = _key_padding(attention_mask, batch, length, module.config._attn_implementation)
    if feature is not None:
        return own_code(feature)
    if state.kind == "relative":
        if relative_position_embeddings is None:
            raise ValueError("relative_position_embeddings: required with position_embeddings_type='relative'")
        if tuple(relative_position_embeddings.shape[:2]) != (1, 2 * length - 1):
            return own_code("relative_position_embeddings not of shape [1, 2N - 1, hidden_size]")

    heads = (batch, length, module.num_heads, module.head_size)
    q = module.linear_q(hidden_states).view(heads).transpose(1, 2)
    k = module.linear_k(hidden_states).view(heads).transpose(1, 2)
    v = module.linear_v(hidden_states).view(heads).transpose(1, 2)
    if state.kind == "relative_key":
        tables = {"aq": module.distance_embedding.weight}
    else:
        q, tables = _fold_uv(module, q, relative_position_embeddings)
    # under autocast the projections come out in the autocast dtype while the tables and u stay in the parameters'
    tables = {name: t.to(k.dtype) for name, t in tables.items()}
    out = state.mechanism(
        q.to(k.dtype),
        k,
        v,
        **tables,
        key_padding_mask=key_padding_mask,
        scale=module.scaling,
        dropout_p=module.dropout.p if module.training else 0.0,
    )
    return module.linear_out(out.transpose(1, 2).reshape(batch, length, -1)), None


def _fold_uv(
    module: nn.Module, q: torch.Tensor, relative_position_embeddings: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The query q + u, the table p in relgen's identity rows [H, 2N − 1, d] and the bias (v − u)·p [H, 2N − 1]."""
    rows = relative_position_embeddings.shape[1]
    p = module.linear_pos(relative_position_embeddings).view(rows, module.num_heads, module.head_size)
    p = p.flip(0).transpose(0, 1)
    u, v = module.pos_bias_u, module.pos_bias_v
    bias = torch.einsum("hd,hrd->hr", v - u, p)
    return q + u[None, :, None, :], {"aq": p, "bias": bias}


def _key_padding(
    mask: Any, batch: int, length: int, implementation: str | None
) -> tuple[torch.Tensor | None, str | None]:
    """(key_padding_mask [B, N] with True = a real frame, or None for no padding; None) for a padding mask as the
    model's attention `implementation` reads it, else (None, the feature that keeps the call on the model's own
    code)."""
    if implementation not in ("sdpa", "eager"):
        # flash attention takes a [B, N] mask and drops the relative term, flex a BlockMask, others are unknown
        return None, f"attn_implementation={implementation!r}"
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        return None, f"an attention mask of type {type(mask).__name__}"
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or mask.shape[2:] != (length, length):
        return None, "an attention mask not of shape [B, 1, N, N]"
    if mask.dtype == torch.bool:
        if implementation == "eager":
            # eager attention adds the mask to the scores: True adds 1, False 0 (SeamlessM4T-v2's chunk mask)
            return None, "a boolean attention mask under eager attention (added to the scores as 0 or 1)"
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        # the model's masks hold 0 or the dtype's minimum; anything else is an additive bias
        if not bool((keep | (mask <= torch.finfo(mask.dtype).min)).all()):
            return None, "an additive float attention mask"
    else:
        return None, f"an attention mask of dtype {mask.dtype}"
    first = keep[:, :, :1, :]
    if keep.stride(2) != 0 and not torch.equal(keep, first.expand_as(keep)):
        return None, "an attention mask that is not a padding mask (e.g. chunk attention)"
    key_padding_mask = first[:, 0, 0, :].expand(batch, length)
    if bool(key_padding_mask.all()):
        return None, None
    if not bool(key_padding_mask.any(dim=1).all()):
        return None, "a sequence with every frame padded"
    return key_padding_mask.contiguous(), None


_FAMILIES = (
    ("wav2vec2_bert", "Wav2Vec2BertSelfAttention", "wav2vec2_bert", ("relative_key", "relative")),
    ("seamless_m4t_v2", "SeamlessM4Tv2ConformerSelfAttention", "seamless_m4t_v2", ("relative_key",)),
    ("wav2vec2_conformer", "Wav2Vec2ConformerSelfAttention", "wav2vec2_conformer", ("relative",)),
)
for _family, _class, _model, _kinds in _FAMILIES:
    _matches = _matcher(_class, f"transformers.models.{_model}.modeling_{_model}", frozenset(_kinds))
    register(Adapter(_family, _matches, _prepare, _forward))
