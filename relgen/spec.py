"""The spec language: a relative-position mechanism described declaratively (YAML, dict or Python).

    name: deberta_v3
    terms: [query, key]
    map: {kind: log, position_buckets: 256, max_position: 512}
    scale: 1/sqrt(3*d)

`load_spec` accepts a `MechanismSpec`, a dict, a path to a YAML file or YAML text, and turns every problem into a
`SpecError` naming the field (and, for YAML, the line) instead of a traceback.
"""

from __future__ import annotations

import functools
import hashlib
import json
import typing
from pathlib import Path
from typing import Any, Literal

import sympy
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from relgen.expr import ExpressionError, parse_expression
from relgen.maps import MapSpec

Term = Literal["query", "key", "bias"]
TERM_ORDER: tuple[Term, ...] = ("query", "key", "bias")


class SpecError(ValueError):
    """A spec that cannot be loaded; the message names the field and, for YAML, the line."""


class HasTerms:
    """Which relation terms an object with a `terms` tuple holds: the spec, and the plan made from it. (The mixin
    declares no field itself, so that neither the model's nor the dataclass's field order changes.)"""

    @property
    def has_query(self) -> bool:
        return "query" in self.terms  # type: ignore[attr-defined]

    @property
    def has_key(self) -> bool:
        return "key" in self.terms  # type: ignore[attr-defined]

    @property
    def has_bias(self) -> bool:
        return "bias" in self.terms  # type: ignore[attr-defined]


class MechanismSpec(HasTerms, BaseModel):
    """One relative-position mechanism: S_ij = τ(q_i·k_j + q_i·a^Q_φ + k_j·a^K_φ + b_φ) + M_ij."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="identifier of the generated module")
    description: str | None = None
    terms: tuple[Term, ...] = Field(
        min_length=1,
        description="query: q_i·a^Q_r, key: k_j·a^K_r, bias: scalar b_r",
    )
    map: MapSpec
    scale: float | str | None = Field(
        None, description="τ: a number or an expression in d (head dim); default 1/sqrt(d)"
    )
    causal: bool = False
    heads_share_tables: bool = Field(False, description="tables [R, d] and [R] instead of [H, R, d] and [H, R]")

    @field_validator("terms")
    @classmethod
    def _unique_terms(cls, terms: tuple[Term, ...]) -> tuple[Term, ...]:
        if len(set(terms)) != len(terms):
            raise ValueError(f"terms must not repeat, got {list(terms)}")
        return tuple(t for t in TERM_ORDER if t in terms)

    @field_validator("scale", mode="before")
    @classmethod
    def _scale_not_bool(cls, scale: Any) -> Any:
        # pydantic would read `scale: true` as 1.0
        if isinstance(scale, bool):
            raise ValueError(f"expected a number or an expression in d, got {scale!r}")
        return scale

    @field_validator("scale")
    @classmethod
    def _scale_parses(cls, scale: float | str | None) -> float | str | None:
        if scale is None:
            return None
        try:
            expr = parse_expression(scale, variables=("d",))
        except ExpressionError as err:
            raise ValueError(str(err)) from None
        value = expr.subs(sympy.Symbol("d", integer=True), 64)
        if not value.is_real or not value.is_positive:
            raise ValueError(f"scale must be a positive number for d > 0, got {scale!r} = {value} at d=64")
        return scale

    def scale_value(self, head_dim: int) -> float:
        """τ for head dimension d."""
        text = self.scale if self.scale is not None else "1/sqrt(d)"
        expr = parse_expression(text, variables=("d",))
        return float(expr.subs(sympy.Symbol("d", integer=True), head_dim))

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def spec_hash(self) -> str:
        """A short hash of the canonical spec: the key of the kernel cache and of generated/ headers."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


def load_spec(source: MechanismSpec | dict[str, Any] | str | Path) -> MechanismSpec:
    """Load a spec from a model, a dict, a YAML file path or YAML text."""
    if isinstance(source, MechanismSpec):
        return source
    if isinstance(source, dict):
        return _validate(source, origin="spec", nodes=None)
    text, origin = _read_text(source)
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
            problem += f" ({context} started at line {context_mark.line + 1})"
        raise SpecError(f"{origin}:{where} unreadable YAML: {problem}") from None
    if data is None:
        raise SpecError(f"{origin}: the spec is empty: expected a mapping of spec fields (name, terms, map, ...)")
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: expected a mapping of spec fields, got {type(data).__name__}")
    return _validate(data, origin=origin, nodes=node)


def _read_text(source: str | Path) -> tuple[str, str]:
    if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml"))
    ):
        path = Path(source)
        try:
            return path.read_text(), str(path)
        except OSError as err:
            raise SpecError(f"{path}: cannot read spec file: {err.strerror}") from None
    return str(source), "spec"


def _validate(data: dict[str, Any], origin: str, nodes: yaml.Node | None) -> MechanismSpec:
    try:
        return MechanismSpec.model_validate(data)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        first = errors[0]
        raw = [part for part in first["loc"] if isinstance(part, str | int)]
        loc = _clean_loc(raw)
        kind = raw[1] if len(raw) > len(loc) else None  # the map kind whose field failed
        message = _message(first, loc, kind)
        if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = [*loc, "kind"]
        line = _line_of(nodes, loc)
        where = f" line {line}:" if line is not None else ""
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SpecError(f"{origin}:{where} field '{_field_path(loc)}': {message}{more}") from None


@functools.cache
def _map_kinds() -> dict[str, type[BaseModel]]:
    """Map kind tag → its model class, in declaration order."""
    classes = typing.get_args(typing.get_args(MapSpec)[0])
    return {typing.get_args(cls.model_fields["kind"].annotation)[0]: cls for cls in classes}


def _clean_loc(loc: list[str | int]) -> list[str | int]:
    """pydantic puts the discriminator's tag into the location (map.log.position_buckets): drop it."""
    if len(loc) >= 2 and loc[0] == "map" and loc[1] in _map_kinds():
        return [loc[0], *loc[2:]]
    return loc


def _message(error: dict[str, Any], loc: list[str | int], map_kind: str | int | None) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        owner = _map_kinds().get(str(map_kind)) if loc[0] == "map" else MechanismSpec
        allowed = f" (allowed: {', '.join(owner.model_fields)})" if owner is not None and len(loc) <= 2 else ""
        return f"unknown key{allowed}"
    if kind == "union_tag_not_found":
        return f"missing 'kind': one of {', '.join(_map_kinds())}"
    if kind == "model_attributes_type" and loc == ["map"]:
        return f"expected a mapping with a 'kind' (one of {', '.join(_map_kinds())}), got {value!r}"
    if loc == ["terms"] and kind == "too_short":
        return "must list at least one of query, key, bias"
    message = error["msg"].removeprefix("Value error, ")
    message = message.replace("a valid tuple", "a list").replace("Tuple should", "List should")
    scalar = isinstance(value, str | int | float | bool)
    if kind != "value_error" and scalar and repr(value) not in message and "got" not in message:
        text = repr(value)
        message += f", got {text if len(text) <= 60 else text[:57] + '...'}"
    return message


def _field_path(loc: list[str | int]) -> str:
    return ".".join(f"[{part}]" if isinstance(part, int) else part for part in loc).replace(".[", "[")


def _line_of(node: yaml.Node | None, loc: list[str | int]) -> int | None:
    """1-based line of the YAML node at `loc`, or of its closest existing parent."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == part), None)
            if match is None:
                continue  # e.g. the discriminator tag pydantic adds, or a missing field
            node = match[1]
            line = match[0].start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
    return line
