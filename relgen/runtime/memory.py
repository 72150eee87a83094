"""How a call gets its relation products q_i·ã_s, k_j·ã_s: stored (the projections Z̃, written once per call and
gathered by every band tile) or formed inside the tiles from Ã (the plan's `relations="in_tile"` variant), the
memory each needs, and which one a call's `projections=` option runs.

    projections="stored"   Z̃^Q, Z̃^K [token rows, W]: fast, but an identity map's W grows with N (N × (N + G − 1)
                           entries per head, and a dZ̃ buffer of that size in the backward)
    projections="tiled"    nothing N × W: each band tile forms its products from Ã; linear memory
    projections="auto"     stored when its memory fits the budget (projection_budget), else tiled where the
                           in-tile variant serves the call (in_tile_refusal), else stored; a differentiated call
                           standing for several layers (layers=) is stored without keeping its projections
                           (recompute_projections) where only one layer's fit

A spec without a query or key term (bias only) stores no projection: there "tiled" runs the same kernels as
"stored". A call the in-tile variant does not serve is stored under "auto" whatever the budget: where its buffers
exceed the device, torch's allocator fails naming the size (recompute_projections=True does not lower the
backward's peak; a spec the in-tile kernels serve, or shorter chunks through relgen.distributed, do). The choice
is made on the host from the call's shapes (a Geometry), once per kind of call: no device synchronisation.
docs/algorithm.md section 10 states the memory model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

import torch

from relgen.runtime.geometry import Geometry, PlanInfo
from relgen.runtime.storage import projection_storage
from relgen.tiles.select import select_config

#: the values of a call's `projections=` option
PROJECTION_STRATEGIES = ("auto", "stored", "tiled")
#: the environment variable that sets the budget at start-up: bytes, or a number with a binary unit ("20GiB")
PROJECTION_BUDGET_ENV = "RELGEN_PROJECTION_BUDGET"
#: the budget's share of a CUDA device's total memory. A call's stored projections sit beside the model's weights,
#: its optimizer state and every other layer's activations (in training each layer keeps its Z̃ until its
#: backward): a quarter of the device for one call's, the rest for those. The total, not the free memory: the same
#: call then runs the same kernels at every step (a choice that followed the allocator's state could change between
#: steps), and reading it costs no driver call per call.
DEVICE_SHARE = 4
#: the budget's share of the device for a call standing for several layers (the call option `layers`: a model's
#: attention layers in training, each keeping its stored projections until its backward): their sum may take half
#: the device, the other half holding the weights, optimizer state and the rest of the activations. (NeMo's
#: Parakeet encoder, 24 layers, bf16, H200: at 15 minutes of audio the layers' stored projections take about
#: 46 GiB of an 84 GiB peak, within this share; at 20 minutes about 80 GiB, beyond it.)
TRAINING_SHARE = 2
#: the budget without a CUDA device (Triton's interpreter on the CPU runs test-sized calls only): a fixed 1 GiB,
#: so that the choice does not depend on the host
CPU_BUDGET = 1 << 30
_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_BUDGET_TEXT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]iB)?\s*", re.ASCII)
#: fp32 bytes: the in-tile variant's end columns are formed in fp32 (no storage scale)
_FP32 = 4


def check_strategy(projections: Any) -> str:
    """A call's `projections=` option: one of PROJECTION_STRATEGIES, else a ValueError naming it."""
    if not isinstance(projections, str) or projections not in PROJECTION_STRATEGIES:
        shown = repr(projections) if isinstance(projections, str | None) else type(projections).__name__
        raise ValueError(f"projections: expected one of {PROJECTION_STRATEGIES}, got {shown[:80]}")
    return projections


