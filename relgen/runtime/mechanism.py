"""Runtime: the cache of compiled mechanisms and the callable `compile_mechanism` returns.

`compile_mechanism(spec)` renders the spec's module (codegen), writes it into the cache directory (Triton needs
real source files) and imports it; calls then go through `Mechanism.__call__`, which picks the module planned
for a long enough window (maps whose saturation could not be proven beyond the analysed window are re-planned
for the offsets a call reaches, up to MAX_REPLANNED_WINDOW). Generated modules reach argument checking, geometry
and tile configuration through the names this module re-exports.

Compiling and calling are safe from several threads: one Mechanism per spec, one import per module (temporary
files unique per writer, replaced atomically, so processes sharing a cache directory do not collide either).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from relgen.backend import configure_triton
from relgen.plan.analyze import Plan, analyze
from relgen.runtime.arguments import prepare_call, reach
from relgen.runtime.geometry import Geometry
from relgen.runtime.memory import (
    auto_strategy,
    check_layers,
    check_strategy,
    in_tile_refusal,
    projection_budget,
    projection_memory,
    resolve_strategy,
)
from relgen.runtime.storage import projection_storage
from relgen.spec.limits import MAX_SEQ_LEN
from relgen.spec.model import MechanismSpec, load_spec
from relgen.tiles.select import overridden

# before any of relgen's kernels is defined (the generated modules import the runtime first, relgen.runtime.dropout
# after it): Triton's interpreter when there is no CUDA device
configure_triton()

__all__ = ["ABLATIONS", "MAX_REPLANNED_WINDOW", "Mechanism", "cache_dir", "compile_mechanism", "load_module"]

#: The paper's Table 7 switches that `fn(..., ablation=name)` accepts (relgen bench --ablation).
ABLATIONS = (
    "atomic_gradients",
    "no_projections",
    "no_reachable_ranges",
    "no_constant_range_reuse",
    "no_bucket_copies",
    "recompute_projections",
)


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


#: kinds of call whose "auto" choice a Mechanism keeps (all forgotten when full)
KEPT_CHOICES = 256
#: the call options that Mechanism.geometry leaves out: the generated `attention`'s own, and dropout's
_UNCHECKED_OPTIONS = ("recompute_projections", "return_lse", "dropout_p", "dropout_seed")


def _differentiated(tensors: tuple) -> bool:
    """Whether autograd will differentiate a call of these arguments (one of them requires grad)."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


#: The longest window a map whose saturation could not be proven is re-planned for (1 + the largest |δ| a call
#: reaches): the analyzer's own limit. A call that reaches farther is refused (ValueError) rather than analysed.
MAX_REPLANNED_WINDOW = MAX_SEQ_LEN

_MODULES: dict[str, ModuleType] = {}
#: held while a module is written and imported (and while _MODULES, _SPECS and _WIDER change): an import runs
#: the module's code, which defines its custom ops, once
_MODULES_LOCK = threading.RLock()


