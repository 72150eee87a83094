"""The spec language: a relative-position mechanism described declaratively (YAML, dict or Python).

    name: deberta_v3
    terms: [query, key]
    map: {kind: log, position_buckets: 256, max_position: 512}
    scale: 1/sqrt(3*d)

`load_spec` accepts a `MechanismSpec`, a dict, a path to a YAML file or YAML text, and turns every problem into a
one-line `SpecError` naming the field (and, for YAML, the line) instead of a traceback. Specs are shared like model
configs, so they are untrusted: sizes are bounded (`relgen.spec.limits`) before any work, the YAML is read as plain data
(strings, numbers, booleans, null, lists, mappings; no other tag, no duplicate key, aliases counted as expanded)
and every field is strictly typed (no string read as a bool or a number).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from relgen.spec.expr import ExpressionError, cached_expression, compile_expression
from relgen.spec.limits import (
    MAX_DESCRIPTION_LENGTH,
    MAX_NAME_LENGTH,
    MAX_NUMBER_LENGTH,
    MAX_SEQ_LEN,
    MAX_SPEC_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    quoted,
    shortened,
)
from relgen.spec.maps import MapSpec

Term = Literal["query", "key", "bias"]
TERM_ORDER: tuple[Term, ...] = ("query", "key", "bias")

#: τ when a spec gives no scale.
DEFAULT_SCALE = "1/sqrt(d)"
#: Head dim at which a spec's scale is checked when it is loaded (the runtime checks each call's own).
CHECKED_HEAD_DIM = 64
#: The range of τ: fp32's normal numbers, halved at the top so that τ·log2(e) (the kernels' exp2 scale) stays finite.
TAU_RANGE = (2.0**-126, 2.0**127)


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


class LocalWindow(BaseModel):
    """Local attention: query i sees key j when i − left ≤ j ≤ i + right (absolute positions, so with offsets
    δ = (i + q_offset) − (j + k_offset) ∈ [−right, left]); a side that is null is unbounded."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    left: int | None = Field(ge=0, le=MAX_SEQ_LEN, description="keys at most this far before the query (null: all)")
    right: int | None = Field(ge=0, le=MAX_SEQ_LEN, description="keys at most this far after the query (null: all)")


class MechanismSpec(HasTerms, BaseModel):
    """One relative-position mechanism: S_ij = τ(q_i·k_j + q_i·a^Q_φ + k_j·a^K_φ + b_φ) + M_ij."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(
        pattern=r"^[a-z][a-z0-9_]*$", max_length=MAX_NAME_LENGTH, description="identifier of the generated module"
    )
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_LENGTH)
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
    window: LocalWindow | None = Field(None, description="local attention: {left, right}, either null (unbounded)")

    @field_validator("terms", mode="before")
    @classmethod
    def _terms_list(cls, terms: Any) -> Any:
        # YAML and JSON give a list; strict validation takes only tuples
        return tuple(terms) if isinstance(terms, list) else terms

    @field_validator("terms")
    @classmethod
    def _unique_terms(cls, terms: tuple[Term, ...]) -> tuple[Term, ...]:
        if len(set(terms)) != len(terms):
            raise ValueError(f"terms must not repeat, got {list(terms)}")
        return tuple(t for t in TERM_ORDER if t in terms)

    @field_validator("scale", mode="before")
    @classmethod
    def _scale_not_bool(cls, scale: Any) -> Any:
        if isinstance(scale, bool):
            raise ValueError(f"expected a number or an expression in d, got {scale!r}")
        return scale

    @field_validator("scale")
    @classmethod
    def _scale_valid(cls, scale: float | str | None) -> float | str | None:
        if scale is not None:
            try:
                _tau(scale, CHECKED_HEAD_DIM)
            except ExpressionError as err:
                raise ValueError(str(err)) from None
        return scale

    def scale_value(self, head_dim: int) -> float:
        """τ for head dimension d. Raises ValueError naming `scale` unless τ(d) is a positive number in fp32's
        normal range (TAU_RANGE); bounded in time (float64 evaluation of a size-limited tree, cached)."""
        try:
            d = operator.index(head_dim)
        except TypeError:
            raise ValueError(f"head_dim: expected a positive int, got {quoted(head_dim)}") from None
        if isinstance(head_dim, bool) or d < 1:
            raise ValueError(f"head_dim: expected a positive int, got {quoted(head_dim)}")
        return _tau(self.scale if self.scale is not None else DEFAULT_SCALE, d)

    @property
    def local_bounds(self) -> tuple[int | None, int | None]:
        """(left, right) of the local window that the spec's masks leave: causal bounds the right side at 0;
        None for an unbounded side."""
        left, right = (self.window.left, self.window.right) if self.window is not None else (None, None)
        if self.causal:
            right = 0
        return left, right

    def canonical_json(self) -> str:
        # a spec without a window keeps the canonical form (and hash) it had before windows existed
        data = self.model_dump(mode="json", exclude={"window"} if self.window is None else None)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def spec_hash(self) -> str:
        """A short hash of the canonical spec: the key of the kernel cache and of generated/ headers."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=256)
