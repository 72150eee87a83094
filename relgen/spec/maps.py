"""Offset maps φ: the one place that says which relation row an offset δ = i − j reads.

Each map kind is a declarative Pydantic model (strictly typed, bounded by `relgen.spec.limits`) with two methods:

* ``num_rows(length)`` — R, the number of table rows (only the identity map depends on the length);
* ``row_ids(delta, length)`` — φ(δ) for an integer array of offsets, vectorised.

Row ids are the models' own, so trained tables load unchanged. T5's and DeBERTa's buckets are computed with the
same float32 torch operations the models use, so even the rounding of their logarithms agrees.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relgen.spec.expr import Expression, ExpressionError, cached_expression
from relgen.spec.limits import MAX_BOUNDARIES, MAX_EXPRESSION_LENGTH, MAX_OFFSET, MAX_ROWS, quoted

Offset = Literal["query_minus_key", "key_minus_query"]

#: Offsets over which `validate` checks expression maps (analysis checks the real window again).
VALIDATION_RADIUS = 1024


class _Map(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def num_rows(self, length: int) -> int:
        raise NotImplementedError

    def row_ids(self, delta: np.ndarray, length: int) -> np.ndarray:
        raise NotImplementedError

    @property
    def length_dependent(self) -> bool:
        """True when R and the rows depend on the sequence length (identity maps)."""
        return False

    def _signed(self, delta: np.ndarray) -> np.ndarray:
        """The offset the map sees: δ itself, or j − i = −δ for ``offset: key_minus_query``."""
        offset = getattr(self, "offset", "query_minus_key")
        return -delta if offset == "key_minus_query" else delta


class IdentityMap(_Map):
    """Every offset has its own row: R = 2L − 1, row = δ + L − 1 (L: the sequence length)."""

    kind: Literal["identity"]
    offset: Offset = "query_minus_key"

    @property
    def length_dependent(self) -> bool:
        return True

    def num_rows(self, length: int) -> int:
        return 2 * length - 1

    def row_ids(self, delta: np.ndarray, length: int) -> np.ndarray:
        return self._signed(delta) + (length - 1)


class ClippedMap(_Map):
    """Offsets clipped to [min, max]: row = clip(δ, min, max) − min, R = max − min + 1."""

    kind: Literal["clipped"]
    min: int = Field(ge=-MAX_OFFSET, le=0, description="smallest offset with its own row (≤ 0)")
    max: int = Field(ge=0, le=MAX_OFFSET, description="largest offset with its own row (≥ 0)")
    offset: Offset = "query_minus_key"

    def num_rows(self, length: int) -> int:
        return self.max - self.min + 1

    def row_ids(self, delta: np.ndarray, length: int) -> np.ndarray:
        return np.clip(self._signed(delta), self.min, self.max) - self.min


class T5Map(_Map):
    """T5's ``_relative_position_bucket(j − i, bidirectional, num_buckets, max_distance)``."""

    kind: Literal["t5"]
    num_buckets: int = Field(32, ge=2, le=MAX_ROWS)
    max_distance: int = Field(128, ge=2, le=MAX_OFFSET)
    bidirectional: bool = True

    @model_validator(mode="after")
    def _buckets_fit(self) -> T5Map:
        exact = (self.num_buckets // 2 if self.bidirectional else self.num_buckets) // 2
        if exact < 1:
            raise ValueError("num_buckets is too small: T5 needs at least one exact bucket per direction")
        if self.max_distance <= exact:
            raise ValueError(f"max_distance must exceed the exact range ({exact}), got {self.max_distance}")
        return self

    def num_rows(self, length: int) -> int:
        return self.num_buckets

    def row_ids(self, delta: np.ndarray, length: int) -> np.ndarray:
        relative_position = -torch.as_tensor(delta, dtype=torch.long)  # T5 sees memory − query = j − i
        buckets = torch.zeros_like(relative_position)
        num_buckets = self.num_buckets
        if self.bidirectional:
            num_buckets //= 2
            buckets += (relative_position > 0).to(torch.long) * num_buckets
            distance = torch.abs(relative_position)
        else:
            distance = -torch.clamp(relative_position, max=0)
        max_exact = num_buckets // 2
        is_small = distance < max_exact
        # float32 and truncation toward zero, exactly as the model computes it
        large = max_exact + (
            torch.log(distance.float() / max_exact)
            / math.log(self.max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        large = torch.clamp(large, max=num_buckets - 1)
        buckets += torch.where(is_small, distance, large)
        return buckets.numpy()


class LogMap(_Map):
    """DeBERTa-v2/v3: clamp(make_log_bucket_position(δ) + position_buckets, 0, 2·position_buckets − 1)."""

    kind: Literal["log"]
    position_buckets: int = Field(ge=2, le=MAX_ROWS // 2, description="DeBERTa's position_buckets (256 in v3)")
    max_position: int = Field(ge=2, le=MAX_OFFSET, description="DeBERTa's max_relative_positions (512 in v3)")

    @model_validator(mode="after")
    def _span(self) -> LogMap:
        if self.max_position - 1 <= self.position_buckets // 2:
            raise ValueError(
                f"max_position ({self.max_position}) must exceed position_buckets/2 + 1 "
                f"({self.position_buckets // 2 + 1}) for the logarithmic buckets to be defined"
            )
        return self

    def num_rows(self, length: int) -> int:
        return 2 * self.position_buckets

    def row_ids(self, delta: np.ndarray, length: int) -> np.ndarray:
        relative = torch.as_tensor(delta, dtype=torch.long)
        mid = self.position_buckets // 2
        sign = torch.sign(relative)
        abs_pos = torch.where(
            (relative < mid) & (relative > -mid), torch.tensor(mid - 1).type_as(relative), torch.abs(relative)
        )
        log_pos = (
            torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((self.max_position - 1) / mid)) * (mid - 1))
            + mid
        )
        bucket = torch.where(abs_pos <= mid, relative.type_as(log_pos), log_pos * sign).to(torch.long)
        return torch.clamp(bucket + self.position_buckets, 0, 2 * self.position_buckets - 1).numpy()


class BoundariesMap(_Map):
    """Row = number of boundaries ≤ δ, R = len(boundaries) + 1."""

    kind: Literal["boundaries"]
    boundaries: list[Annotated[int, Field(ge=-MAX_OFFSET, le=MAX_OFFSET)]] = Field(
        min_length=1, max_length=MAX_BOUNDARIES
    )
    offset: Offset = "query_minus_key"

    @field_validator("boundaries")
    @classmethod
    def _increasing(cls, values: list[int]) -> list[int]:
        if any(b >= a for a, b in zip(values[1:], values, strict=False)):
            at = next(i for i in range(1, len(values)) if values[i] <= values[i - 1])
            raise ValueError(
                f"boundaries must be strictly increasing, got {values[at - 1]} then {values[at]} at index {at}"
            )
        return values

    def num_rows(self, length: int) -> int:
        return len(self.boundaries) + 1

    def row_ids(self, delta: np.ndarray, length: int) -> np.ndarray:
        return np.searchsorted(np.asarray(self.boundaries), self._signed(delta), side="right")


class ExpressionMap(_Map):
    """Row = expr(δ), an expression in ``delta`` (see `relgen.spec.expr`) with integer values in [0, rows)."""

    kind: Literal["expression"]
    expr: str = Field(
        max_length=MAX_EXPRESSION_LENGTH, description="expression in the variable `delta`, e.g. 'Min(Abs(delta), 16)'"
    )
    rows: int = Field(ge=1, le=MAX_ROWS, description="R, the number of table rows")
    offset: Offset = "query_minus_key"

    @field_validator("expr")
    @classmethod
    def _parses(cls, text: str) -> str:
        try:
            cached_expression(text, ("delta",))
        except ExpressionError as err:
            raise ValueError(str(err)) from None
        return text

    @model_validator(mode="after")
    def _values_in_range(self) -> ExpressionMap:
        radius = VALIDATION_RADIUS
        self.row_ids(np.arange(-radius, radius + 1), 2 * radius + 1)
        return self

    @property
    def expression(self) -> Expression:
        return cached_expression(self.expr, ("delta",))

    def num_rows(self, length: int) -> int:
        return self.rows

    def row_ids(self, delta: np.ndarray, length: int) -> np.ndarray:
        seen = self._signed(np.asarray(delta, dtype=np.int64))
        values = np.broadcast_to(self.expression.evaluate({"delta": seen}), seen.shape)
        rounded = np.round(values)
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(values) | (np.abs(values - rounded) > 1e-9) | (rounded < 0) | (rounded >= self.rows)
        if bad.any():
            at = int(np.flatnonzero(bad.ravel())[0])
            raise ValueError(
                f"expr {quoted(self.expr)} gives {float(values.ravel()[at]):g} at delta={int(np.ravel(delta)[at])}: "
                f"expected an integer in [0, rows={self.rows})"
            )
        return rounded.astype(np.int64)


MapSpec = Annotated[
    IdentityMap | ClippedMap | T5Map | LogMap | BoundariesMap | ExpressionMap,
    Field(discriminator="kind"),
]
