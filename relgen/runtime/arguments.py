"""Argument checking of a call: every argument is untrusted, and every problem is a ValueError that names the
argument and what was expected (NotImplementedError for a combination relgen does not support), raised before
the argument reaches torch or Triton."""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from relgen.backend import capturing, interpreting
from relgen.runtime.geometry import LOG2E, Geometry, PlanInfo, tensor_reach
from relgen.runtime.storage import projection_storage
from relgen.spec.limits import quoted
from relgen.spec.model import MechanismSpec
from relgen.tiles.select import overridden, select_config

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: every multiple of 8 from 16 to 256: the kernels pad d to a power of two internally (relgen.tiles.configs.head_block)
SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 8))
#: the layouts of dense q, k, v and O: [B, H, N, d] (the default) and [B, N, H, d] (HF, FlashAttention), both read
#: and written through their strides
LAYOUTS = ("bhnd", "bnhd")
LN2 = 0.6931471805599453
#: The largest absolute position a call may reach: q_offset + Nq and k_offset + Nk (packed: packed_length). The
#: kernels hold offsets δ, window starts and, for identity maps, the 2L − 1 expanded columns in 32-bit integers and
#: add up to three of them, so 2^29 keeps every such sum exact.
MAX_POSITION = 1 << 29
#: The most token rows a call may have, B·H·N (packed: H·total): the kernels number the rows of their per-token
#: buffers (LSE, Z̃, dZ̃) in int32, a tile's masked rows up to one tile past the last (offsets into the buffers are
#: int64). Far above what fits on a GPU: B·H·N = 2³¹ tokens are 2³⁵ elements of q at d = 16.
MAX_TOKEN_ROWS = 2**31 - 2**16
#: The most programs a launch may stack along a grid's second and third axes (CUDA's limit), which hold B·H
MAX_GRID_Y = 65535
#: a call's packing options: the shorthand for equal query and key packing, then FlashAttention's names
PACKING_OPTIONS = ("cu_seqlens", "max_seqlen", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
#: Integer dropout seeds lie in [0, SEED_LIMIT): the values a seed tensor's int64 element holds, so that an int and
#: a tensor with the same value draw the same mask.
SEED_LIMIT = 1 << 63
#: τ and τ·log2(e) (the kernels' exp2 scale) must be normal, finite fp32 numbers
_FP32_TINY, _FP32_MAX = 2.0**-126, 3.4028234663852886e38


def _got(value: Any) -> str:
    """A short description of a bad argument for an error message (a tensor's repr could be megabytes)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor {_shape(value)} {value.dtype}"
    return quoted(value)


def _integer(name: str, value: Any, low: int, high: int, expected: str) -> Any:
    """`value` as an int in [low, high]. Under torch.compile an int that changes between calls (a KV cache's offset,
    a per-step seed) arrives as a SymInt, which is compared (guarding the graph). bool is not an int here: True
    would stand for 1."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise ValueError(f"{name}: expected {expected}, got {_got(value)}")
    if not isinstance(value, torch.SymInt):
        value = int(value)  # numpy's integers
    if not low <= value <= high:
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value


def _check_offsets(q_offset: Any, k_offset: Any) -> tuple[Any, Any]:
    expected = f"a non-negative int ≤ {MAX_POSITION} (relgen.runtime.arguments.MAX_POSITION)"
    return (
        _integer("q_offset", q_offset, 0, MAX_POSITION, expected),
        _integer("k_offset", k_offset, 0, MAX_POSITION, expected),
    )


# ------------------------------------------------------------------------------------------------------------
# argument checking
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    aq: torch.Tensor | None
    ak: torch.Tensor | None
    bias: torch.Tensor | None
    kpm: torch.Tensor | None
    geo: Geometry

    def finish(self, o: torch.Tensor, lse2: torch.Tensor, return_lse: bool):
        """The result of the kernels' o (in this Call's [B, H, Nq, d] view) in the caller's layout."""
        layout = self.geo.layout
        return finish(heads_major(o, layout), lse2, return_lse, packed=self.geo.varlen, layout=layout)


def finish(o: torch.Tensor, lse2: torch.Tensor, return_lse: bool, packed: bool, layout: str = "bhnd"):
    """A call's result from o in the caller's layout: o, or (o, LSE) with the kernels' base-2 log-sum-exp as
    [B, H, Nq] in either layout (packed: [total, H])."""
    if not return_lse:
        return o
    lse = lse2.view(o.shape[1], o.shape[0]).t() if packed else lse2.view(heads_major(o, layout).shape[:3])
    return o, lse * LN2


def check_layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout: expected 'bhnd' (q, k, v as [B, H, N, d]) or 'bnhd' ([B, N, H, d]), got {_got(layout)}"
        )
    return layout


