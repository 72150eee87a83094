"""The storage of the stored projections Z̃ and their gradients dZ̃ for half-precision inputs: one process-wide
choice, read when a call is checked (relgen.runtime.arguments)."""

from __future__ import annotations

import os

#: "fp16" (the default): Z̃ (and dZ̃ for fp16 inputs on the offset path) in fp16, half the buffers' memory and
#: band-gather bytes of fp32, each buffer scaled by a power of two that the device derives from a bound on its
#: entries before writing it, so that no entry overflows for any finite input (relgen.runtime.scales); no host
#: check. "fp32": Z̃ and dZ̃ in fp32 for fp16 and bf16 inputs, unscaled.
PROJECTION_STORAGES = ("fp16", "fp32")
#: the environment variable that chooses the storage at start-up
PROJECTION_STORAGE_ENV = "RELGEN_PROJECTION_STORAGE"
_storage: list[str] = []


def projection_storage() -> str:
    """The storage calls use now: set_projection_storage's, else $RELGEN_PROJECTION_STORAGE, else "fp16"."""
    if not _storage:
        mode = os.environ.get(PROJECTION_STORAGE_ENV) or "fp16"
        if mode not in PROJECTION_STORAGES:
            raise ValueError(f"{PROJECTION_STORAGE_ENV}: expected one of {PROJECTION_STORAGES}, got {mode!r}")
        _storage.append(mode)
    return _storage[0]


def set_projection_storage(mode: str) -> None:
    """Choose the storage of every later call in this process (one of PROJECTION_STORAGES)."""
    if not isinstance(mode, str) or mode not in PROJECTION_STORAGES:
        raise ValueError(f"mode: expected one of {PROJECTION_STORAGES}, got {mode!r}")
    _storage[:] = [mode]
