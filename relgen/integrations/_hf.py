"""What the Hugging Face families share: whether a call must return attention weights."""

from __future__ import annotations

import functools
from typing import Any


def wants_attentions(kwargs: dict[str, Any]) -> bool:
    """True when this call must return attention weights: asked by keyword, or recorded by the model's output
    hooks (config.output_attentions reaches the layers only through the hooks' collector; any of its
    `*attentions` outputs counts, cross-attentions included)."""
    if kwargs.get("output_attentions"):
        return True
    collector = _output_collector()
    collected = collector.get() if collector is not None else None
    return bool(collected) and any(key.endswith("attentions") for key in collected)


@functools.cache
def _output_collector() -> Any:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output hooks passes output_attentions as a keyword
        return None
    return _active_collector
