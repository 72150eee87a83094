"""What a generated module knows about its plan (PlanInfo, a view of the Plan), and the geometry of one call: sizes,
saturation bounds, windows, expanded tables and the backward pass's gradient buffer."""

from __future__ import annotations

import copy
import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from relgen.runtime.dropout_stream import dropout_mode
from relgen.tiles.configs import KernelConfig, head_block

LOG2E = 1.4426950408889634
#: Rows of the per-token buffers (Z̃, dZ̃) start at multiples of this many elements (16 bytes in fp16). Kernels
#: receive those row strides in units of it, so that the compiler can prove the alignment and vectorize.
ROW_ALIGN = 8
#: The largest offset (in elements) the kernels' index arithmetic forms in int32: a call that may form a larger one
#: compiles them with int64 strides (Geometry.int64_offsets, the kernels' INT64)
INT32_REACH = 2**31 - 1
#: Rows past a sequence's last token that a tile's masked lanes address (offsets formed, never dereferenced)
TILE_SLACK = 512


def int64_offsets(geo: Geometry, *tensors: torch.Tensor) -> bool:
    """The kernels' INT64 for a pass of this call that also reads `tensors` (the backward's dO)."""
    return geo.int64_offsets or any(tensor_reach(t) > INT32_REACH for t in tensors)


def tensor_reach(t: torch.Tensor) -> int:
    """The largest offset the kernels form into t, a [B, H, N, d] view or packed [total, H, d] tokens: the offset of
    its last element through its strides, with TILE_SLACK more tokens."""
    strides = t.stride()
    token = strides[2] if len(strides) == 4 else strides[0]
    return sum((n - 1) * abs(s) for n, s in zip(t.shape, strides, strict=True)) + TILE_SLACK * abs(token)