def _tau(scale: float | str, head_dim: int) -> float:
    """τ(head_dim), checked (see `MechanismSpec.scale_value`)."""
    if isinstance(scale, str):
        expr = cached_expression(scale, ("d",))
    else:
        if not math.isfinite(scale):
            raise ExpressionError(f"scale {scale!r}: expected a finite number")
        expr = compile_expression(scale, ("d",))
    value = float(expr.evaluate({"d": float(head_dim)}))
    low, high = TAU_RANGE
    if not low <= value <= high:  # also NaN
        raise ExpressionError(
            f"scale {quoted(scale)} gives τ = {value:.6g} at d = {head_dim}: expected a positive number that "
            "fp32 holds (between 2**-126 and 2**127)"
        )
    return value


# -- loading ---------------------------------------------------------------------------------------------------

_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CORE_PREFIX = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_CORE_PREFIX + t for t in ("str", "int", "float", "bool", "null")}
_NUMBER_TAGS = {_CORE_PREFIX + "int", _CORE_PREFIX + "float"}
_SEQUENCE_TAG, _MAPPING_TAG = _CORE_PREFIX + "seq", _CORE_PREFIX + "map"
#: Longest string that may name a spec file (PATH_MAX); longer text is never looked up on the file system.
_MAX_PATH_LENGTH = 4096


def load_spec(source: MechanismSpec | dict[str, Any] | str | Path) -> MechanismSpec:
    """Load a spec from a model, a dict, a YAML file path or YAML text.

    A `str` is a path when, with surrounding whitespace stripped, it has no newline and either ends in .yaml or
    .yml or names an existing file (or directory, or device: reading it then fails clearly); any other `str` is
    YAML text.
    """
    if isinstance(source, MechanismSpec):
        return source
    if isinstance(source, dict):
        return _validate(source, origin="spec", nodes=None)
    if not isinstance(source, str | Path):
        raise SpecError(f"spec: expected a MechanismSpec, a dict, a path or YAML text, got {type(source).__name__}")
    text, origin = _read_text(source)
    node = _compose(text, origin)
    if node is None:
        raise SpecError(f"{origin}: the spec is empty: expected a mapping of spec fields (name, terms, map, ...)")
    data = _Constructor(origin).construct(node)
    if not isinstance(data, dict):
        raise SpecError(
            f"{origin}: expected a mapping of spec fields (or the path of an existing spec file), "
            f"got {type(data).__name__} {quoted(data)}"
        )
    return _validate(data, origin=origin, nodes=node)


def _as_path(source: str | Path) -> Path | None:
    if isinstance(source, Path):
        return source
    candidate = source.strip()
    if not candidate or "\n" in candidate or len(candidate) > _MAX_PATH_LENGTH:
        return None
    if candidate.endswith((".yaml", ".yml")):
        return Path(candidate)
    try:
        return Path(candidate) if Path(candidate).exists() else None
    except (OSError, ValueError):  # e.g. a name too long for the file system, an embedded NUL
        return None


