"""relgen — a compiler for relative-position attention.

    spec (relgen.spec) → plan (relgen.plan) → codegen (relgen.codegen, templates/) → tiles (relgen.tiles)
      → runtime (relgen.runtime) → this API, the CLI (relgen.cli), relgen.integrations, relgen.distributed

Public API: `load_spec`, `MechanismSpec`, `SpecError`, `analyze`, `Plan`, `compile_mechanism`, and the modules
`reference` (the FP64 oracle), `testing` (the exactness criterion, the dropout mask) and `config` (settings).
Names load on first use, so `import relgen` stays light and each stage imports without the later ones.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_NAMES = {
    "MechanismSpec": "relgen.spec.model",
    "SpecError": "relgen.spec.model",
    "load_spec": "relgen.spec.model",
    "Plan": "relgen.plan.analyze",
    "analyze": "relgen.plan.analyze",
    "compile_mechanism": "relgen.runtime.mechanism",
}
_MODULES = ("reference", "testing", "config", "codegen", "runtime", "integrations", "distributed")

__all__ = ["MechanismSpec", "Plan", "SpecError", "analyze", "compile_mechanism", "load_spec"]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"relgen.{name}")
    raise AttributeError(f"module 'relgen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES, *_MODULES])