# ------------------------------------------------------------------------------------------------------------
# what a generated module knows about its plan
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanInfo:
    """The facts of a Plan (relgen.plan.analyze.Plan) that a generated module's calls read, under the Plan's names and
    with its values, except where noted; relgen.codegen.generator.PLAN_INFO_FIELDS lists them."""

    spec_name: str
    terms: tuple[str, ...]
    causal: bool
    heads_share_tables: bool
    scale: str  # in normal form (the same expression as the Plan's)
    length_dependent: bool
    rows: int
    saturation_low: int
    saturation_high: int
    # β(s); for a length-dependent map "identity" or "reversed", β(s) = (R − 1)/2 ± (s + L) at every length
    copy_map: tuple[int, ...] | str
    path: str
    projections: str = "by_offset"  # "by_row": stored per table row, read through β (ablation no_bucket_copies)
    relations: str = "projected"  # "in_tile": products formed per band tile from Ã (ablation no_projections)
    # the spec's local window: keys with δ ∈ [−local_right, local_left] only (None: that side unbounded)
    local_left: int | None = None
    local_right: int | None = None
    # derived (relgen.codegen.generator.PLAN_INFO_DERIVED): (first column, count) of each row's run of copies, or None
    fold: tuple[tuple[int, int], ...] | None = None
    # the length the plan was made for, when the map's saturation is not proven beyond it (else None)
    valid_up_to: int | None = None
    # device copies of β and the fold runs, built once per (what, C, device, dtype): hashing β itself on every
    # call would cost more than the launch it serves
    constants: dict[tuple, torch.Tensor] = field(default_factory=dict, compare=False, hash=False, repr=False)
    # the Geometry of each call signature that passed check_call (relgen.runtime.arguments.prepare_call)
    calls: OrderedDict[tuple, Geometry] = field(default_factory=OrderedDict, compare=False, hash=False, repr=False)

    @functools.cached_property
    def copies_are_rows(self) -> bool:
        """β(s) = s with C = R: the expanded tables are the tables themselves (no gather)."""
        beta = self.copy_map
        if beta == "identity":
            return not self.windowed_identity
        return not isinstance(beta, str) and tuple(beta) == tuple(range(self.rows))

    @property
    def windowed_identity(self) -> bool:
        """An identity map under a local window: only the window's offsets are expanded (C = their count)."""
        return self.length_dependent and (self.local_left is not None or self.local_right is not None)

    def rows_at(self, length: int) -> int:
        return 2 * length - 1 if self.length_dependent else self.rows

    def offset_rows(self, delta: torch.Tensor) -> torch.Tensor:
        """φ(δ) for a tensor of offsets, on its device, as the kernels read it: β(clip(δ, L, U) − L). For maps whose
        rows do not depend on the length and whose saturation is proven (else NotImplementedError)."""
        if self.length_dependent or self.valid_up_to is not None or isinstance(self.copy_map, str):
            raise NotImplementedError(
                f"offset_rows: the rows of spec '{self.spec_name}' depend on the length, or its map is not proven "
                "constant beyond the analysed window"
            )
        low, high = self.saturation_low, self.saturation_high
        beta = self.device_constant(
            ("beta", torch.long, high - low + 1, self.rows, low), delta.device, lambda: list(self.copy_map)
        )
        return beta[delta.clamp(low, high) - low]

    def device_constant(self, key: tuple, device: torch.device, values: Callable[[], list[int]]) -> torch.Tensor:
        """A small index tensor of the plan, built once per (key, device) and reused by every later call; key[1] is
        its dtype."""
        key = (*key, str(device))
        if key not in self.constants:
            self.constants[key] = _outside_graph_pools(lambda: torch.tensor(values(), dtype=key[1], device=device))
        return self.constants[key]

    def bounds_at(self, length: int) -> tuple[int, int]:
        if not self.length_dependent:
            return self.saturation_low, self.saturation_high
        low, high = -(length - 1), length - 1
        if self.windowed_identity:  # the analyzer's clipping (relgen.plan.analyze._window), at this length
            return self.admitted(low, high)
        return low, high

    def admitted(self, low: int, high: int) -> tuple[int, int]:
        """The offsets of [low, high] the plan's masks admit (causal: δ ≥ 0; the local window: δ ∈ [−local_right,
        local_left]); an empty interval (low > high) when they admit none."""
        if self.causal:
            low = max(low, 0)
        if self.local_right is not None:
            low = max(low, -self.local_right)
        if self.local_left is not None:
            high = min(high, self.local_left)
        return low, high


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
    prec: str
    aligned: bool  # every window starts on a multiple of 16 columns (the kernels may then load dZ̃ vector-wide)

    @property
    def stride_units(self) -> int:
        """The row stride in units of ROW_ALIGN, as the kernels take it."""
        return self.stride // ROW_ALIGN


@dataclass(frozen=True)
class Expanded:
    aq: torch.Tensor | None  # what the projections read: Ã^Q = E·A^Q (A^Q itself when projected by row)
    ak: torch.Tensor | None
    bias: torch.Tensor | None  # b̃ = E·b (b when projected by row), fp32
    aq_reduce: torch.Tensor | None  # what the reductions multiply dZ by (Ã, or A on the atomic path)
    ak_reduce: torch.Tensor | None


class GradientBuffer:
    """One dZ̃ buffer shared by both backward passes (the query pass is reduced before the key pass starts)."""

    def __init__(self, geo: Geometry, device: torch.device):
        self.geo = geo
        self.dtype = geo.dz_dtype
        self.widths = geo.gradient_widths()
        self.storage = torch.empty(geo.gradient_elements(), device=device, dtype=self.dtype)
        if os.environ.get("RELGEN_POISON_BUFFERS"):  # tests: an entry that no kernel writes shows up as NaN
            self.storage.fill_(float("nan"))

    def units(self, query_side: bool) -> int:
        """A side's row stride in units of ROW_ALIGN, as the kernels take it."""
        return self.widths[0 if query_side else 1] // ROW_ALIGN

    def _view(self, rows: int, width: int) -> torch.Tensor:
        view = self.storage[: rows * width].view(rows, width)
        # the offset path's passes zero the columns their pairs do not reach (_zero_unreached); atomics add up
        return view.zero_() if self.geo.path == "atomic" else view

    def query_view(self) -> torch.Tensor:
        return self._view(self.geo.token_rows(True), self.widths[0])

    def key_view(self) -> torch.Tensor:
        return self._view(self.geo.token_rows(False), self.widths[1])


