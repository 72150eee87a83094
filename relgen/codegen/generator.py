"""Code generation: Plan → one Python module of Triton kernels and autograd glue (Jinja over templates/).

The Plan is the only input. `GenerationFlags` names the few facts the template branches on, each derived from
the Plan here, so the template itself holds no mechanism knowledge.

No text of a spec reaches the module as it was written. `PlanValues` re-checks every field of the Plan the template
reads, whoever built the Plan, and holds canonical values only: ints and bools, identifiers, choices from fixed
sets, the scale as the literal of its normalised expression. The template's environment enforces it: an
expression that renders anything else (a raw string, a float, a tuple) stops the render with a ValueError.
"""

from __future__ import annotations

import ast
import errno
import functools
import os
import re
import secrets
import shutil
import subprocess
import typing
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.nodes
import numpy as np

from relgen import __version__
from relgen.backend import SYNTAX_TREES
from relgen.plan.analyze import Path as GradientPath
from relgen.plan.analyze import Plan, Projections, Relations, analyze
from relgen.spec.expr import parse_expression
from relgen.spec.model import TERM_ORDER, HasTerms, load_spec

TEMPLATE = "mechanism.py.j2"
#: the folder of templates/ holding the parts TEMPLATE includes
PARTS = "parts"

#: Longest spec name (and map kind) emitted: the name is part of module and file names.
MAX_IDENTIFIER_LENGTH = 64
#: Longest scale expression read (the spec's text).
MAX_SCALE_LENGTH = 1024

_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*")
_SPEC_HASH = re.compile(r"[0-9a-f]{16}")
_VERSION = re.compile(r"[0-9A-Za-z.+!-]{1,40}")
# what Plan.summary() is made of: the name, kinds, numbers, brackets (never a quote, backslash or line break, so
# the summary cannot end the header comment or the module docstring it is written into)
_SUMMARY = re.compile(r"[A-Za-z0-9_=+\-:\[\](), ]{1,400}")
# a normalised expression of whitelisted numbers, names, operators and parentheses (so that it is its own string
# literal's content)
_SCALE = re.compile(r"[0-9A-Za-z_.+\-*/%(), ]+")


class Source(str):
    """Text to paste into the generated module as it stands: built in this module from canonical values only."""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(value: object, field: str, minimum: int | None = None) -> int:
    if isinstance(value, np.integer):
        value = int(value)
    if type(value) is not int or (minimum is not None and value < minimum):
        bound = f" ≥ {minimum}" if minimum is not None else ""
        raise ValueError(f"plan.{field}: expected an int{bound}, got {_shown(value)}")
    return value


def _flag(value: object, field: str) -> bool:
    if isinstance(value, np.bool_):
        value = bool(value)
    if type(value) is not bool:
        raise ValueError(f"plan.{field}: expected a bool, got {_shown(value)}")
    return value


def _matching(value: object, field: str, pattern: re.Pattern[str], expected: str) -> Source:
    # type(...) is str: a str subclass could render other text than the one checked
    if type(value) is not str or pattern.fullmatch(value) is None:
        raise ValueError(f"plan.{field}: expected {expected}, got {_shown(value)}")
    return Source(value)


def _identifier(value: object, field: str) -> Source:
    if type(value) is str and len(value) > MAX_IDENTIFIER_LENGTH:
        raise ValueError(f"plan.{field}: expected at most {MAX_IDENTIFIER_LENGTH} characters, got {len(value)}")
    return _matching(value, field, _IDENTIFIER, "an identifier matching ^[a-z][a-z0-9_]*$")


def _choice(value: object, field: str, allowed: tuple[str, ...]) -> Source:
    if type(value) is not str or value not in allowed:
        raise ValueError(f"plan.{field}: expected one of {', '.join(allowed)}, got {_shown(value)}")
    return Source(value)


def _scale_literal(text: object) -> Source:
    """The string literal of τ's expression in normal form: the expression's syntax tree written out again, so
    that comments, layout and anything else the parser skips are gone; it must parse back to the same expression."""
    if type(text) is not str or not 0 < len(text) <= MAX_SCALE_LENGTH:
        raise ValueError(
            f"plan.scale: expected an expression of 1 to {MAX_SCALE_LENGTH} characters, got {_shown(text)}"
        )
    try:
        with SYNTAX_TREES:
            canonical = ast.unparse(ast.parse(text.strip(), mode="eval"))
        same = parse_expression(canonical, ("d",)) == parse_expression(text, ("d",))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as err:
        raise ValueError(f"plan.scale: not an expression in d ({type(err).__name__}), got {_shown(text)}") from None
    if not same or _SCALE.fullmatch(canonical) is None:
        raise ValueError(f"plan.scale: no canonical form, got {_shown(text)}")
    return Source(f'"{canonical}"')  # the literal: _SCALE admits no quote, backslash or line break