def _read_text(source: str | Path) -> tuple[str, str]:
    """The spec's text and the origin its errors name; at most MAX_SPEC_BYTES bytes are ever read."""
    path = _as_path(source)
    if path is None:
        text = str(source)
        try:
            size = len(text) if len(text) > MAX_SPEC_BYTES else len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise SpecError("spec: the YAML text is not valid Unicode (a lone surrogate)") from None
        if size > MAX_SPEC_BYTES:
            raise SpecError(f"spec: YAML text larger than {MAX_SPEC_BYTES} bytes")
        return text, "spec"
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_SPEC_BYTES + 1)
    except OSError as err:
        raise SpecError(f"{path}: cannot read spec file: {err.strerror or err}") from None
    except ValueError as err:  # an embedded NUL in the path
        raise SpecError(f"{quoted(str(path))}: cannot read spec file: {err}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: spec file larger than {MAX_SPEC_BYTES} bytes")
    try:
        return raw.decode("utf-8-sig"), str(path)
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})") from None


def _compose(text: str, origin: str) -> yaml.Node | None:
    """The YAML node graph of `text`, after a scan of its events bounds nesting and expanded size."""
    try:
        _scan(text, origin)
        loader = _LOADER(text)
        try:
            return loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise SpecError(f"{origin}:{_yaml_error(err, text)}") from None


def _scan(text: str, origin: str) -> None:
    """Refuse nesting deeper than MAX_YAML_DEPTH and more than MAX_YAML_NODES nodes with aliases expanded (an
    alias counts as the whole node it names), stopping at the first event past a limit, before any composing."""
    loader = _LOADER(text)
    total = 0
    sizes: dict[str, int] = {}  # expanded node count of each anchor
    open_collections: list[tuple[str | None, int]] = []  # (anchor, total before it started)
    try:
        while loader.check_event():
            event = loader.get_event()
            line = f" line {event.start_mark.line + 1}:"
            if isinstance(event, yaml.AliasEvent):
                if any(anchor == event.anchor for anchor, _ in open_collections):
                    raise SpecError(f"{origin}:{line} recursive alias *{shortened(event.anchor)}")
                total += sizes.get(event.anchor, 1)  # an undefined alias is the composer's error
            elif isinstance(event, yaml.ScalarEvent):
                total += 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.CollectionStartEvent):
                open_collections.append((event.anchor, total))
                total += 1
                if len(open_collections) > MAX_YAML_DEPTH:
                    raise SpecError(f"{origin}:{line} YAML nested more than {MAX_YAML_DEPTH} levels deep")
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, before = open_collections.pop()
                if anchor is not None:
                    sizes[anchor] = total - before
            if total > MAX_YAML_NODES:
                raise SpecError(f"{origin}:{line} more than {MAX_YAML_NODES} YAML nodes (aliases counted as expanded)")
    finally:
        loader.dispose()


def _yaml_error(err: yaml.YAMLError, text: str) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" line {mark.line + 1}:" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if mark is not None and problem.startswith("found character that") and 0 <= mark.index < len(text):
        # libyaml leaves out which character (a tab, mostly), where PyYAML's own parser names it
        problem = problem.replace("found character", f"found character {text[mark.index]!r}", 1)
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
        problem += f" ({context} started at line {context_mark.line + 1})"
    return f"{where} unreadable YAML: {problem}"


