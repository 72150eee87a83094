"""Runtime: argument checking, call geometry, tile configurations, and the cache of compiled mechanisms.

`compile_mechanism(spec)` renders the spec's module (codegen), writes it into the cache directory (Triton needs
real source files) and imports it; calls then go through `Mechanism.__call__`, which picks the module planned
for a long enough window (maps whose saturation sympy could not prove beyond the analysed window are re-planned
for longer sequences).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import sympy
import torch

from relgen.analyze import Plan, analyze
from relgen.expr import parse_expression
from relgen.spec import MechanismSpec, load_spec

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ------------------------------------------------------------------------------------------------------------
# what a generated module knows about its plan
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanInfo:
    name: str
    terms: tuple[str, ...]
    causal: bool
    shared_tables: bool
    scale: str
    length_dependent: bool
    rows: int
    low: int
    high: int
    copy_map: Any  # tuple β(s), or "identity" / "reversed" for identity maps
    fold: Any  # ((first, count) per row) or None
    path: str
    valid_up_to: int | None

    def rows_at(self, length: int) -> int:
        return 2 * length - 1 if self.length_dependent else self.rows

    def bounds_at(self, length: int) -> tuple[int, int]:
        return (-(length - 1), length - 1) if self.length_dependent else (self.low, self.high)


# ------------------------------------------------------------------------------------------------------------
# tile configurations (issue: tuned lookup tables per GPU; here the defaults and the interpreter's)
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnTiles:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class ProjectTiles:
    block_t: int
    block_w: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class ReduceTiles:
    block_t: int
    block_w: int
    block_s: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelConfig:
    group: int
    forward: AttnTiles
    backward: AttnTiles
    project: ProjectTiles
    reduce: ReduceTiles

    def check(self) -> None:
        tiles = (
            self.forward.block_m,
            self.forward.block_n,
            self.backward.block_m,
            self.backward.block_n,
            self.project.block_t,
            self.reduce.block_t,
        )
        bad = [t for t in tiles if self.group % t]
        if bad:
            raise ValueError(f"tile sizes {bad} must divide the group size G={self.group}")


#: The interpreter runs tiles as numpy arrays: small, unequal tiles keep tests quick and catch index mix-ups.
INTERPRETER_CONFIG = KernelConfig(
    group=32,
    forward=AttnTiles(32, 16),
    backward=AttnTiles(16, 32),
    project=ProjectTiles(16, 32),
    reduce=ReduceTiles(16, 32, 16),
)

_override: list[KernelConfig] = []


class override_config:
    """Force a kernel configuration (tests, tuning): `with override_config(cfg): fn(...)`."""

    def __init__(self, config: KernelConfig):
        config.check()
        self.config = config

    def __enter__(self) -> KernelConfig:
        _override.append(self.config)
        return self.config

    def __exit__(self, *exc: object) -> None:
        _override.pop()


def default_config(dtype: torch.dtype, head_dim: int, seq_len: int) -> KernelConfig:
    """Resource heuristic for CUDA GPUs when no tuned entry exists."""
    if interpreting():
        return INTERPRETER_CONFIG
    big_d = head_dim > 64
    fp32 = dtype == torch.float32
    fwd = AttnTiles(
        128 if not fp32 else 64,
        64 if not big_d else 32,
        num_warps=8 if not fp32 else 4,
        num_stages=3 if not big_d else 2,
    )
    bwd = AttnTiles(64, 64 if not (big_d or fp32) else 32, num_warps=4 if not big_d else 8, num_stages=2)
    return KernelConfig(
        group=128,
        forward=fwd,
        backward=bwd,
        project=ProjectTiles(128, 64, num_warps=4, num_stages=3),
        reduce=ReduceTiles(64, 64, 64 if not big_d else 32, num_warps=4, num_stages=2),
    )


def select_config(plan: PlanInfo, dtype: torch.dtype, head_dim: int, seq_len: int) -> KernelConfig:
    """An override (tests, tuning), else the tuned table entry for this GPU, else the resource heuristic."""
    if _override:
        return _override[-1]
    from relgen import tuning  # lookup tables (relgen tune writes them)

    return tuning.lookup(plan.terms, dtype, head_dim, seq_len) or default_config(dtype, head_dim, seq_len)


def column_splits(token_programs: int, column_blocks: int, device: torch.device) -> int:
    """Into how many runs of columns the projection splits each window: one per token block when that alone
    fills the GPU (each program then streams its whole window), more when there are few token blocks."""
    if device.type != "cuda":
        return min(column_blocks, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(column_blocks, math.ceil(4 * sms / max(token_programs, 1))))


def table_chunks(items: int, column_programs: int, device: torch.device) -> int:
    """How many fp32 partials the table reductions write: enough programs to fill the GPU, no more."""
    if device.type != "cuda":
        return min(items, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(items, math.ceil(2 * sms / max(column_programs, 1))))


# ------------------------------------------------------------------------------------------------------------
# geometry of one call
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reduction:
    """How a reduction reads its dZ̃: C columns in windows of W (offset path), or R rows whole (atomic path)."""

    columns: int
    width: int
    stride: int
    doff: int
    low: int
    fp32: bool
    prec: str


@dataclass(frozen=True)
class Expanded:
    aq: torch.Tensor | None  # Ã^Q = E·A^Q
    ak: torch.Tensor | None
    bias: torch.Tensor | None  # b̃ = E·b, fp32
    aq_reduce: torch.Tensor | None  # what the reductions multiply dZ by (Ã, or A on the atomic path)
    ak_reduce: torch.Tensor | None


class GradientBuffer:
    """One dZ̃ buffer shared by both backward passes (the query pass is reduced before the key pass starts)."""

    def __init__(self, geo: Geometry, device: torch.device):
        self.geo = geo
        atomic = geo.path == "atomic"
        self.dtype = torch.float32 if atomic else geo.dtype
        wq, wk = (geo.rows, geo.rows) if atomic else (geo.row_stride(geo.wq), geo.row_stride(geo.wk))
        self.widths = (wq, wk)
        size = max(geo.token_rows(True) * wq, geo.token_rows(False) * wk)
        self.storage = torch.empty(size, device=device, dtype=self.dtype)

    def width(self, query_side: bool) -> int:
        return self.widths[0 if query_side else 1]

    def _view(self, rows: int, width: int) -> torch.Tensor:
        view = self.storage[: rows * width].view(rows, width)
        return view.zero_()  # columns no key (query) reaches must read as zero in the reductions

    def query_view(self) -> torch.Tensor:
        return self._view(self.geo.token_rows(True), self.widths[0])

    def key_view(self) -> torch.Tensor:
        return self._view(self.geo.token_rows(False), self.widths[1])


@dataclass(frozen=True)
class Geometry:
    """Sizes, bounds and windows of one call; every kernel launch reads its scalars from here.

    Packed sequences (`varlen`): `batch` counts sequences, `nq` = `nk` = max_seqlen, `total` tokens in all, and
    each kernel reads its sequence's start and length from `cu_seqlens`."""

    plan: PlanInfo
    batch: int
    heads: int
    nq: int
    nk: int
    head_dim: int
    length: int
    doff: int
    dtype: torch.dtype
    scale: float
    dropout_p: float
    seed: int
    config: KernelConfig
    varlen: bool = False
    total: int = 0
    reuse: bool = True  # constant-range reuse (off: ablation "no_constant_range_reuse")
    full_windows: bool = False  # windows of all C columns (ablation "no_reachable_ranges")
    cu_seqlens: torch.Tensor | None = field(default=None, compare=False, repr=False)
    low: int = 0
    high: int = 0
    c: int = 0
    rows: int = 0
    wq: int = 0
    wk: int = 0

    @classmethod
    def make(cls, plan: PlanInfo, **kw: Any) -> Geometry:
        geo = cls(plan=plan, **kw)
        low, high = plan.bounds_at(geo.length)
        c = high - low + 1
        g = geo.config.group
        return replace(
            geo,
            low=low,
            high=high,
            c=c,
            rows=plan.rows_at(geo.length),
            wq=c if geo.full_windows else min(c, geo.nk + g - 1),
            wk=c if geo.full_windows else min(c, geo.nq + g - 1),
        )

    # derived scalars --------------------------------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.config.group

    @property
    def path(self) -> str:
        return self.plan.path

    @property
    def shared_tables(self) -> bool:
        return self.plan.shared_tables

    @property
    def qk_scale(self) -> float:
        return self.scale * LOG2E  # exp2 in the kernels

    @staticmethod
    def row_stride(width: int) -> int:
        """Row stride of the per-token buffers: the window width rounded up to 16 elements (32-byte rows)."""
        return -(-width // 16) * 16

    def token_rows(self, query_side: bool) -> int:
        """Rows of the internal per-token buffers (Z̃, dZ̃, LSE): one per (batch, head, token)."""
        if self.varlen:
            return self.heads * self.total
        return self.batch * self.heads * (self.nq if query_side else self.nk)

    def cu_seqlens_or(self, dummy: torch.Tensor) -> torch.Tensor:
        return self.cu_seqlens if self.cu_seqlens is not None else dummy

    @property
    def z_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == torch.float32 else torch.float16

    @property
    def clamp_fp16(self) -> bool:
        return self.dtype == torch.bfloat16

    @property
    def prec(self) -> str:
        return "ieee"  # fp32 inputs stay exact (no tf32); ignored for fp16/bf16 operands

    @property
    def copy_beta(self) -> list[int] | None:
        """β(s) for s ∈ [0, C), or None when β is the identity."""
        beta = self.plan.copy_map
        if beta == "identity":
            return None
        if beta == "reversed":
            return list(range(self.c - 1, -1, -1))
        if list(beta) == list(range(self.c)) and self.rows == self.c:
            return None
        return list(beta)

    @property
    def fold(self) -> Any:
        if self.plan.path == "atomic":
            return None
        if self.plan.copy_map == "reversed":
            return tuple((self.c - 1 - r, 1) for r in range(self.rows))
        return self.plan.fold

    def table_head_stride(self, table: torch.Tensor | None) -> int:
        if table is None or self.shared_tables:
            return 0
        return table.stride(0)

    def reduction(self, query_side: bool) -> Reduction:
        if self.path == "atomic":  # W = C = R: every window starts at row 0
            r = self.rows
            return Reduction(columns=r, width=r, stride=r, doff=self.doff, low=self.low, fp32=True, prec="ieee")
        width = self.wq if query_side else self.wk
        fp32 = self.dtype == torch.float32
        return Reduction(
            columns=self.c,
            width=width,
            stride=self.row_stride(width),
            doff=self.doff,
            low=self.low,
            fp32=fp32,
            prec=self.prec,
        )

    # device tensors ---------------------------------------------------------------------------------------
    def copy_map_tensor(self, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """β on the device; kept across calls (building it anew would copy from the host every call)."""
        return _device_constant(
            ("beta", self.plan.copy_map, self.c, self.rows),
            device,
            dtype,
            lambda: self.copy_beta or list(range(self.c)),
        )

    def fold_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(first column, count) of each row's run of copies, on the device."""
        key = ("fold", self.plan.fold, self.plan.copy_map, self.c, self.rows)
        first = _device_constant((*key, "first"), device, torch.int32, lambda: [f for f, _ in self.fold])
        count = _device_constant((*key, "count"), device, torch.int32, lambda: [n for _, n in self.fold])
        return first, count

    def expand(self, aq, ak, bias) -> Expanded:
        """Ã = E·A (a gather of C table rows, done once per call) and b̃ = E·b in fp32."""
        beta = self.copy_beta
        some = next(t for t in (aq, ak, bias) if t is not None)
        index = None if beta is None else self.copy_map_tensor(some.device, torch.long)

        def copy(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
            if t is None:
                return None
            return (t if index is None else t.index_select(dim, index)).contiguous()

        aq_x, ak_x = copy(aq, -2), copy(ak, -2)
        b_x = copy(bias, -1)
        atomic = self.path == "atomic"
        return Expanded(
            aq=aq_x,
            ak=ak_x,
            bias=b_x.float() if b_x is not None else None,
            aq_reduce=aq.contiguous() if atomic and aq is not None else aq_x,
            ak_reduce=ak.contiguous() if atomic and ak is not None else ak_x,
        )

    def gradient_buffer(self, device: torch.device) -> GradientBuffer:
        return GradientBuffer(self, device)


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
        if not return_lse:
            return o
        g = self.geo
        lse = lse2.view(g.heads, g.total).t() if g.varlen else lse2.view(g.batch, g.heads, g.nq)
        return o, lse * LN2


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t: Any, rank: int, expected: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {expected}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected shape {expected} (rank {rank}), got {_shape(t)}")
    return t


def _lastdim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def prepare_call(
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
    q_offset=0,
    k_offset=0,
    dropout_p=0.0,
    dropout_seed=None,
    scale=None,
    ablation=None,
) -> Call:
    """Validate a call against the plan; every problem is a ValueError naming the argument.

    q: [B, H, Nq, d], k, v: [B, H, Nk, d]; or packed q, k, v: [total, H, d] with cu_seqlens (int32 [S+1]) and
    max_seqlen. Tables: aq, ak [H, R, d] ([R, d] with shared tables), bias [H, R] ([R]); R as the map defines
    it (identity: 2L − 1 with L = max(q_offset + Nq, k_offset + Nk), or max_seqlen when packed)."""
    for name, off in (("q_offset", q_offset), ("k_offset", k_offset)):
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {off!r}")
    packed = None
    if cu_seqlens is not None or max_seqlen is not None:
        packed = _check_packed(q, k, v, cu_seqlens, max_seqlen, key_padding_mask, q_offset, k_offset)
        b, h, d = packed.sequences, q.shape[1], q.shape[2]
        nq = nk = packed.max_seqlen
    else:
        b, h, nq, d, nk = _check_qkv(q, k, v)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype must match q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: must be on q's device ({q.device}), got {t.device}")
    length = max(q_offset + nq, k_offset + nk)
    rows = plan.rows_at(length)

    tables = {"aq": (aq, "query", 3), "ak": (ak, "key", 3), "bias": (bias, "bias", 2)}
    checked: dict[str, torch.Tensor | None] = {}
    for name, (t, term, rank) in tables.items():
        shared = plan.shared_tables
        expected = (
            (f"[{rows}, {d}]" if shared else f"[{h}, {rows}, {d}]")
            if rank == 3
            else (f"[{rows}]" if shared else f"[{h}, {rows}]")
        )
        if term not in plan.terms:
            if t is not None:
                raise ValueError(f"{name}: the spec '{plan.name}' has no '{term}' term, so {name} must be None")
            checked[name] = None
            continue
        if t is None:
            raise ValueError(f"{name}: required by the spec's '{term}' term, expected shape {expected}")
        t = _check_tensor(name, t, rank - (1 if shared else 0), expected)
        want = ((rows, d) if shared else (h, rows, d)) if rank == 3 else ((rows,) if shared else (h, rows))
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {expected}, got {_shape(t)}")
        if rank == 3 and t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype must match q ({q.dtype}), got {t.dtype}")
        if rank == 2 and not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: must be on q's device ({q.device}), got {t.device}")
        checked[name] = t.contiguous()

    kpm = None
    if key_padding_mask is not None:
        m = key_padding_mask
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (b, nk):
            got = _shape(m) + f" {m.dtype}" if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(
                f"key_padding_mask: expected a bool tensor of shape [{b}, {nk}] (True = real key), got {got}"
            )
        if m.device != q.device:
            raise ValueError(f"key_padding_mask: must be on q's device ({q.device}), got {m.device}")
        kpm = m.to(torch.int8).contiguous()

    if not isinstance(dropout_p, int | float) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    if dropout_seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    elif isinstance(dropout_seed, int) and not isinstance(dropout_seed, bool) and dropout_seed >= 0:
        seed = dropout_seed
    else:
        raise ValueError(f"dropout_seed: expected None or a non-negative int, got {dropout_seed!r}")
    if scale is None:
        tau = _spec_scale(plan.scale, d)
    elif isinstance(scale, int | float) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0:
        tau = float(scale)
    else:
        raise ValueError(f"scale: expected a positive number or None, got {scale!r}")

    geo = Geometry.make(
        plan,
        batch=b,
        heads=h,
        nq=nq,
        nk=nk,
        head_dim=d,
        length=length,
        doff=q_offset - k_offset,
        dtype=q.dtype,
        scale=tau,
        dropout_p=float(dropout_p),
        seed=seed,
        config=select_config(plan, q.dtype, d, max(nq, nk)),
        varlen=packed is not None,
        reuse=ablation != "no_constant_range_reuse",
        full_windows=ablation == "no_reachable_ranges",
        total=packed.total if packed is not None else 0,
        cu_seqlens=packed.cu_seqlens if packed is not None else None,
    )
    return Call(
        _lastdim_contiguous(q),
        _lastdim_contiguous(k),
        _lastdim_contiguous(v),
        checked["aq"],
        checked["ak"],
        checked["bias"],
        kpm,
        geo,
    )


def _check_q(q, rank: int, expected: str) -> torch.Tensor:
    q = _check_tensor("q", q, rank, expected)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q: dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim d must be one of {SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}")
    return q


def _check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
    q = _check_q(q, 4, "[B, H, Nq, d]")
    b, h, nq, d = q.shape
    k = _check_tensor("k", k, 4, f"[{b}, {h}, Nk, {d}]")
    v = _check_tensor("v", v, 4, f"[{b}, {h}, Nk, {d}]")
    nk = k.shape[2]
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != b or t.shape[1] != h or t.shape[3] != d:
            raise ValueError(f"{name}: expected shape [{b}, {h}, Nk, {d}] to match q {_shape(q)}, got {_shape(t)}")
    if v.shape[2] != nk:
        raise ValueError(f"v: expected shape {_shape(k)} like k, got {_shape(v)}")
    if nq < 1 or nk < 1:
        raise ValueError(f"q, k: sequence lengths must be ≥ 1, got Nq={nq}, Nk={nk}")
    return b, h, nq, d, nk


@dataclass(frozen=True)
class Packed:
    sequences: int
    total: int
    max_seqlen: int
    cu_seqlens: torch.Tensor


def _check_packed(q, k, v, cu_seqlens, max_seqlen, key_padding_mask, q_offset, k_offset) -> Packed:
    q = _check_q(q, 3, "[total, H, d] (packed: cu_seqlens given)")
    for name, t in (("k", k), ("v", v)):
        t = _check_tensor(name, t, 3, f"{_shape(q)} like q (packed)")
        if t.shape != q.shape:
            raise ValueError(f"{name}: expected shape {_shape(q)} like q (packed sequences), got {_shape(t)}")
    if cu_seqlens is None:
        raise ValueError("cu_seqlens: required with max_seqlen (packed sequences), expected int32 [S+1]")
    cu = cu_seqlens
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        got = f"{_shape(cu)} {cu.dtype}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"cu_seqlens: expected an int32 tensor [S+1] of sequence starts, got {got}")
    if cu.device != q.device:
        raise ValueError(f"cu_seqlens: must be on q's device ({q.device}), got {cu.device}")
    starts = cu.tolist()
    total = q.shape[0]
    if starts[0] != 0 or any(b < a for a, b in itertools.pairwise(starts)) or starts[-1] != total:
        raise ValueError(f"cu_seqlens: expected increasing offsets from 0 to total={total}, got {starts}")
    longest = max(b - a for a, b in itertools.pairwise(starts))
    if max_seqlen is None:
        max_seqlen = longest
    elif not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < max(longest, 1):
        raise ValueError(f"max_seqlen: expected an int ≥ the longest sequence ({longest}), got {max_seqlen!r}")
    if key_padding_mask is not None:
        raise ValueError("key_padding_mask: not used with cu_seqlens (packed sequences hold real tokens only)")
    if q_offset or k_offset:
        raise ValueError("q_offset: position offsets are not supported with cu_seqlens (each sequence starts at 0)")
    return Packed(len(starts) - 1, total, max(max_seqlen, 1), cu.contiguous())


@functools.lru_cache(maxsize=256)
def _spec_scale(text: str, head_dim: int) -> float:
    return float(parse_expression(text, ("d",)).subs(sympy.Symbol("d", integer=True), head_dim))


_DEVICE_CONSTANTS: dict[tuple, torch.Tensor] = {}

#: The paper's Table 7 switches that `fn(..., ablation=name)` accepts (relgen bench --ablation).
ABLATIONS = ("atomic_gradients", "no_reachable_ranges", "no_constant_range_reuse", "recompute_projections")


def _device_constant(key: tuple, device: torch.device, dtype: torch.dtype, values) -> torch.Tensor:
    """A small index tensor built once per (key, device, dtype) and reused by every later call."""
    full = (key, str(device), dtype)
    if full not in _DEVICE_CONSTANTS:
        _DEVICE_CONSTANTS[full] = torch.tensor(values(), dtype=dtype, device=device).contiguous()
    return _DEVICE_CONSTANTS[full]


# ------------------------------------------------------------------------------------------------------------
# compiled mechanisms
# ------------------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    root = os.environ.get("RELGEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "relgen"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


_MODULES: dict[str, ModuleType] = {}


def load_module(plan: Plan) -> ModuleType:
    """Render, write and import the module of `plan` (cached by the source's hash)."""
    from relgen import codegen

    source = codegen.render(plan)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    if digest in _MODULES:
        return _MODULES[digest]
    module_name = f"relgen_generated_{plan.spec_name}_{digest}"
    path = cache_dir() / f"{module_name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    _MODULES[digest] = module
    return module


class Mechanism:
    """The callable `compile_mechanism` returns: `fn(q, k, v, aq=None, ak=None, bias=None, **options)`."""

    def __init__(self, spec: MechanismSpec):
        self.spec = spec
        self.plan = analyze(spec)
        self.module = load_module(self.plan)
        self._wider: dict[int, ModuleType] = {}

    def module_for(self, window: int) -> ModuleType:
        limit = self.module.PLAN.valid_up_to
        if limit is None or window <= limit:
            return self.module
        n = 1 << (window - 1).bit_length()
        if n not in self._wider:
            self._wider[n] = load_module(analyze(self.spec, n))
        return self._wider[n]

    def __call__(self, q, k, v, aq=None, ak=None, bias=None, *, ablation: str | None = None, **options: Any):
        window = 1
        cu = options.get("cu_seqlens")
        if isinstance(cu, torch.Tensor) and cu.numel() > 1:
            window = options.get("max_seqlen") or int((cu[1:] - cu[:-1]).max())
        elif isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4:
            nq, nk = q.shape[-2], k.shape[-2]
            window = max(options.get("q_offset", 0) + nq, options.get("k_offset", 0) + nk)
        module = self.module_for(window)
        if ablation is not None:
            module, options = self._ablated(module, ablation, options)
        return module.attention(q, k, v, aq, ak, bias, **options)

    def _ablated(self, module: ModuleType, ablation: str, options: dict[str, Any]):
        """One component of the method switched off (the paper's Table 7), for `relgen bench --ablation`."""
        if ablation not in ABLATIONS:
            raise ValueError(f"ablation: expected one of {ABLATIONS}, got {ablation!r}")
        if ablation == "recompute_projections":
            return module, {**options, "recompute_projections": True}
        if ablation == "atomic_gradients":  # the fallback's per-pair atomic adds on a map that does not need them
            key = -1
            if key not in self._wider:
                plan = analyze(self.spec, module.PLAN.valid_up_to) if module.PLAN.valid_up_to else self.plan
                self._wider[key] = load_module(replace(plan, path="atomic"))
            return self._wider[key], options
        return module, {**options, "_ablation": ablation}

    def __repr__(self) -> str:
        return f"<relgen mechanism {self.plan.summary()}>"


_MECHANISMS: dict[str, Mechanism] = {}


def compile_mechanism(spec: MechanismSpec | dict | str | Path) -> Mechanism:
    """Compile (or fetch from the cache, keyed by the spec's hash) the kernels of `spec`."""
    spec = load_spec(spec)
    key = spec.spec_hash()
    if key not in _MECHANISMS:
        _MECHANISMS[key] = Mechanism(spec)
    return _MECHANISMS[key]
