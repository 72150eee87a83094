"""Patching machinery shared by every integration: find the attention modules a family serves, swap their forward
for one that runs relgen's kernels, fall back per call, and put everything back.

An `Adapter` knows one family of attention modules (HF DeBERTa-v2's `DisentangledSelfAttention`, T5's `T5Attention`,
NeMo's `RelPositionMultiHeadAttention`, ...). `patch` walks a module tree, asks each adapter whether it serves a
module, lets it `prepare` per-module state (the compiled mechanism, ...) and replaces the module's `forward` by an
instance attribute, so parameters, buffers and `state_dict()` keys stay the model's own. `unpatch` removes that
attribute. Adapters import their library lazily: `import relgen.integrations` needs neither transformers nor NeMo.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


class Unsupported(Exception):
    """Raised by an adapter's `prepare` when a module's configuration cannot be served: the message names the
    option and its value, e.g. ``"position_buckets=0 with max_relative_positions=-1"``."""


@dataclass(frozen=True)
class Adapter:
    """One family of attention modules.

    `matches(module)` says whether the adapter serves the module (by class, checked without importing its library
    when possible); `prepare(module)` returns the state the patched forward needs or raises `Unsupported`;
    `forward(module, state, *args, **kwargs)` computes exactly what the module's own forward returns for the same
    arguments. It may call `fall_back(module, feature, *args, **kwargs)` for a call it cannot serve.

    `attention=False` marks a helper of a family rather than an attention module (DeBERTa's encoder, which hands
    its layers the [B, N] padding mask instead of an N×N one): it is patched and unpatched with the rest, but not
    named in `patch`'s result nor counted as a supported module, and a helper whose `prepare` refuses is skipped
    without a warning.

    `restore(module, state)`, when given, undoes what `prepare` changed outside the module's forward (T5 switches
    its stack's attention implementation); `unpatch` calls it before putting the forward back.

    `options` names the keyword options of `patch` that `prepare` accepts (NeMo's ``attention_dtype``): `patch`
    passes each to the `prepare` of the adapters that name it, as a keyword.

    `patched(states)`, when given, receives once per `patch` call the states of every module the adapter prepared
    in it, in the model's order (NeMo's layers learn how many of them keep stored projections in training).
    """

    family: str
    matches: Callable[[nn.Module], bool]
    prepare: Callable[[nn.Module], Any]
    forward: Callable[..., Any]
    attention: bool = True
    restore: Callable[[nn.Module, Any], None] | None = None
    options: tuple[str, ...] = ()
    patched: Callable[[list[Any]], None] | None = None


_ADAPTERS: list[Adapter] = []
_ORIGINAL = "_relgen_original_forward"
_WARNED: set[tuple[str, str]] = set()
_LOCK = threading.Lock()


def register(adapter: Adapter) -> Adapter:
    """Add an adapter (families register themselves when relgen.integrations is imported)."""
    if any(a.family == adapter.family for a in _ADAPTERS):
        raise ValueError(f"an adapter for family {adapter.family!r} is already registered")
    _ADAPTERS.append(adapter)
    return adapter


def adapters() -> tuple[Adapter, ...]:
    return tuple(_ADAPTERS)


def warn_once(family: str, what: str, message: str) -> None:
    """One warning per (family, what) in a process: a training loop must not print one per step."""
    with _LOCK:
        if (family, what) in _WARNED:
            return
        _WARNED.add((family, what))
    warnings.warn(f"relgen.integrations ({family}): {message}", stacklevel=3)


def fall_back(module: nn.Module, feature: str, *args: Any, **kwargs: Any) -> Any:
    """Run the module's own forward for this call (a feature the kernels cannot serve), with a one-time warning
    naming the feature."""
    original = _original(module)
    family = getattr(module, "_relgen_family", type(module).__name__)
    warn_once(family, feature, f"{feature} is not served by relgen's kernels; this call runs the model's own code")
    return original(*args, **kwargs)


def run_original(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run the module's own forward without a warning (a helper passing a call through unchanged)."""
    return _original(module)(*args, **kwargs)


def _original(module: nn.Module) -> Callable[..., Any]:
    original = getattr(module, _ORIGINAL, None)
    if original is None:
        raise RuntimeError(f"{type(module).__name__} is not patched by relgen")
    return original