@dataclass(frozen=True)
class PlanValues(HasTerms):
    """The Plan as the template sees it: each field it reads, checked again here and held as a canonical value."""

    spec_name: Source
    spec_hash: Source
    seq_len: int
    map_kind: Source
    terms: tuple[Source, ...]
    causal: bool
    heads_share_tables: bool
    scale_literal: Source  # a Python string literal
    rows: int
    length_dependent: bool
    path: Source
    saturation_low: int
    saturation_high: int
    saturation_proven: bool
    copy_map: tuple[int, ...]
    copy_is_identity: bool
    relations: Source
    projections: Source
    plan_summary: Source
    local_left: int | None = None
    local_right: int | None = None

    def summary(self) -> Source:
        return self.plan_summary

    @property
    def has_local_window(self) -> bool:
        return self.local_left is not None or self.local_right is not None

    @classmethod
    def of(cls, plan: Plan) -> PlanValues:
        """Raises ValueError naming the first field that is not what analyze() makes."""
        terms = plan.terms
        if type(terms) is not tuple or not terms or terms != tuple(t for t in TERM_ORDER if t in terms):
            raise ValueError(
                f"plan.terms: expected distinct terms of {', '.join(TERM_ORDER)} in that order, got {_shown(terms)}"
            )
        rows = _integer(plan.rows, "rows", 1)
        low, high = _integer(plan.saturation_low, "saturation_low"), _integer(plan.saturation_high, "saturation_high")
        if high < low:
            raise ValueError(f"plan.saturation_high: expected ≥ saturation_low = {low}, got {high}")
        copy_map = plan.copy_map
        if type(copy_map) is not tuple or len(copy_map) != high - low + 1:
            raise ValueError(f"plan.copy_map: expected a tuple of {high - low + 1} rows, got {_shown(copy_map)}")
        copy_map = tuple(_integer(row, "copy_map", 0) for row in copy_map)
        if max(copy_map) >= rows:
            raise ValueError(f"plan.copy_map: expected rows < rows = {rows}, got {max(copy_map)}")
        values = dict(
            spec_name=_identifier(plan.spec_name, "spec_name"),
            spec_hash=_matching(plan.spec_hash, "spec_hash", _SPEC_HASH, "16 hexadecimal digits"),
            seq_len=_integer(plan.seq_len, "seq_len", 1),
            map_kind=_identifier(plan.map_kind, "map_kind"),
            terms=tuple(_choice(t, "terms", TERM_ORDER) for t in terms),
            causal=_flag(plan.causal, "causal"),
            heads_share_tables=_flag(plan.heads_share_tables, "heads_share_tables"),
            scale_literal=_scale_literal(plan.scale),
            rows=rows,
            length_dependent=_flag(plan.length_dependent, "length_dependent"),
            path=_choice(plan.path, "path", typing.get_args(GradientPath)),
            saturation_low=low,
            saturation_high=high,
            saturation_proven=_flag(plan.saturation_proven, "saturation_proven"),
            copy_map=copy_map,
            copy_is_identity=_flag(plan.copy_is_identity, "copy_is_identity"),
            relations=_choice(plan.relations, "relations", typing.get_args(Relations)),
            projections=_choice(plan.projections, "projections", typing.get_args(Projections)),
        )
        for side in ("local_left", "local_right"):
            bound = getattr(plan, side)
            values[side] = None if bound is None else _integer(bound, side, 0)
        # the summary is made of the fields checked above; checked again as text (Plan.summary may change)
        summary = _matching(plan.summary(), "summary()", _SUMMARY, "one line of names, numbers and brackets")
        return cls(**values, plan_summary=summary)


