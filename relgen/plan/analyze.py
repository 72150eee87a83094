"""The analyzer: spec + sequence length → `Plan`, the single input of code generation.

Notation (docs/glossary.md): δ = i − j; φ(δ) the map; R its rows; L ≤ U the saturation bounds (φ is constant on
δ ≤ L and on δ ≥ U); C = U − L + 1 expanded columns with s(δ) = clip(δ, L, U) − L and copy map β(s) = φ(s + L),
so that φ(δ) = β(s(δ)) (bucket copies Ã = E·A); G the group size; Ω_g the reachable columns of query group g,
[s0(g), s0(g) + W).
"""

from __future__ import annotations

import contextlib
import gc
import json
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np

from relgen.spec.limits import MAX_SEQ_LEN, quoted
from relgen.spec.maps import ExpressionMap, IdentityMap
from relgen.spec.model import DEFAULT_SCALE, HasTerms, MechanismSpec, SpecError, load_spec

#: Query/key group size G: the largest tile, so every tile reads one group's window.
GROUP_SIZE = 128
#: Longest window tried when searching the length from which a map's saturation provably holds.
MAX_CANONICAL_LENGTH = 1 << 16
#: Offset magnitude standing in for ±∞ when checking that a map has reached its limit row (beyond any window).
_FAR = 1 << 30

Path = Literal["offset", "atomic"]
#: How the kernels get the relation products q_i·ã_s (k_j·ã_s): from the stored projections Z̃, or formed per tile
#: from the expanded table (the paper's Table 7 ablation "w/o projections").
Relations = Literal["projected", "in_tile"]
#: How stored projections are laid out: one column per expanded offset column (Z̃ = Z Eᵀ, the bucket copies), or,
#: for the Table 7 ablation "w/o bucket copies", one column per table row, read through β per score.
Projections = Literal["by_offset", "by_row"]


@dataclass(frozen=True)
class RowSpan:
    """The offsets (within the window) that read one table row, as closed intervals."""

    row: int
    intervals: tuple[tuple[int, int], ...]

    @property
    def contiguous(self) -> bool:
        return len(self.intervals) == 1