def load_module(plan: Plan) -> ModuleType:
    """Render, write and import the module of `plan` (cached by the source's hash)."""
    from relgen.codegen import generator as codegen

    source = codegen.render(plan)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    module = _MODULES.get(digest)
    if module is not None:
        return module
    with _MODULES_LOCK:
        if digest in _MODULES:  # imported by another thread meanwhile
            return _MODULES[digest]
        module_name = f"relgen_generated_{plan.spec_name}_{digest}"
        path = cache_dir() / f"{module_name}.py"
        if not path.exists() or path.read_text() != source:
            _write_atomically(path, source)
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        _MODULES[digest] = module
        return module


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file of its own in the same directory, then os.replace: a reader
    (another thread or process importing the module) sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Mechanism:
    """The callable `compile_mechanism` returns: `fn(q, k, v, aq=None, ak=None, bias=None, **options)`."""

    def __init__(self, spec: MechanismSpec):
        self.spec = spec
        self.plan = analyze(spec)
        self.module = load_module(self.plan)
        with _MODULES_LOCK:
            _SPECS[self.plan.spec_hash] = spec
        self._variants: dict[tuple, ModuleType] = {}
        self._variants_lock = threading.Lock()
        #: "auto"'s choice ("stored" or "tiled") per kind of call (Mechanism._auto)
        self._choices: dict[tuple, str] = {}
        #: whether the spec has a projection to store or to form in the tiles (a query or key term)
        self._projects = self.plan.has_query or self.plan.has_key
        #: in_tile_refusal's answer, traced by torch.compile or not: both formed here, since a dict that a traced call
        #: fills in is one that Dynamo guards on, and the next call would be traced again
        self._refusals = {compiling: in_tile_refusal(self.plan, compiling=compiling) for compiling in (False, True)}

    def offset_rows(self, delta: torch.Tensor) -> torch.Tensor:
        """φ(δ), the table row of each offset in `delta` (an integer tensor), on its device, as the kernels read it;
        for maps whose rows do not depend on the length (NotImplementedError otherwise). For a caller that forms a
        few bias rows itself (a decode step's)."""
        return self.module.PLAN.offset_rows(delta)

    def module_for(self, window: int) -> ModuleType:
        """The module planned for `window` (1 + the largest |δ| a call reaches): this spec's own, unless its map's
        saturation is unproven beyond a shorter window."""
        limit = self.module.PLAN.valid_up_to
        if limit is None or window <= limit:
            return self.module
        if window > MAX_REPLANNED_WINDOW:
            raise ValueError(
                f"q_offset, k_offset: the map of spec '{self.plan.spec_name}' is not proven constant beyond |δ| < "
                f"{limit}, and this call's query-key pairs reach |δ| = {window - 1} (from its sequence lengths and "
                f"q_offset − k_offset, or max_seqlen); relgen re-plans such a map for at most "
                f"relgen.runtime.mechanism.MAX_REPLANNED_WINDOW = {MAX_REPLANNED_WINDOW} offsets (a map whose "
                "saturation the analyzer proves needs no re-planning)"
            )
        return _WIDER[_load_wider(self.plan.spec_hash, 1 << (int(window) - 1).bit_length())]

    def __call__(
        self, q, k, v, aq=None, ak=None, bias=None, *, ablation: str | None = None, projections: str = "auto",
        layers: int = 1, **options: Any,
    ):  # fmt: skip
        """`projections`: how the relation products are formed (relgen.runtime.memory): "stored" (Z̃, the fastest),
        "tiled" (inside the tiles, linear memory; NotImplementedError for a call the in-tile variant does not
        serve; for a spec with no query or key term, the same kernels as "stored") or "auto" (stored while its
        memory fits relgen.config.projection_budget(), else tiled where served). `layers`: how many calls like
        this one keep their stored projections at once when differentiated (a model's attention layers in
        training, each until its backward), which "auto" budgets for together. With an ablation, "auto" is
        "stored": the switches are measured against the stored path."""
        module = self._planned(q, k, v, options)
        strategy, layers = check_strategy(projections), check_layers(layers)
        if ablation is not None:
            if strategy == "tiled" and ablation != "no_projections":
                raise NotImplementedError(
                    f"projections='tiled' with ablation {ablation!r}: the ablations switch off parts of the stored "
                    "strategy (use projections='stored' or 'auto')"
                )
            module, options = self._ablated(module, ablation, options)
        else:
            module, recompute = self._resolved(module, strategy, q, k, v, aq, ak, bias, options, layers)
            if recompute:
                options = {**options, "recompute_projections": True}
        return module.attention(q, k, v, aq, ak, bias, **options)

    def strategy(
        self, q, k, v, aq=None, ak=None, bias=None, *, projections: str = "auto", layers: int = 1, **options: Any
    ) -> str:
        """The strategy, "stored" or "tiled", that `self(q, k, v, aq, ak, bias, projections=..., layers=...,
        **options)` runs (without running it)."""
        module = self._planned(q, k, v, options)
        strategy, layers = check_strategy(projections), check_layers(layers)
        module, _ = self._resolved(module, strategy, q, k, v, aq, ak, bias, options, layers)
        return "tiled" if module.PLAN.relations == "in_tile" else "stored"

    def _planned(self, q, k, v, options: dict[str, Any]) -> ModuleType:
        """The module planned for the offsets the call reaches, after checking the flags `attention` takes."""
        module = self.module
        if module.PLAN.valid_up_to is not None:  # an unproven map: the module for the offsets this call reaches
            module = self.module_for(reach(module.PLAN, q, k, v, options))
        for name in ("recompute_projections", "return_lse"):
            flag = options.get(name, False)
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected a bool, got {type(flag).__name__}")
        return module

    def strategy_module(self, module: ModuleType, strategy: str, q, k, v, aq, ak, bias, options) -> ModuleType:
        """`module`, or its in-tile variant (built once) where `strategy` ("auto", "stored" or "tiled") has the
        call form its relation products inside the tiles."""
        return self._resolved(module, strategy, q, k, v, aq, ak, bias, options)[0]

    def _resolved(
        self, module: ModuleType, strategy: str, q, k, v, aq, ak, bias, options, layers: int = 1
    ) -> tuple[ModuleType, bool]:
        """strategy_module's module, and whether "auto" has the call recompute its stored projections in the
        backward instead of keeping them (`layers`: as the call's)."""
        if strategy == "stored" or not self._projects:
            return module, False
        refusal = self._refusals[torch.compiler.is_compiling()]
        chosen = resolve_strategy(
            strategy, self._projects, refusal, lambda: self._auto(module, q, k, v, aq, ak, bias, options, layers)
        )
        if chosen == "tiled":
            return self._variant(module, relations="in_tile"), False
        return module, chosen == "recompute"

    def _auto(self, module: ModuleType, q, k, v, aq, ak, bias, options: dict[str, Any], layers: int = 1) -> str:
        """The choice of "auto" for a call the in-tile variant serves (relgen.runtime.memory.auto_strategy):
        "tiled" where its stored projections' memory (projection_memory, at the backward's peak when autograd will
        differentiate the call, with `layers` calls' kept forwards) exceeds the budget, "recompute" where only
        the layers' kept projections do. Decided once per kind of call (shapes, dtype, device, offsets, layout,
        layers), from the geometry the call's own checks derive."""
        if not isinstance(q, torch.Tensor):
            return "stored"  # the call's own checks name the problem
        backward = torch.is_grad_enabled() and _differentiated((q, k, v, aq, ak, bias))
        layers = layers if backward else 1
        recompute = options.get("recompute_projections", False)
        device = q.device
        budget = projection_budget(device, layers)
        key = (
            module.PLAN.valid_up_to, q.shape, k.shape, q.dtype, device, options.get("layout"),
            options.get("q_offset", 0), options.get("k_offset", 0), backward, budget, projection_storage(), layers,
            recompute,
        )  # fmt: skip
        try:
            choice = None if overridden() else self._choices.get(key)
        except TypeError:  # an unhashable option (a bad one: the call's checks name it)
            choice = key = None
        if choice is None:
            geo = self.geometry(module, q, k, v, aq, ak, bias, options)
            choice = auto_strategy(projection_memory(geo), budget, backward, geo, layers, recompute)
            if key is not None and not overridden():  # a forced tile configuration may change G: not kept
                with self._variants_lock:
                    if len(self._choices) >= KEPT_CHOICES:
                        self._choices.clear()
                    self._choices[key] = choice
        return choice

    @staticmethod
    def geometry(module: ModuleType, q, k, v, aq, ak, bias, options: dict[str, Any]) -> Geometry:
        """The Geometry of a call of `module` (its arguments checked as the call checks them; dropout, which
        sizes no buffer, left out so that no seed is drawn)."""
        checked = {name: value for name, value in options.items() if name not in _UNCHECKED_OPTIONS}
        return prepare_call(module.PLAN, q, k, v, aq, ak, bias, **checked).geo

    def _ablated(self, module: ModuleType, ablation: str, options: dict[str, Any]):
        """One component of the method switched off (the paper's Table 7), for `relgen bench --ablation`."""
        if ablation not in ABLATIONS:
            raise ValueError(f"ablation: expected one of {ABLATIONS}, got {ablation!r}")
        if ablation == "recompute_projections":
            return module, {**options, "recompute_projections": True}
        if ablation == "atomic_gradients":  # the fallback's per-pair atomic adds on a map that does not need them
            return self._variant(module, path="atomic"), options
        if ablation == "no_projections":  # relation products formed in every band tile instead of stored
            why = in_tile_refusal(self.plan, compiling=False)
            if why:
                raise NotImplementedError(f"ablation no_projections: {why}")
            return self._variant(module, relations="in_tile"), options
        if ablation == "no_bucket_copies":  # projections per table row, read through β by every score
            plan, why = self.plan, None
            if not plan.has_copies:
                why = "has no bucket copies (β is one-to-one)"
            elif plan.path != "offset":
                why = "runs the atomic path"
            if why:
                raise NotImplementedError(f"ablation no_bucket_copies: {plan.spec_name} {why}")
            return self._variant(module, projections="by_row"), options
        return module, {**options, "_ablation": ablation}

    def _variant(self, module: ModuleType, **changes: Any) -> ModuleType:
        """The module of `module`'s plan with `changes` (an ablation), built once."""
        key = (module.PLAN.valid_up_to, *sorted(changes.items()))
        with self._variants_lock:
            if key not in self._variants:
                plan = analyze(self.spec, module.PLAN.valid_up_to) if module.PLAN.valid_up_to else self.plan
                self._variants[key] = load_module(replace(plan, **changes))
            return self._variants[key]

    def __repr__(self) -> str:
        return f"<relgen mechanism {self.plan.summary()}>"