def check_layers(layers: Any) -> int:
    """A call's `layers=` option (calls keeping their stored projections at once): a positive int, else a
    ValueError naming it."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        shown = layers if isinstance(layers, int) else type(layers).__name__
        raise ValueError(f"layers: expected a positive int (calls keeping their projections at once), got {shown}")
    return layers


# ------------------------------------------------------------------------------------------------------------
# which calls the in-tile variant serves
# ------------------------------------------------------------------------------------------------------------
def in_tile_refusal(plan: Any, *, compiling: bool) -> str | None:
    """Why the in-tile variant of `plan` (a Plan or PlanInfo) cannot serve a call, or None when it can.
    `compiling`: traced by torch.compile. The variant serves every term (a bias read per pair, not folded into a
    projection), every head dim the stored path serves, masks, windows, offsets, dropout, grouped heads, packed
    sequences and both layouts. The one statement of the variant's coverage: `projections="tiled"`, "auto" and the
    ablation no_projections all read it."""
    name, terms = plan.spec_name, plan.terms
    if "query" not in terms and "key" not in terms:
        return f"{name} has no projection to switch off (bias only)"
    if plan.path != "offset":
        return f"{name} runs the atomic path; in-tile relation products serve the offset path"
    if compiling:
        return "not supported under torch.compile (eager only)"
    return None


# ------------------------------------------------------------------------------------------------------------
# the memory of each strategy
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProjectionMemory:
    """Bytes each strategy needs beyond what both need (q, k, v, O, the LSE, Ã and b̃, dO, the gradients), at the
    forward's peak and at the backward's (the forward's kept buffers and the backward's own)."""

    stored_forward: int
    stored_backward: int
    tiled_forward: int
    tiled_backward: int

    def of(self, strategy: str, backward: bool) -> int:
        if strategy == "stored":
            return self.stored_backward if backward else self.stored_forward
        return self.tiled_backward if backward else self.tiled_forward


def projection_memory(geo: Geometry) -> ProjectionMemory:
    """The memory of each strategy for a call of geometry `geo` (a stored plan's), from the functions that size the
    buffers. Per stored side (query term: Z̃^Q, key term: Z̃^K), with T the side's token rows (Geometry.token_rows)
    and ⌈W⌉₈ its window rounded up to ROW_ALIGN (Geometry.row_stride of projection_columns' width):

        stored forward   Σ_side T·(⌈W⌉₈ + 2)·|z|      Z̃ and its two end columns, |z| = Z̃'s element size
        stored backward  the forward's + max_side T·⌈W⌉₈·|dz|   the dZ̃ buffer (Geometry.gradient_elements)
        tiled            Σ_side T·2·4               the end columns, formed in fp32 (no Z̃, no dZ̃)

    Not counted: the table gradients both strategies form in fp32 (the stored path's reduction as partial sums
    per chunk of tokens, the in-tile offset-parallel pass as one [H, C, d] buffer), and the in-tile passes' end sums
    are the T·2·4 bytes above. A spec without a query or key term
    stores no Z̃ (its stored forward is 0; its backward's dZ̃ carries the bias gradient) and has no in-tile
    variant: its "tiled" figures are its stored ones."""
    sides = [side for side, term in ((True, "query"), (False, "key")) if term in geo.plan.terms]
    if not sides:
        forward, backward = 0, geo.gradient_elements() * geo.dz_dtype.itemsize
        return ProjectionMemory(forward, backward, forward, backward)
    z_size = geo.z_dtype.itemsize
    stored = sum(
        geo.token_rows(side) * (geo.row_stride(geo.projection_columns(side)[1]) + 2) * z_size for side in sides
    )
    gradient = geo.gradient_elements() * geo.dz_dtype.itemsize
    tiled = sum(geo.token_rows(side) * 2 * _FP32 for side in sides)
    return ProjectionMemory(stored, stored + gradient, tiled, tiled)


def tiled_measured_faster(geo: Geometry) -> bool:
    """Whether measurements say the in-tile products beat stored ones for this call where both fit the budget: the
    hook for a tuned entry per (kernel family, dtype, d, length bucket). None is recorded yet, and on the H200 the
    stored products were the faster at every measured length (TXL at 8K: forward 3.7×, backward 4.5×; at 32K 3.3×
    and 4.4×; docs/performance.md section 18), so: never."""
    return False


def auto_strategy(
    memory: ProjectionMemory, budget: int, backward: bool, geo: Geometry, layers: int = 1, recompute: bool = False
) -> str:
    """The choice of "auto" for a call the in-tile variant serves: "stored" while its memory (the backward's peak
    when the call will be differentiated) fits `budget` and no measurement says otherwise, else "tiled". `layers`:
    how many calls like it keep their forward's buffers at once when differentiated (a model's layers in training,
    each until its backward): their sum, with one backward's buffers on top, must fit; where only one call's
    backward does, "recompute" (stored, the forward keeping nothing: recompute_projections=True, which costs one
    projection more per backward, where the in-tile products cost ~2× the step). `recompute` (the call's own
    recompute_projections=True): a forward keeps none, so one call's peak is all that counts."""
    if tiled_measured_faster(geo):
        return "tiled"
    alone = memory.of("stored", backward)
    kept = (layers - 1) * memory.stored_forward if backward and not recompute else 0
    if alone + kept <= budget:
        return "stored"
    if kept and alone <= budget:
        return "recompute"
    return "tiled"


def resolve_strategy(strategy: str, projects: bool, refusal: str | None, auto: Callable[[], str]) -> str:
    """The strategy a call runs, "stored" or "tiled" (or auto's "recompute"), for its `projections=` option
    `strategy`: `projects`, whether the spec has a query or key term (without one "tiled" is "stored": nothing is
    stored); `refusal`, in_tile_refusal's for the call ("tiled" then raises NotImplementedError naming it, "auto"
    stores); `auto`, the choice of "auto" where the in-tile variant serves the call (auto_strategy), asked only
    then."""
    if strategy == "stored" or not projects:
        return "stored"
    if refusal:
        if strategy == "tiled":
            raise NotImplementedError(f"projections='tiled': {refusal}")
        return "stored"
    return "tiled" if strategy == "tiled" else auto()


def dense_geometry(
    plan: PlanInfo, *, batch: int, heads: int, nq: int, nk: int, head_dim: int, dtype: torch.dtype, group: int
) -> Geometry:
    """The Geometry of a dense call without offsets, mask or dropout, as prepare_call derives it from such a call's
    tensors, for sizing its buffers without them (relgen explain), with the kernels' group size G = `group`."""
    length = max(nq, nk)
    config = select_config(plan, dtype, head_dim, length)
    return Geometry.make(
        plan, batch=batch, heads=heads, nq=nq, nk=nk, head_dim=head_dim, length=length, doff=0, dtype=dtype,
        scale=1.0, dropout_p=0.0, seed=0, config=replace(config, group=group) if config.group != group else config,
        fp16_storage=projection_storage() == "fp16",
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# the budget
# ------------------------------------------------------------------------------------------------------------
#: [] until read; then [the explicit budget (set_projection_budget's, else $RELGEN_PROJECTION_BUDGET's) or None]
_explicit: list[int | None] = []
_device_totals: dict[Any, int] = {}  # a CUDA device's total memory (0: no CUDA device), by the device as given


def parse_budget(value: Any, name: str) -> int:
    """A budget in bytes: a non-negative int, or text holding one or a number with a binary unit (KiB, MiB, GiB,
    TiB: "20GiB", "1.5 TiB", rounded down to whole bytes). Anything else is a ValueError naming `name`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{name}: expected a non-negative number of bytes, got {value}")
        return value
    match = _BUDGET_TEXT.fullmatch(value) if isinstance(value, str) else None
    if match is None or ("." in match[1] and not match[2]):  # a fraction of a byte is no size
        shown = repr(value[:40]) if isinstance(value, str) else type(value).__name__
        raise ValueError(
            f"{name}: expected a number of bytes, or a number with a unit KiB, MiB, GiB or TiB (e.g. 20GiB), got "
            f"{shown}"
        )
    return int(Decimal(match[1]) * _UNITS[match[2] or ""])


def set_projection_budget(budget: int | str | None) -> None:
    """The memory in bytes (or text such as "20GiB") that a call's stored projections may take before "auto"
    forms them inside the tiles, for every later call in this process; None: back to $RELGEN_PROJECTION_BUDGET,
    else the device's default (projection_budget)."""
    _explicit[:] = [parse_budget(budget, "budget")] if budget is not None else []


def budget_origin(device: torch.device | str | None = None) -> str:
    """Where projection_budget(device) comes from, in words (relgen explain)."""
    projection_budget(device)  # reads the environment once
    if _explicit and _explicit[0] is not None:
        return f"set_projection_budget or ${PROJECTION_BUDGET_ENV}"
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return "the default without a CUDA device"
    return f"1/{DEVICE_SHARE} of {torch.cuda.get_device_name(device)}'s memory"


def projection_budget(device: torch.device | str | None = None, layers: int = 1) -> int:
    """The budget calls on `device` use now: set_projection_budget's, else $RELGEN_PROJECTION_BUDGET (read once),
    else 1/DEVICE_SHARE of a CUDA device's total memory (1/TRAINING_SHARE for a call standing for `layers` > 1;
    CPU_BUDGET without a CUDA device). Read on every call that "auto" decides: the device's share is kept per
    device."""
    if not _explicit:
        text = os.environ.get(PROJECTION_BUDGET_ENV)
        _explicit[:] = [parse_budget(text, PROJECTION_BUDGET_ENV) if text else None]
    explicit = _explicit[0] if _explicit else None  # (another thread may have cleared it meanwhile)
    if explicit is not None:
        return explicit
    total = _device_totals.get(device)
    if total is None:
        where = torch.device(device) if device is not None else None
        if where is None or where.type != "cuda":
            total = 0
        else:
            index = where.index if where.index is not None else torch.cuda.current_device()
            total = torch.cuda.get_device_properties(index).total_memory
        if where is None or where.type != "cuda" or where.index is not None:  # "cuda" alone follows the current one
            _device_totals[device] = total
    if not total:
        return CPU_BUDGET
    return total // (TRAINING_SHARE if layers > 1 else DEVICE_SHARE)