#: The Plan's fields that the generated module's `PLAN` (relgen.runtime.geometry.PlanInfo) holds, under the Plan's
#: names and with its values, but for two forms: `scale` is the expression in its normal form, and a length-dependent
#: map's `copy_map` is "identity" or "reversed", β(s) = (R − 1)/2 ± (s + L) at every length, where the Plan holds β
#: at its own length.
PLAN_INFO_FIELDS = (
    "spec_name",
    "terms",
    "causal",
    "heads_share_tables",
    "scale",
    "length_dependent",
    "rows",
    "saturation_low",
    "saturation_high",
    "copy_map",
    "path",
    "projections",
    "relations",
    "local_left",
    "local_right",
)
#: What PlanInfo holds beyond the Plan's fields, derived from them: `fold`, (first column, count) of each row's run of
#: copies (None where no fold is needed), and `valid_up_to`, the length the plan was made for when the map's
#: saturation is not proven beyond it (None when it holds at every length).
PLAN_INFO_DERIVED = ("fold", "valid_up_to")


def plan_info(values: PlanValues) -> tuple[tuple[Source, Source], ...]:
    """The keywords and literals of the generated module's `PLAN = _rt.PlanInfo(...)`: PLAN_INFO_FIELDS, read from the
    checked values by name, then PLAN_INFO_DERIVED."""
    valid_up_to = None if values.saturation_proven or values.length_dependent else values.seq_len
    literals = {
        "scale": values.scale_literal,
        "copy_map": _copy_map_literal(values),
        "fold": _fold_literal(values),
        "valid_up_to": _literal(valid_up_to, "valid_up_to"),
    }
    return tuple(
        (Source(name), literals[name] if name in literals else _literal(getattr(values, name), name))
        for name in (*PLAN_INFO_FIELDS, *PLAN_INFO_DERIVED)
    )


def _literal(value: object, field: str) -> Source:
    """The Python literal of a checked value: an int, a bool, None, an identifier or fixed choice (PlanValues made
    it a Source matching _IDENTIFIER, so quoting it is its literal), or a tuple of those."""
    if value is None or type(value) in (bool, int):
        return Source(repr(value))
    if isinstance(value, Source) and _IDENTIFIER.fullmatch(value):
        return Source(f'"{value}"')
    if type(value) is tuple and value and all(type(item) is int for item in value):
        return _tuple_literal(list(value))
    if type(value) is tuple:
        return Source("(" + "".join(f"{_literal(item, field)}, " for item in value).rstrip() + ")")
    raise ValueError(
        f"plan.{field}: expected an int, a bool, None, an identifier or a tuple of them, got {_shown(value)}"
    )


