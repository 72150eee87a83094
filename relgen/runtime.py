"""Runtime: the cache of compiled mechanisms and the callable `compile_mechanism` returns.

`compile_mechanism(spec)` renders the spec's module (codegen), writes it into the cache directory (Triton needs
real source files) and imports it; calls then go through `Mechanism.__call__`, which picks the module planned
for a long enough window (maps whose saturation sympy could not prove beyond the analysed window are re-planned
for longer sequences). Generated modules reach argument checking, geometry and tile configuration through the
names this module re-exports.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from relgen.analyze import Plan, analyze
from relgen.arguments import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, Call, finish, prepare_call, seed_snapshot
from relgen.config import (
    INTERPRETER_CONFIG,
    AttnTiles,
    KernelConfig,
    ProjectTiles,
    ReduceTiles,
    cdiv,
    column_splits,
    default_config,
    interpreting,
    override_config,
    select_config,
    table_chunks,
)
from relgen.custom_ops import Passes
from relgen.custom_ops import register as register_custom_ops
from relgen.descriptors import kv_descriptors
from relgen.geometry import ROW_ALIGN, Geometry, PlanInfo
from relgen.launch import Launcher
from relgen.spec import MechanismSpec, load_spec

__all__ = [
    "ABLATIONS",
    "INTERPRETER_CONFIG",
    "ROW_ALIGN",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "AttnTiles",
    "Call",
    "Geometry",
    "KernelConfig",
    "Launcher",
    "Mechanism",
    "Passes",
    "PlanInfo",
    "ProjectTiles",
    "ReduceTiles",
    "cdiv",
    "column_splits",
    "compile_mechanism",
    "default_config",
    "finish",
    "interpreting",
    "kv_descriptors",
    "load_module",
    "override_config",
    "prepare_call",
    "register_custom_ops",
    "seed_snapshot",
    "select_config",
    "table_chunks",
]

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
        _SPECS[self.plan.spec_hash] = spec
        self._variants: dict[tuple, ModuleType] = {}

    def module_for(self, window: int) -> ModuleType:
        limit = self.module.PLAN.valid_up_to
        if limit is None or window <= limit:
            return self.module
        return _WIDER[_load_wider(self.plan.spec_hash, 1 << (int(window) - 1).bit_length())]

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
            if options.get("cu_seqlens") is not None:
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
        _WIDER[key] = load_module(analyze(_SPECS[spec_hash], n))
    return key


_MECHANISMS: dict[str, Mechanism] = {}


def compile_mechanism(spec: MechanismSpec | dict | str | Path) -> Mechanism:
    """Compile (or fetch from the cache, keyed by the spec's hash) the kernels of `spec`."""
    spec = load_spec(spec)
    key = spec.spec_hash()
    if key not in _MECHANISMS:
        _MECHANISMS[key] = Mechanism(spec)
    return _MECHANISMS[key]
