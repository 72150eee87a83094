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
from relgen.runtime.arguments import (
    reach,
)
from relgen.spec.limits import MAX_SEQ_LEN
from relgen.spec.model import MechanismSpec, load_spec

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

    def __call__(self, q, k, v, aq=None, ak=None, bias=None, *, ablation: str | None = None, **options: Any):
        module = self.module
        if module.PLAN.valid_up_to is not None:  # an unproven map: the module for the offsets this call reaches
            module = self.module_for(reach(module.PLAN, q, k, v, options))
        for name in ("recompute_projections", "return_lse"):
            flag = options.get(name, False)
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected a bool, got {type(flag).__name__}")
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
            return self._variant(module, path="atomic"), options
        if ablation == "no_projections":  # relation products formed in every band tile instead of stored
            plan, why = self.plan, None
            if not (plan.has_query or plan.has_key):
                why = "has no projection to switch off (bias only)"
            elif plan.has_bias:
                why = "folds its bias into a projection"
            elif plan.path != "offset":
                why = "runs the atomic path"
            if why:
                raise NotImplementedError(
                    f"ablation no_projections: {plan.spec_name} {why}; in-tile relation products cover query and "
                    "key terms without a bias, on the offset path"
                )
            if any(options.get(name) is not None for name in ("cu_seqlens", "cu_seqlens_q", "cu_seqlens_k")):
                raise NotImplementedError("ablation no_projections: packed sequences (cu_seqlens) are not supported")
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
