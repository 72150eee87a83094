"""The systems the benchmark times, each built the way its users run it, and the inputs they share.

Every system is a function ``fn(q, k, v, aq, ak, bias) -> O`` (absent tables are None) over the unified form

    S_ij = τ (q_i·k_j + q_i·a^Q_φ(i−j) + k_j·a^K_φ(i−j) + b_φ(i−j)),   O = softmax_j(S) V

with the spec's row map φ, so one set of inputs serves them all and relgen's tables load into each unchanged.

Peers build the dense relative bias exactly as the models' own attention modules do (docs/mechanisms.md):

* query term (Shaw ``relative_key``, DeBERTa c2p): project the queries onto the whole table, q @ Aᵀ (B, H, N, R),
  then gather the row of every pair along the last dimension;
* query term on an identity map (Transformer-XL / NeMo): project onto the table in NeMo's order of positions
  N−1 … −(N−1), then ``rel_shift`` (pad, reshape, drop a row) and keep the first N columns;
* key term (DeBERTa p2c): project the keys, gather on the [key, query] layout, transpose;
* scalar bias (T5): ``nn.Embedding``-style lookup of every pair's bucket, [N, N, H] → permute → [1, H, N, N].

Index tensors (φ of every pair) depend on N only; a model computes them once and shares them across layers, so
they are built before timing. Everything that reads a weight or an activation is inside the timed region.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from relgen.bench.common import ABLATIONS, SYSTEMS
from relgen.spec.model import MechanismSpec

Tensor = torch.Tensor
AttentionFn = Callable[..., Tensor]

#: torch.compile modes by the CLI's --flex-mode value ("none": no compilation, debugging only).
COMPILE_MODES = {"max-autotune": "max-autotune-no-cudagraphs", "default": None, "none": "none"}


# -- inputs -----------------------------------------------------------------------------------------------------
@dataclass
class Problem:
    """One mechanism at one length: the inputs every system reads, and the spec facts they need."""

    spec: MechanismSpec
    seq_len: int
    batch: int
    heads: int
    head_dim: int
    rows: int
    tau: float
    q: Tensor
    k: Tensor
    v: Tensor
    aq: Tensor | None
    ak: Tensor | None
    bias: Tensor | None
    d_out: Tensor
    #: φ(δ) at index δ + N − 1, for δ ∈ [−(N−1), N−1]
    offset_rows: Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def inputs(self, relative: bool = True) -> list[tuple[str, Tensor]]:
        """The tensors a system differentiates: q, k, v and, with relative terms, the present tables."""
        named = [("q", self.q), ("k", self.k), ("v", self.v)]
        if relative:
            named += [(n, t) for n, t in (("aq", self.aq), ("ak", self.ak), ("bias", self.bias)) if t is not None]
        return named


def activation_scale(tau: float, head_dim: int) -> float:
    """Scale of q and k so that τ·q·k has unit standard deviation, as trained models' activations roughly do."""
    return (1.0 / (tau * math.sqrt(head_dim))) ** 0.5


def make_problem(
    spec: MechanismSpec,
    seq_len: int,
    batch: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
) -> Problem:
    """Random inputs: q, k ~ N(0, s²) (τ·q·k of unit spread), v, dO ~ N(0, 1), tables ~ 0.5·N(0, 1)."""
    device = torch.device(device)
    n, rows, tau = seq_len, spec.map.num_rows(seq_len), spec.scale_value(head_dim)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, grad: bool = True) -> Tensor:
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale
        return x.to(dtype).requires_grad_(grad)

    s = activation_scale(tau, head_dim)
    table = (rows, head_dim) if spec.heads_share_tables else (heads, rows, head_dim)
    scalars = (rows,) if spec.heads_share_tables else (heads, rows)
    q = randn(batch, heads, n, head_dim, scale=s)
    k = randn(batch, heads, n, head_dim, scale=s)
    v = randn(batch, heads, n, head_dim)
    aq = randn(*table, scale=0.5) if spec.has_query else None
    ak = randn(*table, scale=0.5) if spec.has_key else None
    bias = randn(*scalars, scale=0.5) if spec.has_bias else None
    d_out = randn(batch, heads, n, head_dim, grad=False)
    offset_rows = torch.as_tensor(
        np.asarray(spec.map.row_ids(np.arange(-(n - 1), n), n), dtype=np.int64), device=device
    )
    return Problem(spec, n, batch, heads, head_dim, rows, tau, q, k, v, aq, ak, bias, d_out, offset_rows)