class _Constructor:
    """Plain data from a checked node graph: only the JSON-like tags, string keys, no key twice."""

    def __init__(self, origin: str):
        self.origin = origin
        self.scalars = yaml.constructor.SafeConstructor()
        self.done: dict[int, Any] = {}  # an aliased node is built once

    def construct(self, node: yaml.Node) -> Any:
        if id(node) in self.done:
            return self.done[id(node)]
        line = f" line {node.start_mark.line + 1}:"
        if isinstance(node, yaml.MappingNode):
            plain = node.tag == _MAPPING_TAG
        elif isinstance(node, yaml.SequenceNode):
            plain = node.tag == _SEQUENCE_TAG
        else:
            plain = node.tag in _SCALAR_TAGS
        if not plain:
            raise SpecError(
                f"{self.origin}:{line} YAML tag {shortened(node.tag.replace(_CORE_PREFIX, '!!'))} is not allowed "
                "(a spec holds strings, numbers, booleans, null, lists and mappings)"
            )
        if isinstance(node, yaml.MappingNode):
            value: Any = self._mapping(node)
        elif isinstance(node, yaml.SequenceNode):
            value = [self.construct(item) for item in node.value]
        else:
            if node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_LENGTH:
                raise SpecError(f"{self.origin}:{line} number longer than {MAX_NUMBER_LENGTH} characters")
            try:
                value = self.scalars.construct_object(node)
            except (ValueError, KeyError, yaml.YAMLError):  # e.g. !!int abc, !!bool maybe
                raise SpecError(
                    f"{self.origin}:{line} unreadable {node.tag.rsplit(':', 1)[-1]} {quoted(node.value)}"
                ) from None
        self.done[id(node)] = value
        return value

    def _mapping(self, node: yaml.MappingNode) -> dict[str, Any]:
        result: dict[str, Any] = {}
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            key = self.construct(key_node)
            if not isinstance(key, str):
                raise SpecError(f"{self.origin}: line {line}: keys must be strings, got {quoted(key)}")
            if key in result:
                raise SpecError(
                    f"{self.origin}: line {line}: duplicate key {quoted(key)} (first at line {first_line[key]})"
                )
            first_line[key] = line
            result[key] = self.construct(value_node)
        return result


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
        # a union's members each report the same field: count fields, not members
        others = {tuple(_clean_loc([p for p in e["loc"] if isinstance(p, str | int)])) for e in errors[1:]}
        others.discard(tuple(_clean_loc(raw)))
        more = f" (and {len(others)} more)" if others else ""
        raise SpecError(f"{origin}:{where} field '{_field_path(loc)}': {message}{more}") from None


@functools.cache
def _map_kinds() -> dict[str, type[BaseModel]]:
    """Map kind tag → its model class, in declaration order."""
    classes = typing.get_args(typing.get_args(MapSpec)[0])
    return {typing.get_args(cls.model_fields["kind"].annotation)[0]: cls for cls in classes}


def _clean_loc(loc: list[str | int]) -> list[str | int]:
    """pydantic puts the discriminator's tag into the location (map.log.position_buckets), and the member of a
    union that failed (scale.float): drop them."""
    if len(loc) >= 2 and loc[0] == "map" and loc[1] in _map_kinds():
        return [loc[0], *loc[2:]]
    if loc and loc[0] == "scale":
        return ["scale"]
    return loc


def _message(error: dict[str, Any], loc: list[str | int], map_kind: str | int | None) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        owners: dict[str | int, type[BaseModel] | None] = {
            "map": _map_kinds().get(str(map_kind)),
            "window": LocalWindow,
        }
        owner = owners.get(loc[0], MechanismSpec)
        allowed = f" (allowed: {', '.join(owner.model_fields)})" if owner is not None and len(loc) <= 2 else ""
        return f"unknown key{allowed}"
    if kind == "union_tag_not_found":
        return f"missing 'kind': one of {', '.join(_map_kinds())}"
    if kind == "union_tag_invalid":
        tag = error.get("ctx", {}).get("tag", value)
        return f"unknown map kind {quoted(tag)}: one of {', '.join(_map_kinds())}"
    if kind in ("model_attributes_type", "model_type") and loc == ["map"]:
        return f"expected a mapping with a 'kind' (one of {', '.join(_map_kinds())}), got {quoted(value)}"
    if loc == ["scale"] and kind in ("float_type", "string_type"):
        return f"expected a number or an expression in d, got {quoted(value)}"
    if loc == ["terms"] and kind == "too_short":
        return "must list at least one of query, key, bias"
    message = error["msg"].removeprefix("Value error, ")
    message = message.replace("a valid tuple", "a list").replace("Tuple should", "List should")
    scalar = isinstance(value, str | int | float | bool)
    if kind != "value_error" and scalar and repr(value) not in message and "got" not in message:
        message += f", got {quoted(value)}"
    return message


def _field_path(loc: list[str | int]) -> str:
    parts = [f"[{part}]" if isinstance(part, int) else shortened(part) for part in loc]
    return ".".join(parts).replace(".[", "[")


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