#: the spec of each Mechanism, by spec hash (what _load_wider can be given: Dynamo passes only constants)
_SPECS: dict[str, MechanismSpec] = {}
#: modules planned for longer windows than their spec's analysis proved, by (spec hash, window)
_WIDER: dict[tuple[str, int], ModuleType] = {}


@torch.compiler.assume_constant_result
def _load_wider(spec_hash: str, n: int) -> tuple[str, int]:
    """Load (once) the module of a spec planned for windows up to n; returns its key in _WIDER. Under torch.compile
    this runs while tracing, as a constant (rendering and importing a module cannot be traced)."""
    key = (spec_hash, n)
    if key not in _WIDER:
        with _MODULES_LOCK:
            if key not in _WIDER:
                _WIDER[key] = load_module(analyze(_SPECS[spec_hash], n))
    return key


_MECHANISMS: dict[str, Mechanism] = {}
#: one lock per spec hash while its Mechanism is built (different specs compile side by side)
_COMPILING: dict[str, threading.Lock] = {}
_COMPILING_LOCK = threading.Lock()


def compile_mechanism(spec: MechanismSpec | dict | str | Path) -> Mechanism:
    """Compile (or fetch from the cache, keyed by the spec's hash) the kernels of `spec`. Threads compiling one
    spec at once get the same Mechanism."""
    spec = load_spec(spec)
    key = spec.spec_hash()
    mechanism = _MECHANISMS.get(key)
    if mechanism is not None:
        return mechanism
    with _COMPILING_LOCK:
        lock = _COMPILING.setdefault(key, threading.Lock())
    with lock:
        if key not in _MECHANISMS:
            _MECHANISMS[key] = Mechanism(spec)
        return _MECHANISMS[key]