# -- index tensors (built once per length, outside timing) ---------------------------------------------------------
@dataclass
class DenseIndex:
    """The row of every pair, in the layouts the models' gathers use."""

    seq_len: int
    #: [N, N] φ(i − j) at [i, j] (c2p / relative_key gathers, T5 buckets)
    pairs: Tensor
    #: [N, N] φ(i − j) at [j, i] (DeBERTa p2c gather, on the [key, query] layout)
    pairs_t: Tensor | None
    #: table rows in NeMo's position order N−1 … −(N−1) (rel_shift), for identity maps only
    shift_order: Tensor | None


def pair_rows(offset_rows: Tensor, seq_len: int) -> Tensor:
    """[N, N] φ(i − j) from the per-offset rows."""
    i = torch.arange(seq_len, device=offset_rows.device)
    return offset_rows[i[:, None] - i[None, :] + (seq_len - 1)]


def dense_index(spec: MechanismSpec, offset_rows: Tensor, seq_len: int) -> DenseIndex:
    pairs = pair_rows(offset_rows, seq_len)
    pairs_t = pairs.t().contiguous() if spec.has_key else None
    # NeMo's p[r'] is the relation of position (= offset δ) N−1−r', i.e. table row φ(N−1−r') = offset_rows[2N−2−r']
    shift_order = offset_rows.flip(0).contiguous() if spec.map.kind == "identity" and spec.has_query else None
    return DenseIndex(seq_len, pairs, pairs_t, shift_order)


# -- dense-bias builders, as the models write them --------------------------------------------------------------
def query_term_gather(q: Tensor, aq: Tensor, pairs: Tensor) -> Tensor:
    """HF relative_key / DeBERTa c2p: gather(q @ Aᵀ, −1, φ) → [B, H, N, N]."""
    z = torch.matmul(q, aq.transpose(-1, -2))
    return torch.gather(z, -1, pairs.expand(*z.shape[:-1], pairs.shape[-1]))


def rel_shift(x: Tensor) -> Tensor:
    """NeMo RelPositionMultiHeadAttention.rel_shift: [b, h, t1, 2t1−1] → row i shifted left by t1−1−i."""
    b, h, qlen, pos_len = x.size()
    x = F.pad(x, pad=(1, 0))
    x = x.view(b, h, -1, qlen)
    return x[:, :, 1:].view(b, h, qlen, pos_len)


def query_term_rel_shift(q: Tensor, aq: Tensor, shift_order: Tensor) -> Tensor:
    """NeMo: matrix_bd = rel_shift(q @ pᵀ)[..., :N] with p the table in position order N−1 … −(N−1)."""
    p = aq.index_select(-2, shift_order)
    bd = torch.matmul(q, p.transpose(-1, -2))
    return rel_shift(bd)[..., : q.shape[-2]]


def key_term_gather(k: Tensor, ak: Tensor, pairs_t: Tensor) -> Tensor:
    """DeBERTa p2c: gather(k @ Aᵀ, −1, φ on the [key, query] layout), transposed to [B, H, Nq, Nk]."""
    z = torch.matmul(k, ak.transpose(-1, -2))
    return torch.gather(z, -1, pairs_t.expand(*z.shape[:-1], pairs_t.shape[-1])).transpose(-1, -2)


def bias_term_embedding(bias: Tensor, pairs: Tensor) -> Tensor:
    """T5 compute_bias: values = Embedding(φ) [N, N, H] → permute → [1, H, N, N] (shared tables: [1, 1, N, N])."""
    weight = bias.t() if bias.dim() == 2 else bias[:, None]  # nn.Embedding(R, H).weight layout
    values = F.embedding(pairs, weight)
    return values.permute(2, 0, 1).unsqueeze(0)


def dense_relative(
    q: Tensor, k: Tensor, aq: Tensor | None, ak: Tensor | None, bias: Tensor | None, index: DenseIndex
) -> Tensor:
    """The unscaled relative part of the scores, q·a^Q_φ + k·a^K_φ + b_φ, as a dense (broadcastable) [., ., N, N]."""
    terms: list[Tensor] = []
    if aq is not None:
        if index.shift_order is not None:
            terms.append(query_term_rel_shift(q, aq, index.shift_order))
        else:
            terms.append(query_term_gather(q, aq, index.pairs))
    if ak is not None:
        assert index.pairs_t is not None
        terms.append(key_term_gather(k, ak, index.pairs_t))
    if bias is not None:
        terms.append(bias_term_embedding(bias, index.pairs))
    if not terms:
        raise ValueError("a relative mechanism needs at least one term")
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


