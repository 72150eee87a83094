"""Code generation: Plan → one Python module of Triton kernels and autograd glue (Jinja over templates/).

The Plan is the only input. `GenerationFlags` names the few facts the template branches on, each derived from
the Plan here, so the template itself holds no mechanism knowledge.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jinja2

from relgen import __version__, tuning
from relgen.analyze import Plan, analyze
from relgen.spec import load_spec

TEMPLATE = "mechanism.py.j2"


@dataclass(frozen=True)
class GenerationFlags:
    reads_zq: bool  # Z̃^Q is stored (query term; b folded in when present)
    reads_zk: bool  # Z̃^K is stored (key term)
    bias_mode: str  # "none", "folded_query", "folded_key" or "vector" (bias-only: b̃ read per score)
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
    # extra loops cost T5 3-12% in the backward (benchmarks/results/h200/NOTES.md, sixth session)
    inner_runs: bool
    # the forward's edge band tiles read their entries at the clamped column (the clip inside s(δ)), with no pair
    # mask and no end term, where every term is a query-side run (Z̃^Q, b̃) of a saturating map. Clamping hides a
    # run's contiguity from the compiler, which costs the key side's runs along the queries, and the backward
    # computes the pair masks for its dZ̃ anyway: clamped everywhere, DeBERTa's and TXL's backwards were 3-9 %
    # slower on the H200. Forward only (H200, fp16): Shaw −3 % at 512, −2 % at 1K, within noise at 8K; T5 −3 % at
    # 8K (benchmarks/results/h200/NOTES.md, thirteenth session)
    clip_band: bool
    end_terms: str  # the relation terms at one end column: query, key and b̃ parts (kernel `_end_terms`)
    end_shift: str  # their per-query part: query and b̃ (kernel `_end_shift`; "0.0" when there is none)
    bias_from: str | None  # which dZ̃ yields db
    terms_literal: str
    copy_map_literal: str
    fold_literal: str
    valid_up_to: int | None
    formula: str

    @classmethod
    def from_plan(cls, plan: Plan) -> GenerationFlags:
        if not plan.has_bias:
            bias_mode = "none"
        elif plan.has_query:
            bias_mode = "folded_query"
        elif plan.has_key:
            bias_mode = "folded_key"
        else:
            bias_mode = "vector"
        bias_from = {"folded_query": "query", "vector": "query", "folded_key": "key"}.get(bias_mode)
        terms = {"query": "q·a^Q_φ", "key": "k·a^K_φ", "bias": "b_φ"}
        saturates = not plan.length_dependent
        in_tile = tuning.in_tile(plan)
        by_row = plan.projections == "by_row"
        by_offset = not in_tile and not by_row  # band tiles read stored projections at their offset's column
        return cls(
            reads_zq=plan.has_query,
            reads_zk=plan.has_key,
            bias_mode=bias_mode,
            dz_query=plan.has_query or bias_from == "query",
            dz_key=plan.has_key,
            saturates=saturates,
            in_tile=in_tile,
            by_row=by_row,
            fused_zq=plan.has_query and saturates and by_offset,
            inner_runs=plan.has_query or plan.has_key,
            clip_band=saturates and not plan.has_key and by_offset,
            end_terms=" + ".join(
                part
                for part, present in (
                    ("_along_queries(row_end, KEY_MAJOR)", plan.has_query),
                    ("_along_keys(col_end, KEY_MAJOR)", plan.has_key),
                    ("b_end", bias_mode == "vector"),
                )
                if present
            ),
            end_shift=" + ".join(
                part for part, present in (("row_end", plan.has_query), ("b_end", bias_mode == "vector")) if present
            )
            or "0.0",
            bias_from=bias_from,
            terms_literal="(" + "".join(f'"{t}", ' for t in plan.terms).rstrip() + ")",
            copy_map_literal=_copy_map_literal(plan),
            fold_literal=_fold_literal(plan),
            valid_up_to=None if plan.saturation_proven or plan.length_dependent else plan.seq_len,
            formula=" + ".join(terms[t] for t in plan.terms),
        )


def _tuple_literal(items: list[str], indent: int = 8, width: int = 116) -> str:
    """A tuple literal wrapped into lines of at most `width` characters (the module keeps it `fmt: off`)."""
    if not items:
        return "()"
    lines, line = [], ""
    for item in items:
        piece = f"{item}, "
        if line and indent + len(line) + len(piece) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece
    lines.append(line.rstrip())
    pad = " " * indent
    return "(\n" + "\n".join(pad + text for text in lines) + "\n" + " " * (indent - 4) + ")"


def _copy_map_literal(plan: Plan) -> str:
    """β as the module stores it: 'identity'/'reversed' for identity maps (their C grows with N), else a tuple."""
    beta = plan.copy_map
    if plan.length_dependent:
        return '"reversed"' if len(beta) > 1 and beta[0] > beta[-1] else '"identity"'
    return _tuple_literal([str(b) for b in beta])


def _fold_literal(plan: Plan) -> str:
    """(first column, count) of each row's run of copies, or None when no fold is needed."""
    if plan.path == "atomic" or plan.length_dependent or plan.copy_is_identity:
        return "None"
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for s, row in enumerate(plan.copy_map):
        first.setdefault(row, s)
        count[row] = count.get(row, 0) + 1
    return _tuple_literal([f"({first.get(r, 0)}, {count.get(r, 0)})" for r in range(plan.rows)])


def _template_dir() -> Path:
    """templates/ beside the package: inside it in a wheel (relgen/templates), or at the top of a source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / TEMPLATE).exists():
            return candidate
    raise FileNotFoundError(f"{TEMPLATE} not found beside {here}: is the package installed with its templates?")


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(plan: Plan) -> str:
    """The generated module's source for `plan` (unformatted)."""
    template = _environment().get_template(TEMPLATE)
    return template.render(plan=plan, gen=GenerationFlags.from_plan(plan), version=__version__)


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
    spec = load_spec(spec_source)
    plan = analyze(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{spec.name}.py"
    path.write_text(format_source(render(plan)))
    return path


def cli_build(args) -> int:
    for source in args.specs:
        path = build(source, args.out)
        print(f"wrote {path}")
    return 0