def is_patched(module: nn.Module) -> bool:
    return _ORIGINAL in module.__dict__


def patch(model: nn.Module, *, strict: bool = False, **options: Any) -> list[str]:
    """Patch every supported attention module below (and including) `model` in place; return their qualified names.

    A module whose configuration relgen cannot serve stays on its own code and is named in one warning
    (`strict=True` raises a `ValueError` naming the option instead, and leaves the model as it found it). A model
    with no supported module raises a `ValueError` naming its class. `options` go to the adapters that accept
    them (`Adapter.options`); one that no adapter serving `model` accepts raises a `ValueError` naming it.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    _load_families()
    if options:
        _check_options(model, options)
    patched: list[str] = []
    refused: list[str] = []
    swapped: list[nn.Module] = []
    prepared: dict[str, list[Any]] = {}
    for name, module in model.named_modules():
        adapter = next((a for a in _ADAPTERS if a.matches(module)), None)
        if adapter is None:
            continue
        label = name or type(module).__name__
        if is_patched(module):
            if adapter.attention:
                patched.append(label)
            continue
        try:
            state = adapter.prepare(module, **{name: options[name] for name in adapter.options if name in options})
        except Unsupported as why:
            if not adapter.attention:
                continue
            if strict:
                for done in swapped:
                    _restore(done)
                raise ValueError(f"{label} ({type(module).__name__}): relgen cannot serve {why}") from None
            refused.append(f"{label} ({why})")
            continue
        except Exception:  # a bad option value, ...: the model is left as it was found
            for done in swapped:
                _restore(done)
            raise
        _swap(module, adapter, state)
        swapped.append(module)
        prepared.setdefault(adapter.family, []).append(state)
        if adapter.attention:
            patched.append(label)
    for adapter in _ADAPTERS:
        if adapter.patched is not None and adapter.family in prepared:
            adapter.patched(prepared[adapter.family])
    if refused:
        warnings.warn("relgen.integrations: left on the model's own code: " + "; ".join(refused), stacklevel=2)
    if not patched and not refused:
        families = ", ".join(a.family for a in _ADAPTERS)
        raise ValueError(
            f"model: {type(model).__name__} holds no attention module relgen supports (families: {families})"
        )
    return patched


def _check_options(model: nn.Module, options: dict[str, Any]) -> None:
    """Refuse an option that no adapter serving `model` accepts: it would be ignored without a word."""
    accepted = {name for m in model.modules() for a in _ADAPTERS if a.matches(m) for name in a.options}
    for name in options:
        if name not in accepted:
            served = ", ".join(sorted(accepted)) or "none"
            raise ValueError(
                f"{name}: not an option of the relgen integrations serving {type(model).__name__} (options: {served})"
            )


def unpatch(model: nn.Module) -> list[str]:
    """Put the original forwards back; return the qualified names of the attention modules restored (helpers are
    restored too, unnamed, as `patch` leaves them out)."""
    helpers = {a.family for a in _ADAPTERS if not a.attention}
    restored = []
    for name, module in model.named_modules():
        if is_patched(module) and _restore(module) not in helpers:
            restored.append(name or type(module).__name__)
    return restored


def _restore(module: nn.Module) -> str | None:
    """Undo `_swap` (and what the adapter's prepare changed); return the module's family."""
    family = module.__dict__.get("_relgen_family")
    adapter = next((a for a in _ADAPTERS if a.family == family), None)
    if adapter is not None and adapter.restore is not None:
        adapter.restore(module, module.__dict__.get("_relgen_state"))
    del module.__dict__["forward"]
    del module.__dict__[_ORIGINAL]
    module.__dict__.pop("_relgen_family", None)
    module.__dict__.pop("_relgen_state", None)
    return family


def _swap(module: nn.Module, adapter: Adapter, state: Any) -> None:
    # the bound method as it is now (a subclass's or a hook-wrapped one included), called by fall_back
    module.__dict__[_ORIGINAL] = module.forward
    module.__dict__["_relgen_family"] = adapter.family
    module.__dict__["_relgen_state"] = state
    forward = functools.partial(adapter.forward, module, state)
    functools.update_wrapper(forward, type(module).forward)
    module.__dict__["forward"] = forward


def _load_families() -> None:
    """Import the family modules once (each registers its adapters; none imports its library at import time)."""
    from relgen.integrations import families  # noqa: F401