# -- systems ----------------------------------------------------------------------------------------------------
def eager_attention(q, k, v, aq, ak, bias, *, tau: float, index: DenseIndex, softmax_fp32: bool) -> Tensor:
    """The models' eager path: scores = (q kᵀ + relative) τ, softmax, @ v (T5: softmax in FP32, like HF T5)."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores + dense_relative(q, k, aq, ak, bias, index)
    if tau != 1.0:
        scores = scores * tau
    probs = torch.softmax(scores.float(), dim=-1).type_as(scores) if softmax_fp32 else torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)


def sdpa_dense(q, k, v, aq, ak, bias, *, tau: float, index: DenseIndex) -> Tensor:
    """SDPA with the dense bias as a float attn_mask (NeMo's and HF's SDPA paths)."""
    mask = dense_relative(q, k, aq, ak, bias, index)
    if tau != 1.0:
        mask = mask * tau
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=tau)


def sdpa_plain(q, k, v, aq=None, ak=None, bias=None, *, tau: float) -> Tensor:
    """The ceiling: SDPA with no relative terms at all."""
    return F.scaled_dot_product_attention(q, k, v, scale=tau)


def dense_score_mod(dense: Tensor) -> Callable:
    """FlexAttention score_mod that adds a precomputed dense (τ-scaled) bias, broadcast over size-1 dims."""
    batched, per_head = dense.shape[0] > 1, dense.shape[1] > 1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + dense[b if batched else 0, h if per_head else 0, q_idx, kv_idx]

    return score_mod


def flex_dense(q, k, v, aq, ak, bias, *, tau: float, index: DenseIndex, flex: Callable) -> Tensor:
    """FlexAttention whose score_mod reads the dense bias the model built."""
    dense = dense_relative(q, k, aq, ak, bias, index)
    if tau != 1.0:
        dense = dense * tau
    return flex(q, k, v, score_mod=dense_score_mod(dense), scale=tau)


def decomposition_score_mod(
    zq: Tensor | None, zk: Tensor | None, bias: Tensor | None, offset_rows: Tensor, seq_len: int, tau: float
) -> Callable:
    """score_mod of the pre-projected decomposition: τ(Z^Q[i, φ] + Z^K[j, φ] + b[φ]), φ = rows[i − j + N − 1]."""
    shift = seq_len - 1
    shared_bias = bias is not None and bias.dim() == 1

    def score_mod(score, b, h, q_idx, kv_idx):
        r = offset_rows[q_idx - kv_idx + shift]
        extra = None
        if zq is not None:
            extra = zq[b, h, q_idx, r].to(score.dtype)
        if zk is not None:
            term = zk[b, h, kv_idx, r].to(score.dtype)
            extra = term if extra is None else extra + term
        if bias is not None:
            term = (bias[r] if shared_bias else bias[h, r]).to(score.dtype)
            extra = term if extra is None else extra + term
        return score + extra * tau

    return score_mod


def flex_decomposition(
    q, k, v, aq, ak, bias, *, tau: float, offset_rows: Tensor, seq_len: int, flex: Callable
) -> Tensor:
    """FlexAttention on the paper's decomposition: Z^Q = q Aᵀ, Z^K = k Aᵀ [B, H, N, R] read by row in score_mod."""
    zq = torch.matmul(q, aq.transpose(-1, -2)) if aq is not None else None
    zk = torch.matmul(k, ak.transpose(-1, -2)) if ak is not None else None
    score_mod = decomposition_score_mod(zq, zk, bias, offset_rows, seq_len, tau)
    return flex(q, k, v, score_mod=score_mod, scale=tau)