@dataclass(frozen=True)
class Plan(HasTerms):
    """Everything code generation and dispatch need to know about one mechanism at one sequence length."""

    spec_name: str
    spec_hash: str
    seq_len: int
    map_kind: str
    terms: tuple[str, ...]
    causal: bool
    heads_share_tables: bool
    scale: str
    rows: int
    length_dependent: bool
    contiguous: bool
    path: Path
    row_spans: tuple[RowSpan, ...]
    row_order: tuple[int, ...]
    unreached_rows: tuple[int, ...]
    saturation_low: int
    saturation_high: int
    saturation_proven: bool
    copy_map: tuple[int, ...]
    group_size: int
    query_window: int
    key_window: int
    groups: int
    cost: dict[str, float] = field(default_factory=dict)
    relations: Relations = "projected"
    projections: Projections = "by_offset"
    # the spec's local window (its `window` field): keys with δ ∈ [−local_right, local_left] only; None: unbounded
    local_left: int | None = None
    local_right: int | None = None

    # -- derived -------------------------------------------------------------------------------------------
    @property
    def has_local_window(self) -> bool:
        return self.local_left is not None or self.local_right is not None

    @property
    def expanded_rows(self) -> int:
        """C = U − L + 1."""
        return self.saturation_high - self.saturation_low + 1

    @property
    def has_copies(self) -> bool:
        """True when some bucket is copied to several columns (E is not a permutation)."""
        return len(set(self.copy_map)) < len(self.copy_map)

    @property
    def copy_is_identity(self) -> bool:
        """True when β(s) = s: the expanded table is the table itself (identity and clipped maps)."""
        return self.copy_map == tuple(range(len(self.copy_map))) and self.rows == len(self.copy_map)

    @property
    def bias_folded_into(self) -> Literal["query", "key", None]:
        """Which stored projection carries b, so a score reads two entries instead of three."""
        if not self.has_bias:
            return None
        if self.has_query:
            return "query"
        if self.has_key:
            return "key"
        return None

    def to_json(self) -> dict[str, Any]:
        # fields one level deep, not dataclasses.asdict: its deep copy of an identity map's 2N − 1 spans takes seconds
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["cost"] = dict(self.cost)
        data["row_spans"] = [{"row": s.row, "intervals": [list(i) for i in s.intervals]} for s in self.row_spans]
        data["saturation"] = {"low": self.saturation_low, "high": self.saturation_high}
        data["expanded_rows"] = self.expanded_rows
        data["has_copies"] = self.has_copies
        data["copy_is_identity"] = self.copy_is_identity
        data["bias_folded_into"] = self.bias_folded_into
        data["deterministic"] = self.path == "offset"
        return data

    def summary(self) -> str:
        """One line: what the generated kernels are specialised on."""
        return (
            f"{self.spec_name}: map={self.map_kind} terms={'+'.join(self.terms)} "
            f"{f'R=2N-1 (N={self.seq_len}: {self.rows})' if self.length_dependent else f'R={self.rows}'} "
            f"path={self.path} saturation=[{self.saturation_low}, {self.saturation_high}]"
            f"{' (N-dependent)' if self.length_dependent else ''} C={self.expanded_rows} "
            f"copies={'yes' if self.has_copies else 'no'} causal={self.causal} "
            f"shared_tables={self.heads_share_tables}"
            f"{' relations=in_tile' if self.relations == 'in_tile' else ''}"
            f"{' projections=by_row' if self.projections == 'by_row' else ''}"
            f"{self._local_window_summary()}"
        )

    def _local_window_summary(self) -> str:
        # absent without a window, so that the headers of modules generated before windows existed stay the same
        return f" local_window={local_window_text(self.local_left, self.local_right)}" if self.has_local_window else ""

    def __str__(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def local_window_text(left: int | None, right: int | None) -> str:
    """The offsets a local window admits, δ ∈ [−right, left], with "inf" for an unbounded side."""
    return f"[{-right if right is not None else '-inf'}, {left if left is not None else 'inf'}]"


def analyze(spec: MechanismSpec | dict | str, seq_len: int | None = None, head_dim: int = 64) -> Plan:
    """Analyze `spec` over the window δ ∈ [−(N−1), N−1] of N = `seq_len` tokens (only the offsets its local
    window admits, when it has one).

    Without `seq_len`, the canonical length is used: the shortest power of two from which the saturation
    bounds provably hold for every longer sequence (the plan code generation is specialised on).
    """
    n = _positive_int(seq_len, "seq_len", MAX_SEQ_LEN) if seq_len is not None else None
    _positive_int(head_dim, "head_dim")
    spec = load_spec(spec)
    if n is None:
        n = canonical_length(spec)
    try:
        deltas, rows = _window(spec, n)
    except ValueError as err:
        raise SpecError(f"field 'map': {err}") from None
    num_rows = spec.map.num_rows(n)

    spans, row_order = _row_spans(rows, deltas)
    contiguous = len(row_order) == sum(len(s.intervals) for s in spans)
    low, high = _saturation(rows, deltas, spec.causal)
    proven = _saturation_proven(spec, rows, deltas, low, high)
    copy_map = tuple(rows[low - deltas[0] : high - deltas[0] + 1].tolist())
    c = high - low + 1
    g = GROUP_SIZE
    window = min(c, n + g - 1)
    left = spec.window.left if spec.window is not None else None
    right = spec.window.right if spec.window is not None else None
    return Plan(
        spec_name=spec.name,
        spec_hash=spec.spec_hash(),
        seq_len=n,
        map_kind=spec.map.kind,
        terms=spec.terms,
        causal=spec.causal,
        heads_share_tables=spec.heads_share_tables,
        scale=str(spec.scale) if spec.scale is not None else DEFAULT_SCALE,
        rows=num_rows,
        length_dependent=spec.map.length_dependent,
        contiguous=contiguous,
        path="offset" if contiguous else "atomic",
        row_spans=spans,
        row_order=row_order,
        unreached_rows=tuple(np.setdiff1d(np.arange(num_rows), rows).tolist()),
        saturation_low=low,
        saturation_high=high,
        saturation_proven=proven,
        copy_map=copy_map,
        group_size=g,
        query_window=window,
        key_window=window,
        groups=-(-n // g),
        cost=_cost(spec, n, low, high, window, head_dim),
        local_left=left,
        local_right=right,
    )


def _positive_int(value: Any, name: str, most: int | None = None) -> int:
    """`value` as an int in [1, most], else a ValueError naming it."""
    try:
        n = operator.index(value)
    except TypeError:
        n = 0
    if isinstance(value, bool) or n < 1 or (most is not None and n > most):
        bound = f" of at most {most}" if most is not None else ""
        raise ValueError(f"{name} must be a positive integer{bound}, got {quoted(value)}")
    return n


@contextlib.contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """Build many small acyclic objects without the cyclic collector rescanning every live object meanwhile (it
    tripled the analysis of an identity map at MAX_SEQ_LEN, whose 2N − 1 row spans are 800,000 tuples)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_without_cyclic_gc()
def _row_spans(rows: np.ndarray, deltas: np.ndarray) -> tuple[tuple[RowSpan, ...], tuple[int, ...]]:
    """Group consecutive offsets by row: each maximal run of one row is an interval. Also the rows in the order
    of their first offset. (Vectorised but for one RowSpan per row: an identity map has 2N − 1 of them.)"""
    change = np.flatnonzero(np.diff(rows)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change - 1, [len(rows) - 1]])
    run_rows = rows[starts]
    order = np.argsort(run_rows, kind="stable")  # by row, and by offset within a row
    unique, first = np.unique(run_rows, return_index=True)
    row_order = tuple(unique[np.argsort(first)].tolist())
    sorted_rows = run_rows[order]
    bounds = np.flatnonzero(np.diff(sorted_rows)) + 1
    intervals = list(zip(deltas[starts][order].tolist(), deltas[ends][order].tolist(), strict=True))
    cuts = [0, *bounds.tolist(), len(intervals)]
    spans = tuple(
        RowSpan(row, tuple(intervals[a:b])) for row, a, b in zip(unique.tolist(), cuts[:-1], cuts[1:], strict=True)
    )
    return spans, row_order


def _saturation(rows: np.ndarray, deltas: np.ndarray, causal: bool) -> tuple[int, int]:
    """Tightest L, U with φ constant on δ ≤ L and on δ ≥ U within the window.

    Causal specs mask every key with δ < 0, so their bounds are those of the half window δ ∈ [0, N−1]: L ≥ 0
    (column 0 collects δ ≤ L, of which only 0 … L are ever read), and the bounds do not change once N exceeds
    them (clamping the full window's L to 0 instead would depend on N for maps with φ(0) = φ(1)).
    """
    if causal:
        rows, deltas = rows[deltas >= 0], deltas[deltas >= 0]
    change = np.flatnonzero(np.diff(rows))
    if change.size == 0:
        low = high = 0
    else:
        low = int(deltas[change[0]])  # last offset of the first run
        high = int(deltas[change[-1] + 1])  # first offset of the last run
    return low, high


def _saturation_proven(spec: MechanismSpec, rows: np.ndarray, deltas: np.ndarray, low: int, high: int) -> bool:
    """Do the bounds hold for every longer window too (so one compiled plan serves all lengths)?"""
    m = spec.map
    if isinstance(m, IdentityMap):
        return False
    left, right = spec.local_bounds
    # the farthest offsets any longer window scores (the local window's bounds, causal's 0, or ±_FAR); a side
    # that this window already reaches needs no proof
    lowest, highest = -(right if right is not None else _FAR), left if left is not None else _FAR
    lowest = None if lowest >= deltas[0] else lowest
    highest = None if highest <= deltas[-1] else highest
    if isinstance(m, ExpressionMap):
        return _prove_expression_saturation(m, low, high, int(rows[0]), int(rows[-1]), lowest, highest)
    # every other kind is monotone in δ on each side, so it is constant beyond once it reached its limit row
    below_ok = lowest is None or int(m.row_ids(np.array([lowest]), 2 * _FAR)[0]) == int(rows[0])
    return below_ok and (highest is None or int(m.row_ids(np.array([highest]), 2 * _FAR)[0]) == int(rows[-1]))


def _prove_expression_saturation(
    m: ExpressionMap, low: int, high: int, row_low: int, row_high: int, lowest: int | None, highest: int | None
) -> bool:
    """expr(δ) == row_high for every δ in [high, highest] and == row_low for every δ in [lowest, low] (None: a side
    needing no proof), by interval
    arithmetic over the expression's tree (`Expression.bounds`): sound, deterministic and linear in its size, where
    a symbolic proof (sympy's simplify) took minutes on small nested floors."""
    sign = -1 if m.offset == "key_minus_query" else 1  # the expression sees sign·δ

    def constant_over(first: int, last: int, row: int) -> bool:
        lo, hi = m.expression.bounds(min(sign * first, sign * last), max(sign * first, sign * last))
        return lo == hi == row

    above = highest is None or constant_over(high, highest, row_high)
    return above and (lowest is None or constant_over(lowest, low, row_low))


def canonical_length(spec: MechanismSpec) -> int:
    """The window code generation plans for: identity maps 128 (their bounds are runtime values); other maps the
    shortest power of two whose bounds lie inside the window and are proven for every longer window, or, for an
    expression map whose saturation is not proven, the shortest whose bounds agree with a 4× longer window (the runtime
    re-plans past it)."""
    if spec.map.length_dependent:
        return GROUP_SIZE
    n = 16
    while n <= MAX_CANONICAL_LENGTH:
        deltas, rows = _window(spec, n)
        low, high = _saturation(rows, deltas, spec.causal)
        if high < n - 1 and low > -(n - 1):
            if _saturation_proven(spec, rows, deltas, low, high):
                return n
            if isinstance(spec.map, ExpressionMap):
                longer_deltas, longer_rows = _window(spec, 4 * n)
                if _saturation(longer_rows, longer_deltas, spec.causal) == (low, high):
                    return n
        n *= 2
    return MAX_CANONICAL_LENGTH


def _window(spec: MechanismSpec, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The offsets δ ∈ [−(N−1), N−1] that N tokens may score, clipped to the spec's local window (causal keeps
    δ < 0, which _saturation drops), and their rows."""
    left, right = (spec.window.left, spec.window.right) if spec.window is not None else (None, None)
    deltas = np.arange(-(n - 1 if right is None else min(right, n - 1)), (n if left is None else min(left, n - 1) + 1))
    return deltas, np.asarray(spec.map.row_ids(deltas, n), dtype=np.int64)


def _cost(spec: MechanismSpec, n: int, low: int, high: int, window: int, head_dim: int) -> dict[str, float]:
    """Per batch·head at this N: projection FLOPs, stored-projection bytes (fp16), band fraction of tiles."""
    tables = int(spec.has_query) + int(spec.has_key)
    tile_m, tile_n = GROUP_SIZE, 64
    i0 = np.arange(0, n, tile_m)[:, None]
    j0 = np.arange(0, n, tile_n)[None, :]
    dmin = i0 - (j0 + tile_n - 1)
    dmax = i0 + tile_m - 1 - j0
    live = dmax >= 0 if spec.causal else np.ones_like(dmax, dtype=bool)
    left, right = spec.local_bounds
    if left is not None:  # tiles wholly outside the local window are skipped
        live &= dmin <= left
    if right is not None:
        live &= dmax >= -right
    band = live & (dmin < high) & (dmax > low)
    return {
        "head_dim": head_dim,
        "projection_flops": float(2 * n * window * head_dim * tables),
        "projection_bytes": float(2 * n * window * tables),
        "score_tiles": float(live.sum()),
        "band_tile_fraction": float(band.sum() / max(live.sum(), 1)),
    }