@dataclass(frozen=True)
class GenerationFlags:
    reads_zq: bool  # Z̃^Q is stored (query term; b folded in when present)
    reads_zk: bool  # Z̃^K is stored (key term)
    # "none", "folded_query", "folded_key" or "vector" (b̃ read per score: bias-only schemes, in-tile products)
    bias_mode: Source
    dz_query: bool  # the query-parallel pass writes dZ̃^Q
    dz_key: bool  # the key-parallel pass writes dZ̃^K
    saturates: bool  # band tiles may hold offsets beyond [L, U] (every map but identity's)
    in_tile: bool  # relation products formed per band tile from Ã (ablation no_projections), not read from Z̃
    by_row: bool  # projections stored per table row and read at β(s(δ)) (ablation no_bucket_copies)
    # the forward's programs write their own rows of Z̃^Q ahead of their key tiles instead of a projection launch
    # (saturating maps only: a row's window is at most C columns, where an unbounded map's grows with N)
    fused_zq: bool
    # band runs split off their interior tiles (kind INNER: no predicates, end terms or boundary sums) where a band
    # score gathers a projection; a bias-only band reads one cached b̃ value per score, and on the H200 the split's
    # extra loops cost T5 3-12% in the backward (docs/performance.md)
    inner_runs: bool
    # the forward's edge band tiles read their entries at the clamped column (the clip inside s(δ)), with no pair
    # mask and no end term, where every term is a query-side run (Z̃^Q, b̃) of a saturating map. Clamping hides a
    # run's contiguity from the compiler, which costs the key side's runs along the queries, and the backward
    # computes the pair masks for its dZ̃ anyway: clamped everywhere, DeBERTa's and TXL's backwards were 3-9 %
    # slower on the H200. Forward only (H200, fp16): Shaw −3 % at 512, −2 % at 1K, within noise at 8K; T5 −3 % at
    # 8K (docs/performance.md)
    clip_band: bool
    # the forward's band tiles skip the multiplication of each gathered Z̃ entry by its buffer's 2^s where s = 0
    # (every input whose Z̃ fits fp16), a branch per tile that the whole program takes alike, where a score gathers
    # one projection. A score that gathers both (query and key terms) multiplies: its two branches cost more than
    # the multiplications (H100, DeBERTa 1K: forward kernel 806-808 µs with the branches, 777-779 without; TXL 8K,
    # one gather: 2167 with, 2219 without; docs/performance.md)
    skip_unit_scale: bool
    end_terms: Source  # the relation terms at one end column: query, key and b̃ parts (kernel `_end_terms`)
    end_shift: Source  # their per-query part: query and b̃ (kernel `_end_shift`; "0.0" when there is none)
    bias_from: Source | None  # which dZ̃ yields db
    formula: Source
    # the local window's bounds the kernels test (δ ≤ local_left, δ ≥ −local_right); None: unbounded, or (right)
    # causal, whose own mask is tighter
    local_left: int | None
    local_right: int | None

    @property
    def local_window(self) -> bool:
        """The kernels bound their runs of tiles by a local window (causal alone keeps the plain runs)."""
        return self.local_left is not None or self.local_right is not None

    @classmethod
    def from_plan(cls, plan: Plan | PlanValues) -> GenerationFlags:
        values = plan if isinstance(plan, PlanValues) else PlanValues.of(plan)
        in_tile = values.relations == "in_tile"
        if not values.has_bias:
            bias_mode = "none"
        elif in_tile:  # no projection to fold b̃ into: every band score reads b̃_s, as a bias-only scheme's does
            bias_mode = "vector"
        elif values.has_query:
            bias_mode = "folded_query"
        elif values.has_key:
            bias_mode = "folded_key"
        else:
            bias_mode = "vector"
        bias_from = {"folded_query": "query", "vector": "query", "folded_key": "key"}.get(bias_mode)
        bias_from = None if bias_from is None else Source(bias_from)
        terms = {"query": "q·a^Q_φ", "key": "k·a^K_φ", "bias": "b_φ"}
        # a windowed identity map expands only the window's offsets: pairs beyond them (all masked) then read the
        # end columns like a saturating map's
        saturates = not values.length_dependent or values.has_local_window
        by_row = values.projections == "by_row"
        by_offset = not in_tile and not by_row  # band tiles read stored projections at their offset's column
        return cls(
            reads_zq=values.has_query,
            reads_zk=values.has_key,
            bias_mode=Source(bias_mode),
            dz_query=values.has_query or bias_from == "query",
            dz_key=values.has_key,
            saturates=saturates,
            in_tile=in_tile,
            by_row=by_row,
            fused_zq=values.has_query and not values.length_dependent and by_offset,
            inner_runs=values.has_query or values.has_key,
            clip_band=saturates and not values.has_key and by_offset,
            skip_unit_scale=not (values.has_query and values.has_key),
            end_terms=_joined(
                part
                for part, present in (
                    ("_along_queries(row_end, KEY_MAJOR)", values.has_query),
                    ("_along_keys(col_end, KEY_MAJOR)", values.has_key),
                    ("b_end", bias_mode == "vector"),
                )
                if present
            ),
            end_shift=_joined(
                part for part, present in (("row_end", values.has_query), ("b_end", bias_mode == "vector")) if present
            )
            or Source("0.0"),
            bias_from=bias_from,
            formula=_joined(terms[t] for t in values.terms),
            local_left=values.local_left,
            local_right=None if values.causal else values.local_right,
        )


def _joined(parts: typing.Iterable[str]) -> Source:
    """Fixed code fragments (the literals of this module) joined by " + "."""
    return Source(" + ".join(parts))


def _tuple_literal(items: list[int] | list[tuple[int, int]], indent: int = 8, width: int = 116) -> Source:
    """A tuple literal of ints (or of int pairs) wrapped into lines of at most `width` characters (the module
    keeps it `fmt: off`)."""
    if not items:
        return Source("()")
    lines, line = [], ""
    for item in items:
        piece = f"({item[0]:d}, {item[1]:d}), " if isinstance(item, tuple) else f"{item:d}, "
        if line and indent + len(line) + len(piece) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece
    lines.append(line.rstrip())
    pad = " " * indent
    return Source("(\n" + "\n".join(pad + text for text in lines) + "\n" + " " * (indent - 4) + ")")


def _copy_map_literal(plan: PlanValues) -> Source:
    """β as the module stores it: 'identity'/'reversed' for identity maps (their C grows with N), else a tuple."""
    beta = plan.copy_map
    if plan.length_dependent:
        return Source('"reversed"' if len(beta) > 1 and beta[0] > beta[-1] else '"identity"')
    return _tuple_literal(list(beta))