@dataclass(frozen=True)
class Geometry:
    """Sizes, bounds and windows of one call; every kernel launch reads its scalars from here.

    Packed sequences (`varlen`): `batch` counts sequences, `nq` and `nk` are max_seqlen_q and max_seqlen_k,
    `total` and `total_k` the query and key tokens in all, and each kernel reads its sequence's starts and lengths
    from `cu_seqlens` (queries) and `cu_seqlens_k` (keys; the same tensor under equal packing). `doff` is
    q_offset − k_offset; a sequence with Lq queries and Lk keys adds Lk − Lq to it (its queries end where its keys
    end, as FlashAttention aligns them).

    `heads` counts query heads, `kv_heads` key/value heads (grouped-query attention: query head h reads key/value
    head h // kv_group); tables, Z̃ and dZ̃ are per query head. `layout`: the caller's layout of dense q, k, v and
    O (relgen.runtime.arguments.LAYOUTS); the kernels see [B, H, N, d] views of them either way."""

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
    seed: int | torch.Tensor  # a tensor: one element the kernels read (relgen.runtime.dropout.seed_value)
    config: KernelConfig
    varlen: bool = False
    total: int = 0
    reuse: bool = True  # constant-range reuse (off: ablation "no_constant_range_reuse")
    full_windows: bool = False  # windows of all C columns (ablation "no_reachable_ranges")
    fp16_storage: bool = False  # relgen.config.projection_storage() == "fp16" when the call was checked
    kv_heads: int = 0  # make() defaults it to `heads`
    layout: str = "bhnd"
    cu_seqlens: torch.Tensor | None = field(default=None, compare=False, repr=False)
    total_k: int = 0
    cu_seqlens_k: torch.Tensor | None = field(default=None, compare=False, repr=False)
    low: int = 0
    high: int = 0
    c: int = 0
    rows: int = 0
    wq: int = 0
    wk: int = 0
    q_offset: int = 0  # the absolute position of query 0 (dropout keys its stream by absolute positions)
    qkv_reach: int = 0  # the largest tensor_reach of q, k and v

    @classmethod
    def make(cls, plan: PlanInfo, **kw: Any) -> Geometry:
        low, high = plan.bounds_at(kw["length"])
        c = high - low + 1
        g = kw["config"].group
        full = kw.get("full_windows", False)
        kw.setdefault("kv_heads", kw["heads"])
        return cls(
            plan=plan,
            low=low,
            high=high,
            c=c,
            rows=plan.rows_at(kw["length"]),
            wq=c if full else min(c, kw["nk"] + g - 1),
            wk=c if full else min(c, kw["nq"] + g - 1),
            **kw,
        )

    def with_seed(self, seed: int | torch.Tensor) -> Geometry:
        """This call's geometry with another dropout seed: the one field that changes between the calls of a kept
        signature (relgen.runtime.arguments.prepare_call). A copy keeps the derived values already cached on it,
        none of which depends on the seed, and costs a fraction of dataclasses.replace's re-initialisation."""
        kept = copy.copy(self)
        object.__setattr__(kept, "seed", seed)  # frozen: the dataclass's own escape hatch, on a fresh copy
        return kept

    # derived scalars --------------------------------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.config.group

    @property
    def path(self) -> str:
        return self.plan.path

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head (1: ordinary multi-head attention)."""
        return self.heads // self.kv_heads if self.kv_heads else 1

    @property
    def dropout_mode(self) -> int:
        """The kernels' DROPOUT constexpr (relgen.runtime.dropout_stream.dropout_mode)."""
        return dropout_mode(self.dropout_p, self.q_offset - self.doff)

    @property
    def block_d(self) -> int:
        """The kernels' tile width along d (relgen.tiles.configs.head_block)."""
        return head_block(self.head_dim)

    @property
    def heads_share_tables(self) -> bool:
        return self.plan.heads_share_tables

    @property
    def qk_scale(self) -> float:
        return self.scale * LOG2E  # exp2 in the kernels

    @staticmethod
    def row_stride(width: int) -> int:
        """Row stride of the per-token buffers: the window width rounded up to ROW_ALIGN elements."""
        return -(-width // ROW_ALIGN) * ROW_ALIGN

    @staticmethod
    def row_units(width: int) -> int:
        """The row stride as the kernels receive it: in units of ROW_ALIGN elements."""
        return Geometry.row_stride(width) // ROW_ALIGN

    @functools.cached_property
    def int64_offsets(self) -> bool:
        """Whether a kernel of this call may form an offset past INT32_REACH: into q, k or v (b·stride_b + h·stride_h
        + token·stride_n, each factor an int32), into one sequence's rows of Z̃ or dZ̃ (a token times the row stride:
        an identity map's Z̃^Q is N × (N + G) per head, past 2³¹ from N ≈ 46K on), or into the tables (head times
        C·d). The kernels then take their strides in int64 (INT64); dO's reach is the backward's to add."""
        widths = [self.wq, self.wk, *self.projection_columns(True)[1:], *self.projection_columns(False)[1:]]
        if self.path == "atomic":
            widths.append(self.rows)  # dZ̃ by table row
        tokens = max(self.nq, self.nk) + TILE_SLACK
        rows = tokens * (self.row_stride(max(widths)) + 1)  # row·(stride + 1): the band's diagonal runs
        tables = (1 if self.heads_share_tables else self.heads) * (max(self.c, self.rows) + TILE_SLACK) * self.head_dim
        return max(self.qkv_reach, rows, tables) > INT32_REACH

    def token_rows(self, query_side: bool) -> int:
        """Rows of the internal per-token buffers (Z̃, dZ̃, LSE): one per (batch, head, token)."""
        if self.varlen:
            return self.heads * (self.total if query_side else self.total_k)
        return self.batch * self.heads * (self.nq if query_side else self.nk)

    def cu_seqlens_or(self, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' CU and CU_K: the queries' and the keys' sequence starts (`dummy` twice when not packed)."""
        if self.cu_seqlens is None:
            return dummy, dummy
        return self.cu_seqlens, self.cu_seqlens_k if self.cu_seqlens_k is not None else self.cu_seqlens

    @property
    def z_dtype(self) -> torch.dtype:
        """Z̃'s storage: fp16 for half-precision inputs under the fp16 projection storage (relgen.config), scaled by
        a power of two so that no entry overflows (relgen.runtime.scales), else fp32. Never bf16: its 8-bit significand
        would round the relation terms more coarsely than the inputs' own products."""
        return torch.float16 if self.fp16_storage and self.dtype != torch.float32 else torch.float32

    @property
    def dz_dtype(self) -> torch.dtype:
        """dZ̃'s storage: fp32, or fp16 for fp16 inputs on the offset path under the fp16 projection storage (scaled
        like Z̃: relgen.runtime.scales). fp32 on the atomic path (it adds in fp32), and for bf16 inputs in
        either storage: a row's boundary column holds the sum over all its saturated pairs, and bf16's 8-bit
        significand rounds it coarsely enough that a bucket whose gradient cancels (decoding, one query row)
        misses the criterion (seen on the H200: T5 decoder, Nq = 1, N = 4096)."""
        fp16 = self.fp16_storage and self.dtype == torch.float16 and self.path == "offset"
        return torch.float16 if fp16 else torch.float32

    @property
    def prec(self) -> str:
        return "ieee"  # fp32 inputs stay exact (no tf32); ignored for fp16/bf16 operands

    @property
    def copy_beta(self) -> list[int] | None:
        """β(s) for s ∈ [0, C), or None when β is the identity."""
        if self.plan.copies_are_rows:
            return None
        beta = self.plan.copy_map
        if beta in ("identity", "reversed"):  # row δ + L − 1 (reversed: −δ + L − 1) of column s, δ = s + low
            base = (self.rows - 1) // 2
            sign = -1 if beta == "reversed" else 1
            return [base + sign * (s + self.low) for s in range(self.c)]
        return list(beta)

    @property
    def fold(self) -> Any:
        """(first column, count) of each table row's run of copies, or None where no fold is needed (β is the
        identity, or the atomic path reduced by row). Read by every backward: a length-dependent map's runs are
        built once per (C, R, low), not per call (2L − 1 rows: ~20 ms of Python per call at 32K)."""
        if self.plan.path == "atomic":
            return None
        reversed_map, windowed = self.plan.copy_map == "reversed", self.plan.windowed_identity
        if reversed_map or windowed:
            return _length_dependent_fold(reversed_map, windowed, self.c, self.rows, self.low)
        return self.plan.fold

    @property
    def admitted_offsets(self) -> tuple[int, int]:
        """The δ interval of this call's pairs that the plan's masks admit (empty: low > high)."""
        if self.varlen:  # a sequence's queries end where its keys end (check_call): δ ∈ [1 − Lq, Lk − 1] + doff
            return self.plan.admitted(self.doff - (self.nq - 1), self.doff + self.nk - 1)
        return self.plan.admitted(self.doff - (self.nk - 1), self.doff + self.nq - 1)

    @property
    def saturated_tiles(self) -> bool:
        """Whether the forward can meet a saturated key tile (every pair at δ ≥ high or ≤ low): only where the keys
        outnumber the band's columns and the masks admit offsets beyond the band. A local window that ends at the
        band's edge (Shaw's [0, 256] inside its clipping at ±256) leaves none: a tile spans several offsets."""
        low, high = self.admitted_offsets
        return self.nk > self.c and (low < self.low or high > self.high)

    @property
    def scored_pairs(self) -> int:
        """B·H·Nq·Nk, each query's keys counted at most as many as the admitted offsets: the pairs the kernels
        score, what a call's GPU time grows with (a local window of 257 offsets at 32K: 1/128 of B·H·Nq·Nk)."""
        low, high = self.admitted_offsets
        return self.batch * self.heads * self.nq * max(min(self.nk, high - low + 1), 0)

    def table_head_stride(self, table: torch.Tensor | None) -> int:
        if table is None or self.heads_share_tables:
            return 0
        return table.stride(0)

    def projection_columns(self, query_side: bool) -> tuple[int, int]:
        """(columns, window width) of a side's stored projection: C expanded columns in windows of W, or all R
        rows (ablation no_bucket_copies: no windows in row space)."""
        if self.plan.projections == "by_row":
            return self.rows, self.rows
        return self.c, self.wq if query_side else self.wk

    def reduction(self, query_side: bool) -> Reduction:
        if self.path == "atomic":  # W = C = R: every window starts at row 0
            r = self.rows
            stride = self.row_stride(r)
            return Reduction(columns=r, width=r, stride=stride, doff=self.doff, low=self.low, prec="ieee", aligned=True)
        width = self.wq if query_side else self.wk
        return Reduction(
            columns=self.c,
            width=width,
            stride=self.row_stride(width),
            doff=self.doff,
            low=self.low,
            # fp16 inputs: an fp32 dZ̃ enters the GEMMs as tf32, whose significand is fp16's and whose range is
            # fp32's; bf16 inputs split it into two bf16 products instead (the kernels' _dz_dot); fp32: exact
            prec="tf32" if self.dtype != torch.float32 and self.dz_dtype == torch.float32 else self.prec,
            aligned=self.windows_aligned(query_side),
        )

    def windows_aligned(self, query_side: bool) -> bool:
        """Whether every group's window start clip(±gG + base, 0, C − W) is a multiple of 16 (docs/algorithm.md's
        window formula; base as in the kernels' `_window_base`). Packed sequences have a base per sequence: no."""
        width = self.wq if query_side else self.wk
        if self.c == width:
            return True  # every window is the whole expansion and starts at 0
        if self.varlen:
            return False
        base = self.doff - (self.nk - 1 if query_side else self.group - 1) - self.low
        return base % 16 == 0 and (self.c - width) % 16 == 0 and self.group % 16 == 0

    # device tensors ---------------------------------------------------------------------------------------
    def copy_map_tensor(self, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """β on the device; kept across calls (building it anew would copy from the host every call)."""
        return self._device_constant("beta", dtype, device, lambda: self.copy_beta or list(range(self.c)))

    def fold_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(first column, count) of each row's run of copies, on the device."""
        first = self._device_constant("fold first", torch.int32, device, lambda: [f for f, _ in self.fold])
        count = self._device_constant("fold count", torch.int32, device, lambda: [n for _, n in self.fold])
        return first, count

    def expand(self, aq, ak, bias) -> Expanded:
        """Ã = E·A (a gather of C table rows, done once per call) and b̃ = E·b, both in their table's dtype: copies,
        so exact; the kernels add b̃ to fp32 scores, and a half-precision b̃ halves what its band gathers move."""
        some = next(t for t in (aq, ak, bias) if t is not None)
        index = None if self.plan.copies_are_rows else self.copy_map_tensor(some.device, torch.long)

        def copy(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
            if t is None:
                return None
            return (t if index is None else t.index_select(dim, index)).contiguous()

        aq_x, ak_x = copy(aq, -2), copy(ak, -2)
        b_x = copy(bias, -1)
        atomic = self.path == "atomic"
        by_row = self.plan.projections == "by_row"  # the scores read rows through β; dZ̃ stays by offset
        if by_row:
            b_x = bias.contiguous() if bias is not None else None
        return Expanded(
            aq=aq.contiguous() if by_row and aq is not None else aq_x,
            ak=ak.contiguous() if by_row and ak is not None else ak_x,
            bias=b_x,
            aq_reduce=aq.contiguous() if atomic and aq is not None else aq_x,
            ak_reduce=ak.contiguous() if atomic and ak is not None else ak_x,
        )

    def _device_constant(self, name: str, dtype: torch.dtype, device: torch.device, values) -> torch.Tensor:
        """The plan's device constant (PlanInfo.device_constant) of this name at this call's C, R and L (they vary
        with the length only for identity maps)."""
        return self.plan.device_constant((name, dtype, self.c, self.rows, self.low), device, values)

    def gradient_widths(self) -> tuple[int, int]:
        """The row strides of dZ̃'s query and key views: the windows W (all R rows on the atomic path), rounded up
        to ROW_ALIGN."""
        windows = (self.rows, self.rows) if self.path == "atomic" else (self.wq, self.wk)
        return self.row_stride(windows[0]), self.row_stride(windows[1])

    def gradient_elements(self) -> int:
        """Entries of the dZ̃ buffer both backward passes share: the larger side's token rows × row stride."""
        wq, wk = self.gradient_widths()
        return max(self.token_rows(True) * wq, self.token_rows(False) * wk)

    def gradient_buffer(self, device: torch.device) -> GradientBuffer:
        return GradientBuffer(self, device)


@functools.lru_cache(maxsize=64)
def _length_dependent_fold(
    reversed_map: bool, windowed: bool, c: int, rows: int, low: int
) -> tuple[tuple[int, int], ...]:
    """Geometry.fold of an identity (or reversed) map at R = 2L − 1 rows whose columns s ∈ [0, C) hold the offsets
    δ = s + low: row r = (R − 1)/2 ± δ is column ±(r − (R − 1)/2) − low, one column per row; a windowed map's rows
    outside the window read none, (0, 0). Without a window a reversed map's C columns are its R rows backwards."""
    if not windowed:
        return tuple((c - 1 - r, 1) for r in range(rows))
    base, sign = (rows - 1) // 2, -1 if reversed_map else 1
    columns = (sign * (r - base) - low for r in range(rows))
    return tuple((s, 1) if 0 <= s < c else (0, 0) for s in columns)


def _outside_graph_pools(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make() on a thread of its own, for a CUDA tensor kept across calls. A CUDA graph's warm-up run (torch.compile's
    mode='reduce-overhead' warms up before it captures) sends the calling thread's allocations to the graph's
    private pool, where a tensor that outlives the graph's outputs is an error ("tensor(s) in the cudagraph pool
    not tracked as outputs"); another thread allocates from the ordinary pool. make() must wait for its own copies
    (a host-to-device copy that is not non_blocking does)."""
    made: list[torch.Tensor] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            made.append(make())
        except BaseException as err:  # re-raised in the caller's thread
            failed.append(err)

    worker = threading.Thread(target=run, name="relgen-device-constant")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return made[0]
