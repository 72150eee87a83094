"""The FP64 eager oracle: relative-position attention straight from the relation equations (paper §3.2).

    S_ij = τ (q_i·k_j + q_i·a^Q_φ + k_j·a^K_φ + b_φ) + M_ij,   P = softmax_j(S),   O = P V,
    φ = φ((i + q_offset) − (j + k_offset))

Every score gathers its own relation vector (``aq[:, rows]`` is a [H, Nq, Nk, d] tensor), so this is O(N²d) in
time and memory: meant for tests on small inputs, never for speed. It depends only on the spec and on the map
models' ``row_ids`` / ``num_rows`` (the single definition of φ), never on the analyzer, code generation or the
runtime, so it can judge all three.

Conventions shared with the kernels:

* every input is cast with ``.to(torch.float64)``, so autograd flows back to the caller's tensors (whatever their
  dtype) and the result is float64;
* query rows without any valid key (all keys padded, causally masked or outside the window) give O = 0,
  LSE = −inf and zero gradients, never NaN;
* dropout is described by an explicit ``keep_mask`` (True = kept): P·keep/(1 − p), after the softmax; the LSE
  is that of the softmax before dropout;
* packed sequences (``cu_seqlens_q``, ``cu_seqlens_k``; ``cu_seqlens`` for both): each sequence attends only
  within itself, and its queries end where its keys end (FlashAttention's bottom-right alignment): query i of a
  sequence with Lq queries and Lk keys sits at position q_offset + Lk − Lq + i, key j at k_offset + j, causal or
  not; identity maps use L = max(q_offset, k_offset) + max(max_seqlen_q, max_seqlen_k) (other maps do not depend
  on L);
* grouped-query attention: k and v may have H_kv heads, H a multiple of H_kv; query head h reads key/value head
  h // (H / H_kv), here by repeating each key/value head H / H_kv times (``repeat_interleave``).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from relgen.spec.model import MechanismSpec, load_spec

__all__ = ["LAYOUTS", "allowed_pairs", "attention", "relation_rows"]

#: the dense layouts of q, k, v and O: [B, H, N, d] and [B, N, H, d]
LAYOUTS = ("bhnd", "bnhd")


def relation_rows(
    spec: MechanismSpec | dict | str,
    nq: int,
    nk: int,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    length: int | None = None,
) -> torch.Tensor:
    """Row ids φ((i + q_offset) − (j + k_offset)) as a LongTensor [nq, nk].

    `length` is the identity map's L (R = 2L − 1); by default the longest position used,
    max(q_offset + nq, k_offset + nk). Other maps ignore it.
    """
    spec = load_spec(spec)
    for name, value in (("nq", nq), ("nk", nk), ("q_offset", q_offset), ("k_offset", k_offset)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if length is None:
        length = max(q_offset + nq, k_offset + nk, 1)
    if not isinstance(length, int | np.integer) or isinstance(length, bool) or length < 1:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    i = np.arange(nq, dtype=np.int64)[:, None] + q_offset
    j = np.arange(nk, dtype=np.int64)[None, :] + k_offset
    delta = i - j
    rows = np.asarray(spec.map.row_ids(delta, int(length)), dtype=np.int64).reshape(nq, nk)
    num_rows = spec.map.num_rows(int(length))
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        raise ValueError(
            f"length={length} is too short for these positions: offsets in "
            f"[{int(delta.min())}, {int(delta.max())}] give rows outside [0, {num_rows})"
        )
    return torch.from_numpy(rows.copy())


def allowed_pairs(
    spec: MechanismSpec, nq: int, nk: int, q_offset: int = 0, k_offset: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """[nq, nk] bool: the query-key pairs the spec's causality and local window admit, query i at position
    i + q_offset and key j at j + k_offset (the window is a mask of its own, independent of causality)."""
    i = torch.arange(nq, device=device)[:, None] + q_offset
    j = torch.arange(nk, device=device)[None, :] + k_offset
    allowed = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if spec.causal:
        allowed &= i >= j
    if spec.window is not None and spec.window.left is not None:
        allowed &= j >= i - spec.window.left
    if spec.window is not None and spec.window.right is not None:
        allowed &= j <= i + spec.window.right
    return allowed


def attention(
    spec: MechanismSpec | dict | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    aq: torch.Tensor | None = None,
    ak: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    keep_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    length: int | None = None,
    layout: str = "bhnd",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Relative-position attention in float64, differentiable with respect to every tensor input.

    Dense layout: q [B, H, Nq, d], k [B, H_kv, Nk, d], v [B, H_kv, Nk, dv] → O [B, H, Nq, dv] (LSE [B, H, Nq]);
    with ``layout="bnhd"`` q [B, Nq, H, d], k, v [B, Nk, H_kv, d] → O [B, Nq, H, dv] (LSE still [B, H, Nq]).
    H_kv divides H (grouped-query attention; H_kv = H: ordinary multi-head attention).
    Packed layout (``cu_seqlens_q``, ``cu_seqlens_k`` int32 [S + 1], ``max_seqlen_q``, ``max_seqlen_k``; or
    ``cu_seqlens``, ``max_seqlen`` for both): q [total_q, H, d], k, v [total_k, H_kv, d] → O [total_q, H, dv]
    (LSE [total_q, H]), whatever ``layout``; sequence s's query i sits at q_offset + Lk − Lq + i (bottom-right);
    a packed ``keep_mask`` is [S, H, max_seqlen_q, max_seqlen_k], sequence s using its top-left [Lq, Lk] block.

    Tables: ``aq``/``ak`` [H, R, d] and ``bias`` [H, R] ([R, d] and [R] when ``spec.heads_share_tables``), with
    R = ``spec.map.num_rows(L)``. Only the spec's terms are read (query → aq, key → ak, bias → bias); tables of
    other terms are ignored.

    ``scale``: τ, default ``spec.scale_value(d)``. ``key_padding_mask`` [B, Nk] bool, True = real key.
    ``spec.causal`` masks keys with j + k_offset > i + q_offset; ``spec.window`` those whose j + k_offset lies
    outside [i + q_offset − left, i + q_offset + right]. ``keep_mask`` [B, H, Nq, Nk] bool (True = kept) with
    ``dropout_p`` applies P·keep/(1 − dropout_p). ``length``: the identity map's L (dense default
    max(q_offset + Nq, k_offset + Nk); packed default max(q_offset, k_offset) + max(max_seqlen_q, max_seqlen_k)).
    ``return_lse``: also return the natural-log log-sum-exp of the scaled, masked scores (−inf for rows without
    keys).
    """
    spec = load_spec(spec)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_p > 0 and keep_mask is None:
        raise ValueError("keep_mask is required when dropout_p > 0 (the reference draws no random numbers)")
    tables = (aq, ak, bias)
    separate = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if any(x is not None for x in separate):
        if cu_seqlens is not None or max_seqlen is not None:
            raise ValueError("cu_seqlens/max_seqlen cannot be combined with cu_seqlens_q/cu_seqlens_k/max_seqlen_*")
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k are both required for separate query and key packing")
        if key_padding_mask is not None:
            raise ValueError("key_padding_mask cannot be combined with cu_seqlens_q (packing has no padding)")
        sides = ((cu_seqlens_q, max_seqlen_q), (cu_seqlens_k, max_seqlen_k))
        masks = (keep_mask, float(dropout_p))
        out, lse = _packed(spec, q, k, v, tables, scale, masks, sides, q_offset, k_offset, length)
    elif cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError("max_seqlen is only used with cu_seqlens")
        masks = (key_padding_mask, keep_mask, float(dropout_p))
        if layout == "bnhd":
            q, k, v = (_heads_major(x, name) for name, x in (("q", q), ("k", k), ("v", v)))
        out, lse = _dense(spec, q, k, v, tables, scale, masks, q_offset, k_offset, length)
        if layout == "bnhd":
            out = out.transpose(1, 2)
    else:
        if key_padding_mask is not None:
            raise ValueError("key_padding_mask cannot be combined with cu_seqlens (packing has no padding)")
        if max_seqlen is None:
            raise ValueError("max_seqlen is required with cu_seqlens")
        sides = ((cu_seqlens, max_seqlen), (cu_seqlens, max_seqlen))
        masks = (keep_mask, float(dropout_p))
        out, lse = _packed(spec, q, k, v, tables, scale, masks, sides, q_offset, k_offset, length)
    return (out, lse) if return_lse else out