def _fold_literal(plan: PlanValues) -> Source:
    """(first column, count) of each row's run of copies, or None when no fold is needed."""
    if plan.path == "atomic" or plan.length_dependent or plan.copy_is_identity:
        return Source("None")
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for s, row in enumerate(plan.copy_map):
        first.setdefault(row, s)
        count[row] = count.get(row, 0) + 1
    return _tuple_literal([(first.get(r, 0), count.get(r, 0)) for r in range(plan.rows)])


def _template_dir() -> Path:
    """templates/ beside the package: inside it in a wheel (relgen/templates), or at the top of a source tree."""
    package = Path(__file__).resolve().parents[1]  # relgen/
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / TEMPLATE).exists():
            return candidate
    raise FileNotFoundError(f"{TEMPLATE} not found beside {package}: is the package installed with its templates?")


class _Environment(jinja2.Environment):
    # what a macro, a block or the whole template returns: template text joined with values _finalize accepted
    concat = staticmethod(lambda parts: Source("".join(parts)))


def _finalize(template_strings: frozenset[str], value: object) -> str:
    """What a template expression may render: text built here (Source), an int, a bool, None, or a string the
    template itself spells out (a code fragment chosen by a condition). Anything else is refused."""
    if isinstance(value, Source):
        return value
    if type(value) in (bool, int) or value is None:
        return str(value)
    if type(value) is str and value in template_strings:
        return value
    if isinstance(value, jinja2.Undefined):  # an inline if without else renders "", a missing name raises
        return str(value)
    raise ValueError(
        f"{TEMPLATE}: an expression renders {type(value).__name__} {_shown(value)}: the template may "
        "only render codegen.Source text, ints, bools and None"
    )


@functools.lru_cache(maxsize=4)
def template(source: str, name: str = TEMPLATE, parts: tuple[tuple[str, str], ...] = ()) -> jinja2.Template:
    """The template of `source` under the rules of _finalize (compiled once per source text); `parts`: the
    (name, source) of each template it includes (templates/parts/*.j2), whose spelled-out strings it may render
    too."""
    sources = {name: source, **dict(parts)}
    env = _Environment(
        loader=jinja2.DictLoader(sources),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    constants = (n.value for text in sources.values() for n in env.parse(text).find_all(jinja2.nodes.Const))
    strings = frozenset(value for value in constants if type(value) is str)
    env.finalize = functools.partial(_finalize, strings)
    return env.get_template(name)


def template_parts() -> tuple[tuple[str, str], ...]:
    """(name, source) of every part the module template includes: one file per kernel family and the host glue."""
    root = _template_dir()
    return tuple(
        (path.relative_to(root).as_posix(), path.read_text(encoding="utf-8"))
        for path in sorted((root / PARTS).glob("*.j2"))
    )


def render(plan: Plan) -> str:
    """The generated module's source for `plan` (unformatted). Raises ValueError for a plan whose values are not
    what analyze() makes (see PlanValues)."""
    values = PlanValues.of(plan)
    gen = GenerationFlags.from_plan(values)
    version = _matching(__version__, "relgen.__version__", _VERSION, "a version number")
    source = (_template_dir() / TEMPLATE).read_text(encoding="utf-8")
    rendered = template(source, TEMPLATE, template_parts()).render(
        plan=values, gen=gen, plan_info=plan_info(values), version=version
    )
    return str(rendered)


def format_source(source: str) -> str:
    """Format with ruff when it is installed (builds are formatted; the runtime cache need not be)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        return source
    done = subprocess.run(
        [ruff, "format", "--line-length", "120", "--stdin-filename", "generated.py", "-"],
        input=source,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout if done.returncode == 0 else source


def build(spec_source, out_dir: str | Path = "generated") -> Path:
    """Write the formatted module of `spec_source` (planned at its canonical length) into `out_dir`."""
    return write_module(analyze(load_spec(spec_source)), out_dir)


def write_module(plan: Plan, out_dir: str | Path) -> Path:
    """Write the formatted module of `plan` as `out_dir`/<spec name>.py, creating `out_dir` if needed. The file
    is replaced in one step: a reader (or a second build) sees the old module or the new one, never a part."""
    source = format_source(render(plan))
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file of that name: mkdir would only say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out)) from None
    path = out / f"{PlanValues.of(plan).spec_name}.py"
    _write_atomically(path, source)
    return path


def _write_atomically(path: Path, text: str) -> None:
    # a fresh name in the same folder (O_EXCL: never through a file or link already there), renamed over `path`
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