def relgen_variant(name: str) -> Callable[[MechanismSpec], AttentionFn]:
    """The one hook mapping a Table 7 ablation to relgen: returns `build(spec) -> fn(q, k, v, aq=, ak=, bias=)`.

    relgen's kernels are to expose each switch as a keyword (``fn(..., ablation=name)``) and list the names they
    support in ``relgen.runtime.mechanism.ABLATIONS``. Until they do, this raises NotImplementedError, which the worker
    records as status "unsupported": the benchmark never reports a number for a variant relgen cannot run.
    """
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; expected one of {sorted(ABLATIONS)}")
    import relgen.runtime.mechanism as runtime

    supported = getattr(runtime, "ABLATIONS", None)
    if not supported or name not in supported:
        raise NotImplementedError(
            f"relgen exposes no ablation switch {name!r} yet (relgen.runtime.mechanism.ABLATIONS lists none); "
            "wire it in relgen.bench.peers.relgen_variant"
        )

    def build(spec: MechanismSpec) -> AttentionFn:
        return functools.partial(runtime.compile_mechanism(spec), ablation=name)

    return build


def compile_fn(fn: Callable, mode: str) -> Callable:
    """torch.compile with static shapes and no CUDA graphs (the paper's setting); mode 'none' leaves fn eager."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {sorted(COMPILE_MODES)}, got {mode!r}")
    torch_mode = COMPILE_MODES[mode]
    if torch_mode == "none":
        return fn
    return torch.compile(fn, mode=torch_mode, dynamic=False, fullgraph=True)


def flex_attention_fn() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@dataclass
class Built:
    """A system ready to run: `forward()` computes O from the problem's inputs, `inputs` are what bwd differentiates."""

    name: str
    forward: Callable[[], Tensor]
    inputs: list[tuple[str, Tensor]]
    relative: bool


def build_system(name: str, problem: Problem, compile_mode: str = "max-autotune", variant: str | None = None) -> Built:
    """The system `name` over `problem` (see common.SYSTEMS), compiled where its users compile it."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; expected one of {list(SYSTEMS)}")
    if variant is not None and name != "relgen":
        raise ValueError("ablation variants apply to relgen only")
    p = problem
    relative = SYSTEMS[name]["relative"]
    tables = (p.aq, p.ak, p.bias) if relative else (None, None, None)
    fn: AttentionFn
    if name == "relgen":
        if variant is not None:
            kernel = relgen_variant(variant)(p.spec)
        else:
            import relgen

            kernel = relgen.compile_mechanism(p.spec)

        def fn(q, k, v, aq, ak, bias):
            return kernel(q, k, v, aq=aq, ak=ak, bias=bias)

    elif name in ("eager", "compiled"):
        index = dense_index(p.spec, p.offset_rows, p.seq_len)
        softmax_fp32 = p.spec.map.kind == "t5"

        def fn(q, k, v, aq, ak, bias):
            return eager_attention(q, k, v, aq, ak, bias, tau=p.tau, index=index, softmax_fp32=softmax_fp32)

        if name == "compiled":
            fn = compile_fn(fn, compile_mode)
    elif name == "sdpa":
        index = dense_index(p.spec, p.offset_rows, p.seq_len)

        def fn(q, k, v, aq, ak, bias):
            return sdpa_dense(q, k, v, aq, ak, bias, tau=p.tau, index=index)

    elif name == "flex":
        index = dense_index(p.spec, p.offset_rows, p.seq_len)
        flex = flex_attention_fn()

        def flex_fn(q, k, v, aq, ak, bias):
            return flex_dense(q, k, v, aq, ak, bias, tau=p.tau, index=index, flex=flex)

        fn = compile_fn(flex_fn, compile_mode)
    elif name == "flex_decomp":
        rows32 = p.offset_rows.to(torch.int32)
        flex = flex_attention_fn()
        n = p.seq_len

        def decomp_fn(q, k, v, aq, ak, bias):
            return flex_decomposition(q, k, v, aq, ak, bias, tau=p.tau, offset_rows=rows32, seq_len=n, flex=flex)

        fn = compile_fn(decomp_fn, compile_mode)
    elif name == "sdpa_plain":

        def fn(q, k, v, aq, ak, bias):
            return sdpa_plain(q, k, v, tau=p.tau)

    else:  # pragma: no cover - SYSTEMS and this chain list the same names
        raise AssertionError(name)

    q, k, v = p.q, p.k, p.v
    aq, ak, bias = tables

    def forward() -> Tensor:
        return fn(q, k, v, aq, ak, bias)

    return Built(name, forward, p.inputs(relative), relative)