def _bounds(cu_seqlens, max_seqlen, tokens: int) -> list[int]:
    """The sequence starts of one side, checked against its token count and max_seqlen."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [S + 1]")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if bounds[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {bounds}")
    if bounds[-1] != tokens:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the tensor has {tokens} tokens")
    if max_seqlen is None:
        raise ValueError("max_seqlen is required with cu_seqlens")
    if max_seqlen < max(lengths):
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence ({max(lengths)})")
    return bounds


def _packed(spec, q, k, v, tables, scale, masks, sides, q_offset, k_offset, length):
    """Each sequence (queries [cu_q[s], cu_q[s+1]), keys [cu_k[s], cu_k[s+1])) runs through the dense path on its
    own, its queries shifted to end where its keys end."""
    keep_mask, dropout_p = masks
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be [total, H, d] with cu_seqlens, got {_shape(x)}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} tokens but k has {k.shape[0]}")
    (cu_q, max_q), (cu_k, max_k) = sides
    bounds_q, bounds_k = _bounds(cu_q, max_q, q.shape[0]), _bounds(cu_k, max_k, k.shape[0])
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seqlens_q has {len(bounds_q)} entries but cu_seqlens_k has {len(bounds_k)}")
    if k.shape[2] != q.shape[2] or v.shape[1] != k.shape[1] or (q.shape[1] % k.shape[1] if k.shape[1] else q.shape[1]):
        raise ValueError(
            f"k {list(k.shape)} and v {list(v.shape)} must match q {list(q.shape)} in d and have H_kv heads dividing H"
        )
    num_seqs, heads = len(bounds_q) - 1, q.shape[1]
    if keep_mask is not None and tuple(keep_mask.shape) != (num_seqs, heads, max_q, max_k):
        raise ValueError(
            f"keep_mask must be [S, H, max_seqlen_q, max_seqlen_k] = {[num_seqs, heads, max_q, max_k]} "
            f"with packed sequences, got {_shape(keep_mask)}"
        )
    if length is None:
        length = max(q_offset, k_offset) + max(max_q, max_k)
    outs, lses = [], []
    for s in range(num_seqs):
        (qa, qb), (ka, kb) = bounds_q[s : s + 2], bounds_k[s : s + 2]
        nq, nk = qb - qa, kb - ka
        qs = q[qa:qb].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, d]
        ks, vs = (x[ka:kb].transpose(0, 1).unsqueeze(0) for x in (k, v))
        if nk == 0:  # no key to attend to: O = 0, LSE = −inf (a softmax over no keys has no maximum to take)
            outs.append(torch.zeros(nq, heads, v.shape[2], dtype=torch.float64, device=q.device))
            lses.append(torch.full((nq, heads), float("-inf"), dtype=torch.float64, device=q.device))
            continue
        keep = None if keep_mask is None else keep_mask[s : s + 1, :, :nq, :nk]
        # query i at q_offset + Lk − Lq + i: both offsets shifted alike (δ unchanged) so that neither is negative
        q_pos, k_pos = q_offset + nk - nq, k_offset
        shift = max(0, -q_pos)
        out, lse = _dense(
            spec, qs, ks, vs, tables, scale, (None, keep, dropout_p), q_pos + shift, k_pos + shift, length
        )
        outs.append(out[0].transpose(0, 1))  # [Lq, H, dv]
        lses.append(lse[0].transpose(0, 1))  # [Lq, H]
    return torch.cat(outs, dim=0), torch.cat(lses, dim=0)


def _dense(spec, q, k, v, tables, scale, masks, q_offset, k_offset, length):
    """Dense layout: returns (O [B, H, Nq, dv], LSE [B, H, Nq]), both float64."""
    aq, ak, bias = tables
    key_padding_mask, keep_mask, dropout_p = masks
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a tensor [B, H, N, d], got {_shape(x)}")
    batch, heads, nq, d = q.shape
    kv_heads, nk = k.shape[1], k.shape[2]
    if tuple(k.shape) != (batch, kv_heads, nk, d) or (heads % kv_heads if kv_heads else heads):
        raise ValueError(
            f"k must be [B, H_kv, Nk, d] = [{batch}, H_kv, Nk, {d}] like q, H_kv dividing H = {heads}, got "
            f"{list(k.shape)}"
        )
    if tuple(v.shape[:3]) != (batch, kv_heads, nk):
        raise ValueError(f"v must be [B, H_kv, Nk, dv] = [{batch}, {kv_heads}, {nk}, dv], got {list(v.shape)}")
    if kv_heads != heads:  # grouped-query attention: query head h reads key/value head h // (H / H_kv)
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))

    if length is None:
        length = max(q_offset + nq, k_offset + nk, 1)
    rows = relation_rows(spec, nq, nk, q_offset=q_offset, k_offset=k_offset, length=length).to(q.device)
    num_rows = spec.map.num_rows(int(length))
    tau = float(scale) if scale is not None else spec.scale_value(d)

    f64 = torch.float64
    q64, k64, v64 = q.to(f64), k.to(f64), v.to(f64)
    scores = torch.einsum("bhid,bhjd->bhij", q64, k64)
    shared = spec.heads_share_tables
    if spec.has_query:
        table = _table("aq", aq, shared, heads, num_rows, d).to(f64)
        gathered = table[rows] if shared else table[:, rows]  # [Nq, Nk, d] or [H, Nq, Nk, d]
        scores = scores + torch.einsum("bhid,ijd->bhij" if shared else "bhid,hijd->bhij", q64, gathered)
    if spec.has_key:
        table = _table("ak", ak, shared, heads, num_rows, d).to(f64)
        gathered = table[rows] if shared else table[:, rows]
        scores = scores + torch.einsum("bhjd,ijd->bhij" if shared else "bhjd,hijd->bhij", k64, gathered)
    if spec.has_bias:
        table = _table("bias", bias, shared, heads, num_rows, None).to(f64)
        scores = scores + (table[rows] if shared else table[:, rows])  # [Nq, Nk] or [H, Nq, Nk]
    scores = tau * scores

    valid = allowed_pairs(spec, nq, nk, q_offset, k_offset, q.device).expand(batch, 1, nq, nk)
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or tuple(key_padding_mask.shape) != (batch, nk):
            raise ValueError(f"key_padding_mask must be [B, Nk] = [{batch}, {nk}], got {_shape(key_padding_mask)}")
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be bool (True = real key), got {key_padding_mask.dtype}")
        valid = valid & key_padding_mask.to(q.device)[:, None, None, :]

    # safe softmax: rows without a valid key have max −inf, give P = 0, O = 0, LSE = −inf and zero gradients
    masked = scores.masked_fill(~valid, float("-inf"))
    row_max = masked.detach().amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    expo = torch.exp(masked - shift)  # exactly 0 where masked
    total = expo.sum(dim=-1, keepdim=True)
    has_key = total > 0
    probs = expo / torch.where(has_key, total, torch.ones_like(total))
    lse = torch.where(
        has_key, shift + torch.log(torch.where(has_key, total, torch.ones_like(total))), float("-inf")
    ).squeeze(-1)

    if keep_mask is not None:
        if not isinstance(keep_mask, torch.Tensor) or tuple(keep_mask.shape) != (batch, heads, nq, nk):
            raise ValueError(f"keep_mask must be [B, H, Nq, Nk] = {[batch, heads, nq, nk]}, got {_shape(keep_mask)}")
        if keep_mask.dtype != torch.bool:
            raise ValueError(f"keep_mask must be bool (True = kept), got {keep_mask.dtype}")
        probs = probs * keep_mask.to(q.device).to(f64) / (1.0 - float(dropout_p))

    out = torch.einsum("bhij,bhjd->bhid", probs, v64)
    return out, lse


def _heads_major(x: torch.Tensor, name: str) -> torch.Tensor:
    """A [B, N, H, d] tensor (layout "bnhd") as [B, H, N, d]."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"{name} must be a tensor [B, N, H, d] (layout 'bnhd'), got {_shape(x)}")
    return x.transpose(1, 2)


def _table(
    name: str, table: torch.Tensor | None, shared: bool, heads: int, num_rows: int, d: int | None
) -> torch.Tensor:
    """Check a relation table's presence and shape: [H, R, d] / [H, R], or [R, d] / [R] when shared."""
    expected = ([] if shared else [heads]) + [num_rows] + ([] if d is None else [d])
    layout = ("" if shared else "H, ") + "R" + ("" if d is None else ", d")
    if table is None:
        raise ValueError(f"{name} is required by the spec's terms: expected [{layout}] = {expected}")
    if not isinstance(table, torch.Tensor) or list(table.shape) != expected:
        hint = " (heads_share_tables)" if shared else ""
        raise ValueError(f"{name} must be [{layout}] = {expected}{hint}, got {_shape(table)}")
    return table


def _shape(x: object) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
