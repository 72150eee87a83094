"""The fast tier (`pytest -m "not slow"`): the marker for tests that CI runs but the edit–test loop leaves out.

A parametrised test is slow where any of its parameters is: `slow_values` marks values along one axis, so the fast
tier keeps the product of the fast values of every axis."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

__all__ = ["SLOW", "slow_values"]

SLOW = pytest.mark.slow


def slow_values(values: Iterable, slow: Iterable | None = None, *, fast: Iterable | None = None) -> list:
    """`values` as parameters, those equal to one of `slow` (or all but those equal to one of `fast`) marked slow,
    their ids unchanged. A tuple is unpacked into the arguments of a parametrisation of several names."""
    values = list(values)
    if (slow is None) == (fast is None):
        raise ValueError("slow_values: expected exactly one of slow= and fast=")
    named = list(slow if slow is not None else fast)
    missing = [v for v in named if v not in values]
    if missing:  # a renamed case must not slip into (or out of) the fast tier unnoticed
        raise ValueError(f"slow_values: {missing!r} are not among the values {values!r}")
    return [_slow(v) if (v in named) == (slow is not None) else v for v in values]


def _slow(value: object) -> object:
    return pytest.param(*value, marks=SLOW) if isinstance(value, tuple) else pytest.param(value, marks=SLOW)