def heads_major(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A dense [B, N, H, d] tensor of a 'bnhd' call as the [B, H, N, d] view the kernels index (its strides, no
    copy), and such a view back (the transpose is its own inverse); 'bhnd' and packed tensors as they are."""
    return t.transpose(1, 2) if layout == "bnhd" and t.dim() == 4 else t


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t: Any, rank: int, expected: Callable[[], str]) -> torch.Tensor:
    """t if it is a tensor of `rank` dimensions; `expected()` describes the shape in the error (built only then:
    this runs on every call, where formatting costs as much as the checks)."""
    if isinstance(t, torch.Tensor) and t.dim() == rank and t.layout == torch.strided:
        return t
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {expected()}, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    raise ValueError(f"{name}: expected shape {expected()} (rank {rank}), got {_shape(t)}")


def lastdim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def seed_snapshot(dropout_seed: Any) -> Any:
    """A tensor seed as the call's backward will read it: a copy, so that the caller may update theirs in place as
    soon as the forward has been called (a CUDA graph's next step) without changing this call's mask."""
    return dropout_seed.detach().clone() if isinstance(dropout_seed, torch.Tensor) else dropout_seed


def _check_seed_tensor(seed: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A seed the kernels read at run time (its value is not checked: that would synchronise with the device)."""
    if seed.dtype not in (torch.int64, torch.int32) or seed.numel() != 1:
        raise ValueError(
            f"dropout_seed: a tensor seed must be one int64 or int32 element, got {_shape(seed)} {seed.dtype}"
        )
    if seed.device != q.device:
        raise ValueError(f"dropout_seed: must be on q's device ({q.device}), got {seed.device}")
    return seed.reshape(1)


def prepare_call(plan: PlanInfo, q, k, v, aq, ak, bias, **options: Any) -> Call:
    """check_call, except that a call whose signature (_signature) passed before reuses that call's Geometry
    without checking again: at short lengths a call is host-bound on the GPU, and a training loop or a benchmark
    repeats a few signatures. The dropout seed is the one part of the Geometry that changes from call to call
    (drawn anew, or the caller's): it is checked (or drawn) for every call and replaces the kept one."""
    signature = _signature(q, k, v, aq, ak, bias, options)
    if signature is not None:
        with _calls_lock:
            try:
                geo = plan.calls.get(signature)
            except TypeError:  # unhashable sizes (symbolic, under a tracing compiler): checked in full
                geo = signature = None
            if geo is not None:
                plan.calls.move_to_end(signature)
        if geo is not None:
            seed = _check_seed(options.get("dropout_seed"), geo.dropout_p, q)
            if isinstance(seed, torch.Tensor) or seed != geo.seed:
                geo = geo.with_seed(seed)
            kpm = options.get("key_padding_mask")
            tables = (t.contiguous() if t is not None else None for t in (aq, ak, bias))  # as _check_table makes them
            return Call(*(heads_major(t, geo.layout) for t in (q, k, v)), *tables, _kpm_rows(kpm), geo)
    call = check_call(plan, q, k, v, aq, ak, bias, **options)
    if signature is not None:
        with _calls_lock:
            plan.calls[signature] = call.geo
            if len(plan.calls) > KEPT_CALLS:
                plan.calls.popitem(last=False)
    return call


#: call signatures whose Geometry each plan keeps (least recently used out)
KEPT_CALLS = 32
_calls_lock = threading.Lock()  # calls from several threads share a plan


def _signature(q, k, v, aq, ak, bias, options: dict[str, Any]) -> tuple | None:
    """What check_call's outcome is a function of, but for the dropout seed, for a call whose q, k and v it would
    pass through unchanged (unit last stride) and without packing; None for any other call, which is checked in
    full. Tables in any strides (a model's projections of its relative embeddings, [R, H·d] viewed as [H, R, d])
    are keyed by shape, dtype and device: prepare_call makes them contiguous as check_call does. A key padding
    mask is keyed by what check_call checks of it (its shape, dtype, layout and device: its values are the
    kernels'), the seed by its kind (None, an int, or a tensor's dtype, shape and device: prepare_call checks each
    call's own), other options by name, type and value (True never stands in for 1: the checks reject bools). q, k
    and v are keyed by their strides too (their reach decides the kernels' INT64). A configuration override (tests,
    tuning) bypasses it."""
    if overridden() or any(options.get(name) is not None for name in PACKING_OPTIONS):
        return None
    if type(options.get("dropout_p", 0.0)) not in (int, float):
        return None
    tensors = []
    for t in (q, k, v):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dim() == 0:
            return None
        strides = t.stride()
        if strides[-1] != 1:
            return None
        tensors.append((t.shape, strides, t.dtype, t.device))
    for t in (aq, ak, bias):
        if t is None:
            tensors.append(None)
        elif isinstance(t, torch.Tensor) and t.layout == torch.strided:
            tensors.append((t.shape, t.dtype, t.device))
        else:
            return None
    kpm = options.get("key_padding_mask")
    if kpm is not None:
        if not isinstance(kpm, torch.Tensor):
            return None
        kpm = (kpm.shape, kpm.dtype, kpm.layout, kpm.device)
    seed = options.get("dropout_seed")
    seed = (seed.dtype, seed.shape, seed.device) if isinstance(seed, torch.Tensor) else type(seed)
    return (
        *tensors,
        kpm,
        seed,
        *((name, type(value), value) for name, value in options.items() if name not in _PER_CALL),
        interpreting(),
        projection_storage(),
    )


#: options _signature keys apart from the others: a key padding mask by its checked properties, the seed by kind
_PER_CALL = ("key_padding_mask", "dropout_seed")


def _kpm_rows(kpm: torch.Tensor | None) -> torch.Tensor | None:
    """A checked key padding mask as the kernels read it: int8 rows [B, Nk] (1 = a real key)."""
    return kpm.to(torch.int8).contiguous() if kpm is not None else None


def check_call(
    plan: PlanInfo,
    q,
    k,
    v,
    aq,
    ak,
    bias,
    *,
    key_padding_mask=None,
    cu_seqlens=None,
    max_seqlen=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    q_offset=0,
    k_offset=0,
    dropout_p=0.0,
    dropout_seed=None,
    scale=None,
    ablation=None,
    layout="bhnd",
) -> Call:
    """Validate a call against the plan; every problem is a ValueError naming the argument.

    q: [B, H, Nq, d], k, v: [B, H_kv, Nk, d] (layout 'bhnd'), or [B, Nq, H, d] and [B, Nk, H_kv, d] ('bnhd'), H a
    multiple of H_kv (grouped-query attention); or packed q: [total_q, H, d], k, v: [total_k, H_kv, d] (any layout)
    with cu_seqlens_q, cu_seqlens_k (int32 [S+1]) and max_seqlen_q, max_seqlen_k, or cu_seqlens and max_seqlen
    for both (check_packing). A packed sequence's queries end where its keys end (FlashAttention's bottom-right
    alignment): with Lq queries and Lk keys, query i sits at q_offset + Lk − Lq + i and key j at k_offset + j,
    causal or not; causal keeps the keys at or before each query's position. The Call holds q, k, v as
    [B, H, N, d] views. Tables (per query head): aq, ak
    [H, R, d] ([R, d] with shared tables), bias [H, R] ([R]); R as the map defines it (identity: 2L − 1 with
    L = max(q_offset + Nq, k_offset + Nk), or packed_length when packed). Absolute positions are at most
    MAX_POSITION."""
    q_offset, k_offset = _check_offsets(q_offset, k_offset)
    layout = check_layout(layout)
    sides = packing_sides(cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    packed = None
    if sides is not None:
        packed = check_packing(q, k, v, sides, key_padding_mask)
        b, h, h_kv, d = packed.sequences, q.shape[1], k.shape[1], q.shape[2]
        nq, nk = packed.max_seqlen_q, packed.max_seqlen_k
        _check_packed_length(packed, q_offset, k_offset)
    else:
        b, h, h_kv, nq, d, nk = _check_qkv(q, k, v, layout)
        for name, offset, n in (("q_offset", q_offset, nq), ("k_offset", k_offset, nk)):
            if offset + n > MAX_POSITION:
                raise ValueError(
                    f"{name}: the last position {name} + N{name[0]} = {offset} + {n} exceeds relgen.runtime.arguments."
                    f"MAX_POSITION = {MAX_POSITION}, the largest absolute position the kernels hold exactly"
                )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype must match q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: must be on q's device ({q.device}), got {t.device}")
    _check_sizes(b, h, nq, nk, packed)
    # the kernels are compiled per head dimension: a symbolic one (torch.compile, dynamic shapes) is specialised
    d = int(d)
    length = packed_length(packed, q_offset, k_offset) if packed is not None else max(q_offset + nq, k_offset + nk)
    rows = plan.rows_at(length)

    checked = [
        _check_table(plan, name, t, term, want, q)
        for name, t, term, want in (
            ("aq", aq, "query", (rows, d) if plan.heads_share_tables else (h, rows, d)),
            ("ak", ak, "key", (rows, d) if plan.heads_share_tables else (h, rows, d)),
            ("bias", bias, "bias", (rows,) if plan.heads_share_tables else (h, rows)),
        )
    ]

    kpm = None
    if key_padding_mask is not None:
        m = key_padding_mask
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (b, nk):
            raise ValueError(
                f"key_padding_mask: expected a bool tensor of shape [{b}, {nk}] (True = real key), got {_got(m)}"
            )
        if m.layout != torch.strided:
            raise ValueError(f"key_padding_mask: expected a dense (strided) tensor, got layout {m.layout}")
        if m.device != q.device:
            raise ValueError(f"key_padding_mask: must be on q's device ({q.device}), got {m.device}")
        kpm = _kpm_rows(m)

    if (
        isinstance(dropout_p, bool)
        or not isinstance(dropout_p, numbers.Real)
        or not 0.0 <= dropout_p < 1.0  # NaN fails this too
    ):
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {_got(dropout_p)}")
    dropout_p = float(dropout_p)
    seed = _check_seed(dropout_seed, dropout_p, q)
    if scale is None:
        tau = _spec_scale(plan.scale, d)
    else:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise ValueError(f"scale: expected a positive number or None, got {_got(scale)}")
        tau = _fp32_scale("scale", float(scale))

    q, k, v = (lastdim_contiguous(heads_major(t, layout)) for t in (q, k, v))
    geo = Geometry.make(
        plan,
        batch=b,
        heads=h,
        kv_heads=h_kv,
        layout=layout,
        nq=nq,
        nk=nk,
        head_dim=d,
        length=length,
        doff=q_offset - k_offset,
        q_offset=q_offset,
        dtype=q.dtype,
        scale=tau,
        dropout_p=dropout_p,
        seed=seed,
        config=select_config(plan, q.dtype, d, max(nq, nk)),
        varlen=packed is not None,
        reuse=ablation != "no_constant_range_reuse",
        full_windows=ablation == "no_reachable_ranges",
        fp16_storage=projection_storage() == "fp16",
        total=packed.total_q if packed is not None else 0,
        total_k=packed.total_k if packed is not None else 0,
        cu_seqlens=packed.cu_seqlens_q if packed is not None else None,
        cu_seqlens_k=packed.cu_seqlens_k if packed is not None else None,
        qkv_reach=max(tensor_reach(t) for t in (q, k, v)),
    )
    return Call(
        q,
        k,
        v,
        *checked,
        kpm,
        geo,
    )


def _check_sizes(b: Any, h: Any, nq: Any, nk: Any, packed: Packed | None) -> None:
    """The bounds on a call's size that its kernels' int32 scalars set (MAX_TOKEN_ROWS, MAX_GRID_Y); offsets into
    tensors of any size are formed in int64 where they need it (Geometry.int64_offsets)."""
    if b * h > MAX_GRID_Y:
        raise ValueError(
            f"q: batch × heads = {b} × {h} = {b * h} exceeds {MAX_GRID_Y} (relgen.runtime.arguments.MAX_GRID_Y), the "
            "programs a CUDA grid stacks along one axis; split the batch"
        )
    rows = h * max(packed.total_q, packed.total_k) if packed is not None else b * h * max(nq, nk)
    if rows > MAX_TOKEN_ROWS:
        sizes = f"heads × tokens = {h} × {rows // h}" if packed is not None else f"B·H·N = {b}·{h}·{max(nq, nk)}"
        raise ValueError(
            f"q: {sizes} = {rows} token rows exceeds {MAX_TOKEN_ROWS} (relgen.runtime.arguments.MAX_TOKEN_ROWS), the "
            "rows the kernels number in int32; split the batch"
        )


def reach(plan: PlanInfo, q, k, v, options: dict[str, Any]) -> Any:
    """1 + the largest |δ| among the query-key pairs a call scores (causal: among those it may attend; a local
    window: among those inside it), after checking the arguments that decide it: the window a module planned for
    an unproven map must cover (relgen.runtime.mechanism.Mechanism). It depends on the offsets' difference only,
    not on how far along they are."""
    q_offset, k_offset = _check_offsets(options.get("q_offset", 0), options.get("k_offset", 0))
    sides = packing_sides(*(options.get(name) for name in PACKING_OPTIONS))
    if sides is not None:
        packed = check_packing(q, k, v, sides, options.get("key_padding_mask"))
        # a sequence's queries end where its keys end (bottom-right): its last query meets its first key at
        # δ = Lk − 1 + q_offset − k_offset, its first query its last key at δ = 1 − Lq + q_offset − k_offset
        high = q_offset - k_offset + packed.max_seqlen_k - 1
        low = q_offset - k_offset - packed.max_seqlen_q + 1
    else:
        _, _, _, nq, _, nk = _check_qkv(q, k, v, check_layout(options.get("layout", "bhnd")))
        high = q_offset + nq - 1 - k_offset  # δ of the last query and the first key
        low = q_offset - (k_offset + nk - 1)
    return admitted_reach(plan, low, high)


def admitted_reach(plan: PlanInfo, low: int, high: int) -> int:
    """1 + the largest |δ| of [low, high] that the plan's masks admit (PlanInfo.admitted); 1 when they admit none
    of it (no pair is scored)."""
    low, high = plan.admitted(low, high)
    return max(abs(low), abs(high)) + 1 if low <= high else 1


def _check_seed(dropout_seed: Any, dropout_p: float, q: torch.Tensor) -> Any:
    """The seed the kernels draw with: an int, or a one-element tensor they read."""
    if dropout_seed is None:
        if dropout_p > 0 and capturing():
            raise NotImplementedError(
                "dropout_seed: required with dropout_p > 0 under CUDA graph capture (a seed drawn now would be "
                "replayed at every step); pass a one-element int64 tensor and update it between replays"
            )
        return int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    if isinstance(dropout_seed, torch.Tensor):
        return _check_seed_tensor(dropout_seed, q)
    expected = "None, an int in [0, 2**63) or a one-element int64 / int32 tensor"
    return _integer("dropout_seed", dropout_seed, 0, SEED_LIMIT - 1, expected)


@functools.lru_cache(maxsize=256)
def _spec_scale(text: str, head_dim: int) -> float:
    """The spec's τ at this head dimension (MechanismSpec.scale_value of a spec whose scale is `text`), checked
    per head dimension: an expression in d valid at the d the spec was checked at may not be at another."""
    try:
        tau = MechanismSpec.model_construct(scale=text).scale_value(head_dim)
    except (TypeError, ArithmeticError) as err:  # e.g. a complex value, or a division by zero at this d
        raise ValueError(f"scale: the spec's τ = {text} has no real value at d = {head_dim} ({err})") from None
    return _fp32_scale(f"scale: the spec's τ = {text} at d = {head_dim}", tau)


def _fp32_scale(what: str, tau: float) -> float:
    """τ if it and the kernels' exp2 scale τ·log2(e) are normal, finite fp32 numbers (the kernels take both in
    fp32: a larger τ is inf there, a smaller one flushes to 0)."""
    if not (math.isfinite(tau) and tau >= _FP32_TINY and tau * LOG2E <= _FP32_MAX):
        raise ValueError(
            f"{what}: expected a positive number that is a normal, finite fp32 number with τ·log2(e) too "
            f"([{_FP32_TINY:.3g}, {_FP32_MAX / LOG2E:.3g}]), got {tau!r}"
        )
    return tau


def _check_table(plan: PlanInfo, name: str, t: Any, term: str, want: tuple[int, ...], q: torch.Tensor):
    """A relation table (aq, ak: rank 3 or 2 when shared; bias: rank 2 or 1), or None for a term the spec lacks."""
    if term not in plan.terms:
        if t is not None:
            raise ValueError(f"{name}: the spec '{plan.spec_name}' has no '{term}' term, so {name} must be None")
        return None

    def expected() -> str:
        return "[" + ", ".join(map(str, want)) + "]"

    if t is None:
        raise ValueError(f"{name}: required by the spec's '{term}' term, expected shape {expected()}")
    t = _check_tensor(name, t, len(want), expected)
    if t.shape != want:
        raise ValueError(f"{name}: expected shape {expected()}, got {_shape(t)}")
    if term != "bias" and t.dtype != q.dtype:
        raise ValueError(f"{name}: dtype must match q ({q.dtype}), got {t.dtype}")
    if term == "bias" and not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name}: must be on q's device ({q.device}), got {t.device}")
    return t.contiguous()


def _check_q(q, rank: int, expected: str) -> torch.Tensor:
    q = _check_tensor("q", q, rank, lambda: expected)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim d must be a multiple of 8 from 16 to 256, got {q.shape[-1]}")
    interpreted = interpreting()
    if q.device.type != "cuda" and not (interpreted and q.device.type == "cpu"):
        raise ValueError(
            f"q: expected a CUDA tensor (or a CPU one under Triton's interpreter, TRITON_INTERPRET=1), got device "
            f"{q.device}"
        )
    if interpreted and q.dtype == torch.bfloat16:
        raise NotImplementedError(
            "q: bfloat16 is not supported in Triton's interpreter (TRITON_INTERPRET=1, relgen's CPU mode): its bf16 "
            "tl.dot computes wrong products; use float16 or float32 there, or a CUDA GPU"
        )
    return q


def _groups(heads: int, kv_heads: int) -> bool:
    """Whether `heads` query heads split into groups over `kv_heads` key/value heads (none of either: an empty
    call)."""
    return heads % kv_heads == 0 if kv_heads else heads == 0


def _check_qkv(q, k, v, layout: str) -> tuple[int, int, int, int, int, int]:
    """(B, H, H_kv, Nq, d, Nk) of dense q, k, v in `layout`; shapes in messages are in the caller's layout."""

    def dims(b: Any, h: Any, n: Any, d: Any) -> str:
        return f"[{b}, {n}, {h}, {d}]" if layout == "bnhd" else f"[{b}, {h}, {n}, {d}]"

    q = _check_q(q, 4, dims("B", "H", "Nq", "d"))
    b, h, nq, d = heads_major(q, layout).shape
    k = _check_tensor("k", k, 4, lambda: dims(b, "H_kv", "Nk", d))
    v = _check_tensor("v", v, 4, lambda: dims(b, "H_kv", "Nk", d))
    _, h_kv, nk, _ = heads_major(k, layout).shape
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != b or t.shape[3] != d:
            expected = dims(b, "H_kv", "Nk", d)
            raise ValueError(f"{name}: expected shape {expected} to match q {_shape(q)}, got {_shape(t)}")
    if not _groups(h, h_kv):
        raise ValueError(
            f"k: expected H_kv key/value heads dividing q's H = {h} (grouped-query attention: query head h reads "
            f"key/value head h // (H / H_kv)), got H_kv = {h_kv} ({_shape(k)})"
        )
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {_shape(k)} like k, got {_shape(v)}")
    if nq < 1 or nk < 1:
        raise ValueError(f"q, k: sequence lengths must be ≥ 1, got Nq={nq}, Nk={nk}")
    return b, h, h_kv, nq, d, nk


@dataclass(frozen=True)
class PackedSide:
    """The packing of the queries or of the keys as the call gave it, with the argument names its errors use."""

    cu_name: str
    cu_seqlens: Any
    max_name: str
    max_seqlen: Any


@dataclass(frozen=True)
class Packed:
    sequences: int
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor  # cu_seqlens_q itself when both sides are packed alike


def packing_sides(
    cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
) -> tuple[PackedSide, PackedSide] | None:
    """(queries' side, keys' side) of a packed call, one object for both under the shorthand cu_seqlens /
    max_seqlen; None for a dense call. Giving both forms, or one of cu_seqlens_q / cu_seqlens_k without the
    other, is a ValueError naming them."""
    separate = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    given = [name for name, value in zip(PACKING_OPTIONS[2:], separate, strict=True) if value is not None]
    if cu_seqlens is not None or max_seqlen is not None:
        if given:
            shorthand = [
                name
                for name, value in zip(PACKING_OPTIONS[:2], (cu_seqlens, max_seqlen), strict=True)
                if value is not None
            ]
            raise ValueError(
                f"{', '.join(shorthand)}: the shorthand for equal query and key packing, which cannot be combined "
                f"with {', '.join(given)}; pass either cu_seqlens (and max_seqlen) or cu_seqlens_q, cu_seqlens_k "
                "(and max_seqlen_q, max_seqlen_k)"
            )
        side = PackedSide("cu_seqlens", cu_seqlens, "max_seqlen", max_seqlen)
        return side, side
    if not given:
        return None
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if value is None:
            raise ValueError(
                f"{name}: required with {', '.join(given)} (packed sequences: an int32 tensor [S+1] of sequence "
                "starts for the queries, cu_seqlens_q, and one for the keys, cu_seqlens_k)"
            )
    return (
        PackedSide("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q),
        PackedSide("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k),
    )


def packed_length(packed: Packed, q_offset: Any, k_offset: Any) -> Any:
    """The identity map's L of a packed call: 1 + the largest |δ| any of its sequences can reach. Query i of a
    sequence with Lq queries and Lk keys sits at q_offset + Lk − Lq + i and key j at k_offset + j, so δ lies in
    [1 − Lq + q_offset − k_offset, Lk − 1 + q_offset − k_offset]; with equal packing and no offsets, max_seqlen."""
    return max(q_offset, k_offset) + max(packed.max_seqlen_q, packed.max_seqlen_k)


def _check_packed_length(packed: Packed, q_offset: Any, k_offset: Any) -> None:
    length = packed_length(packed, q_offset, k_offset)
    if length > MAX_POSITION:
        name = "q_offset" if q_offset >= k_offset else "k_offset"
        raise ValueError(
            f"{name}: the packed call's length max(q_offset, k_offset) + max(max_seqlen_q, max_seqlen_k) = {length} "
            f"exceeds relgen.runtime.arguments.MAX_POSITION = {MAX_POSITION}, the largest position the kernels hold "
            "exactly"
        )


def _check_starts(side: PackedSide, q: torch.Tensor) -> torch.Tensor:
    """A side's cu_seqlens as a tensor the kernels may read (its values are checked in check_packing)."""
    cu = side.cu_seqlens
    if (
        not isinstance(cu, torch.Tensor)
        or cu.layout != torch.strided
        or cu.dtype != torch.int32
        or cu.dim() != 1
        or cu.numel() < 2
    ):
        raise ValueError(f"{side.cu_name}: expected an int32 tensor [S+1] (S ≥ 1) of sequence starts, got {_got(cu)}")
    if cu.device != q.device:
        raise ValueError(f"{side.cu_name}: must be on q's device ({q.device}), got {cu.device}")
    return cu.contiguous()


def _check_max(side: PackedSide, longest: int, total: int) -> int:
    """A side's max_seqlen: the longest sequence when not given."""
    # a sequence holds at most every token: a larger max_seqlen would only size windows and tables for nothing
    # (bounded by the tensor's shape, so checking it needs no look at cu_seqlens' values on the device)
    most = min(max(total, 1), MAX_POSITION)
    if side.max_seqlen is None:
        return max(longest, 1)
    expected = f"an int ≥ the longest sequence ({longest}) and ≤ the tokens present ({most})"
    return max(_integer(side.max_name, side.max_seqlen, max(longest, 1), most, expected), 1)


def check_packing(q, k, v, sides: tuple[PackedSide, PackedSide], key_padding_mask) -> Packed:
    """Packed q [total_q, H, d] and k, v [total_k, H_kv, d] against their sides' cu_seqlens (int32 [S+1], from 0,
    non-decreasing, ending at the side's token count, both with S + 1 entries) and max_seqlen (≥ the side's
    longest sequence, computed when None; required where the values cannot be read)."""
    q_side, k_side = sides
    equal = q_side is k_side
    q = _check_q(q, 3, f"[total, H, d] (packed: {q_side.cu_name} given)")
    total_q, h, d = q.shape
    k_tokens = "total" if equal else "total_k"
    for name, t in (("k", k), ("v", v)):
        t = _check_tensor(name, t, 3, lambda: f"[{k_tokens}, H_kv, {d}] like q (packed)")
        if (
            (equal and t.shape[0] != total_q)
            or t.shape[0] != k.shape[0]
            or t.shape[2] != d
            or not _groups(h, t.shape[1])
            or t.shape[1] != k.shape[1]
        ):
            tokens = total_q if equal else k_tokens
            raise ValueError(
                f"{name}: expected shape [{tokens}, H_kv, {d}] like q {_shape(q)} (packed sequences), H_kv dividing "
                f"H = {h} (and the same for k and v), got {_shape(t)}"
            )
    total_k = k.shape[0]
    for side, total in ((q_side, total_q), (k_side, total_k)):
        if total > 2**31 - 1:
            raise ValueError(
                f"{side.cu_name}: int32 sequence starts hold at most 2**31 - 1 tokens, got {total} packed tokens"
            )
    cu_q = _check_starts(q_side, q)
    cu_k = cu_q if equal else _check_starts(k_side, q)
    if cu_k.shape[0] != cu_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k: expected {cu_q.shape[0]} entries like cu_seqlens_q (one start per sequence, then the "
            f"end), got {cu_k.shape[0]}"
        )
    if key_padding_mask is not None:
        raise ValueError(f"key_padding_mask: not used with {q_side.cu_name} (packed sequences hold real tokens only)")
    if is_fake(cu_q) or capturing():
        # the values cannot be read: torch.compile traces on shape-only tensors, and a CUDA graph being captured
        # cannot wait for a copy to the host (the values a replay reads are never seen by the host anyway)
        for side in sides:
            if side.max_seqlen is None:
                raise ValueError(
                    f"{side.max_name}: required with {side.cu_name} under torch.compile or CUDA graph capture, "
                    "expected an int"
                )
        longest_q = longest_k = 1
    else:
        # one copy to the host for both sides
        values = cu_q.tolist() if equal else torch.stack((cu_q, cu_k)).tolist()
        longest = []
        for side, starts, total in zip(sides, [values] * 2 if equal else values, (total_q, total_k), strict=True):
            if starts[0] != 0 or any(b < a for a, b in itertools.pairwise(starts)) or starts[-1] != total:
                what = "tokens" if equal else ("queries" if side is q_side else "keys")
                raise ValueError(
                    f"{side.cu_name}: expected non-decreasing offsets from 0 to the {what} present ({total}), got "
                    f"{_got(starts)}"
                )
            longest.append(max(b - a for a, b in itertools.pairwise(starts)))
        longest_q, longest_k = longest
    return Packed(
        sequences=cu_q.shape[0] - 1,
        total_q=total_q,
        total_k=total_k,
        max_seqlen_q=_check_max(q_side, longest_q, total_q),
        max_seqlen_k=_check_max(k_side, longest_k, total_k),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )
