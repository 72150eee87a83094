"""Stage 5, the runtime: what runs a generated module. `mechanism` keeps the cache of compiled mechanisms and the
callable `compile_mechanism` returns; `arguments` checks a call's arguments before any kernel; `geometry` derives a
call's shapes, buffers and grids; `launch` keeps launched kernels; `descriptors` builds TMA descriptors; `custom_ops`
registers torch custom ops so calls trace under torch.compile; `dropout` is the keep mask's Philox stream; `storage`
the stored projections' precision; `surface` is the one module generated code imports.

Importing this package is light: the runtime (and triton) load on first use of `compile_mechanism`."""

import importlib
from typing import Any

__all__ = ["Mechanism", "compile_mechanism"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from relgen.runtime import mechanism

        return getattr(mechanism, name)
    if name.isidentifier() and not name.startswith("_"):
        try:  # relgen.runtime.<module> as an attribute, as after an import of it
            return importlib.import_module(f"relgen.runtime.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"relgen.runtime.{name}":
                raise
    raise AttributeError(f"module 'relgen.runtime' has no attribute {name!r}")
