"""The `relgen` command line.

    relgen explain SPEC [--seq-len N] [--json]     the analyzer's Plan as a table (or JSON), and the memory of the
        [--batch B --heads H --head-dim D            relation products stored or formed in the tiles, with which one
         --dtype fp16 --budget BYTES]                projections="auto" runs (relgen.runtime.memory)
    relgen validate SPEC...                        load and analyze each spec, one line per spec
    relgen build SPEC... [-o DIR]                  write the generated modules        (relgen.cli.commands.cli_build)
    relgen check SPEC... [--seq-len N ...]         kernels against the FP64 reference (relgen.cli.commands.cli_check)
    relgen tune SPEC... [--out PATH]               tile configurations, CUDA only     (relgen.cli.tune.cli_tune)
    relgen warmup SPEC... [--dtype fp16] [--head-dim 64]   compile ahead of time      (relgen.cli.tune.cli_warmup)
    relgen bench ...                               passed through to relgen.bench.cli.main

A bad spec, a bad argument or a file that cannot be read or written ends the command with one line on stderr,
``relgen: error: <message>`` naming the file or argument, and exit status 2; never a traceback. An unexpected
exception (a bug in relgen) is one line ``relgen: internal error: ...`` and exit status 1 (RELGEN_TRACEBACK=1
re-raises it, traceback included).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relgen import __version__
from relgen.plan.analyze import Plan, analyze, local_window_text
from relgen.spec.model import MechanismSpec, SpecError, load_spec

#: Exit status of a command stopped by a bad spec, a bad argument or a missing subcommand.
EXIT_ERROR = 2
#: Exit status of an unexpected exception (a bug in relgen, not in its input).
EXIT_INTERNAL = 1
DEFAULT_SEQ_LEN = 1024
#: Longest sequence length the commands accept, the analyzer's own bound (its arrays grow with N): larger values are
#: refused while the arguments are read, rather than left to run out of memory.
MAX_SEQ_LEN = 1 << 17
DTYPE_CHOICES = ("fp16", "bf16", "fp32")
#: explain's heads when not given (specs do not fix a head count): BERT-base's and Conformer-L's 12
DEFAULT_HEADS = 12
#: the largest batch size or head count explain's --batch and --heads accept
MAX_COUNT = 1 << 16

#: Subcommands implemented elsewhere: name → (module, function). Each function takes the argparse Namespace and
#: returns an exit status. They are imported only when their subcommand runs (they pull in triton).
HOOKS: dict[str, tuple[str, str]] = {
    "build": ("relgen.cli.commands", "cli_build"),
    "check": ("relgen.cli.commands", "cli_check"),
    "tune": ("relgen.cli.tune", "cli_tune"),
    "warmup": ("relgen.cli.tune", "cli_warmup"),
}
BENCH_MODULE = "relgen.bench.cli"


class CommandError(Exception):
    """A problem to report as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as CommandError: one line (with the usage folded in), not usage + message."""

    def error(self, message: str) -> typing.NoReturn:
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise CommandError(f"{message} (usage: {usage})")


def _bucket_lengths(parser: argparse.ArgumentParser) -> None:
    """--seq-lens of the commands that default to every tuning bucket (tune, warmup)."""
    parser.add_argument(
        "--seq-lens",
        type=_seq_len,
        nargs="+",
        default=None,
        metavar="N",
        help="sequence lengths (default: every bucket)",
    )


def _count(text: str) -> int:
    """An argparse type: a batch size or head count in [1, MAX_COUNT]."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_COUNT}, got {text[:40]!r}")
    return value


def _seq_len(text: str) -> int:
    """An argparse type: a sequence length in [1, MAX_SEQ_LEN]."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_SEQ_LEN:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_SEQ_LEN}, got {text[:40]!r}")
    return value


# ------------------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script passes it to sys.exit)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            if args_list[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark's own parser
                return _bench(args_list[1:])
            args = build_parser().parse_args(args_list)
        except SystemExit as stop:  # argparse: --help or --version (usage errors are CommandError)
            return _exit_code(stop.code)
        return int(args.handler(args) or 0)
    except BrokenPipeError:  # e.g. `relgen explain --json ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (ValueError, CommandError, NotImplementedError) as err:  # SpecError is a ValueError
        return _error(str(err))
    except OSError as err:
        return _error(os_error_text(err))
    except RecursionError:
        return _error("input nested too deeply (maximum recursion depth exceeded)")
    except MemoryError:
        return _error("out of memory: the input asks for more than this machine has")
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if os.environ.get("RELGEN_TRACEBACK"):
            raise
        print(f"relgen: internal error: {_one_line(f'{type(err).__name__}: {err}')}", file=sys.stderr)
        return EXIT_INTERNAL


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="relgen",
        description="A compiler for relative-position attention: exact fused Triton kernels from a short spec.",
    )
    parser.add_argument("--version", action="version", version=f"relgen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("explain", help="show the analyzer's plan for a spec")
    p.add_argument("spec", metavar="SPEC", help="YAML spec file")
    p.add_argument(
        "--seq-len",
        type=_seq_len,
        default=DEFAULT_SEQ_LEN,
        metavar="N",
        help=f"sequence length (default {DEFAULT_SEQ_LEN})",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    # the call whose projections' memory explain reports (relgen.runtime.memory)
    p.add_argument("--batch", type=_count, default=1, metavar="B", help="batch size (default 1)")
    p.add_argument("--heads", type=_count, default=DEFAULT_HEADS, metavar="H", help=f"heads (default {DEFAULT_HEADS})")
    p.add_argument("--head-dim", type=int, default=64, metavar="D", help="head dimension (default 64)")
    p.add_argument("--dtype", default="fp16", choices=DTYPE_CHOICES, help="input dtype (default fp16)")
    p.add_argument(
        "--budget",
        default=None,
        metavar="BYTES",
        help="the projections' memory budget, e.g. 20GiB (default: relgen's for this machine)",
    )
    p.set_defaults(handler=cmd_explain)

    p = sub.add_parser("validate", help="load and analyze specs")
    p.add_argument("specs", metavar="SPEC", nargs="+", help="YAML spec files")
    p.add_argument(
        "--seq-len", type=_seq_len, default=None, metavar="N", help="sequence length (default: the canonical length)"
    )
    p.set_defaults(handler=cmd_validate)

    # -- hooks: subcommands implemented in relgen.cli.commands / relgen.cli.tune (see HOOKS) ---------------------------
    p = sub.add_parser("build", help="write the generated kernel modules")
    p.add_argument("specs", metavar="SPEC", nargs="+", help="YAML spec files")
    p.add_argument("-o", "--out", default="generated", metavar="DIR", help="output folder (default: generated)")
    p.set_defaults(handler=_hook("build"))

    p = sub.add_parser("check", help="compare each spec's kernels with the FP64 reference")
    p.add_argument("specs", metavar="SPEC", nargs="+", help="YAML spec files")
    p.add_argument(
        "--seq-len",
        type=_seq_len,
        nargs="+",
        default=None,
        metavar="N",
        help="sequence lengths to check (default 1 17 130)",
    )
    p.add_argument(
        "--dtype", default=None, choices=DTYPE_CHOICES, help="input dtype (default: fp32 on the CPU, fp16 on a GPU)"
    )
    p.add_argument("--head-dim", type=int, default=None, metavar="D", help="head dimension (default: 16 CPU, 64 GPU)")
    p.set_defaults(handler=_hook("check"))

    p = sub.add_parser("tune", help="tune tile configurations (needs a CUDA GPU)")
    p.add_argument("specs", metavar="SPEC", nargs="+", help="YAML spec files")
    p.add_argument(
        "--out", default=None, metavar="PATH", help="table to write (default relgen/tiles/tuning_tables/smXY.json)"
    )
    _bucket_lengths(p)
    p.add_argument("--dtype", default="fp16", choices=DTYPE_CHOICES, help="input dtype (default fp16)")
    p.add_argument("--head-dim", type=int, default=64, metavar="D", help="head dimension (default 64)")
    p.add_argument(
        "--budget-s", type=float, default=None, metavar="S", help="stop cleanly after about S seconds (keeps results)"
    )
    p.add_argument("--resume", action="store_true", help="skip entries already in the table")
    p.set_defaults(handler=_hook("tune"))

    p = sub.add_parser("warmup", help="compile the kernels ahead of time (needs a CUDA GPU)")
    p.add_argument("specs", metavar="SPEC", nargs="+", help="YAML spec files")
    p.add_argument("--dtype", default="fp16", choices=DTYPE_CHOICES, help="input dtype (default fp16)")
    p.add_argument("--head-dim", type=int, default=64, metavar="D", help="head dimension (default 64)")
    _bucket_lengths(p)
    p.set_defaults(handler=_hook("warmup"))

    # listed for --help only: main() hands `bench ...` to relgen.bench.cli before argparse sees it
    sub.add_parser("bench", help="benchmarks (relgen bench --help)", add_help=False)
    return parser


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _error(message: str) -> int:
    print(f"relgen: error: {_one_line(message)}", file=sys.stderr)
    return EXIT_ERROR


def _printable(text: str) -> str:
    """`text` with each control or other unprintable character (a terminal escape, NUL, U+2028) as a space."""
    return "".join(c if c.isprintable() or c in "\n\t" else " " for c in text)


def _one_line(text: str) -> str:
    return " ".join(_printable(text).split())


def os_error_text(err: OSError) -> str:
    """An OSError as '<file>: <reason>' (both files of a rename), or its own text when it names no file."""
    if err.strerror and err.filename is not None:
        names = f"{err.filename} -> {err.filename2}" if err.filename2 is not None else f"{err.filename}"
        return f"{names}: {err.strerror}"
    return str(err) or type(err).__name__


# ------------------------------------------------------------------------------------------------------------
# explain / validate
# ------------------------------------------------------------------------------------------------------------
def _load(path: str) -> MechanismSpec:
    return load_spec(Path(path))


def _analyze(path: str, seq_len: int | None) -> tuple[MechanismSpec, Plan]:
    """The spec at `path` and its plan; every problem of the spec as SpecError (or NotImplementedError) whose
    message starts with `path`."""
    try:
        spec = _load(path)
        return spec, analyze(spec, seq_len)
    except (ValueError, NotImplementedError) as err:  # analysis errors do not name the file: add it
        message = str(err) if str(err).startswith(path) else f"{path}: {err}"
        raise (NotImplementedError if isinstance(err, NotImplementedError) else SpecError)(message) from None
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply to load or analyze (maximum recursion depth exceeded)") from None
    except MemoryError:
        raise SpecError(f"{path}: too large to load or analyze (out of memory)") from None


def cmd_explain(args: argparse.Namespace) -> int:
    spec, plan = _analyze(args.spec, args.seq_len)
    report = projection_report(spec, plan, args.batch, args.heads, args.head_dim, args.dtype, args.budget)
    if args.json:
        print(json.dumps({**plan.to_json(), "projection_memory": report}))
    else:
        print(explain_text(spec, plan) + "\n" + "\n".join(projection_lines(report)))
    return 0


def projection_report(
    spec: MechanismSpec, plan: Plan, batch: int, heads: int, head_dim: int, dtype: str, budget: str | None
) -> dict[str, Any]:
    """The memory of each strategy for the relation products (relgen.runtime.memory) of a dense call of
    plan.seq_len queries and keys without offsets, and which one projections="auto" runs, forward alone and with
    a backward: the call's own functions at the kernels' group size on a GPU (the plan's G)."""
    _interpret_without_gpu()
    import torch

    from relgen.runtime import memory
    from relgen.runtime.arguments import SUPPORTED_HEAD_DIMS, admitted_reach
    from relgen.runtime.mechanism import compile_mechanism

    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"--head-dim: expected a multiple of 8 from 16 to 256, got {head_dim}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    limit = memory.parse_budget(budget, "--budget") if budget is not None else memory.projection_budget(device)
    n = plan.seq_len
    mechanism = compile_mechanism(spec)
    info = mechanism.module_for(admitted_reach(mechanism.module.PLAN, -(n - 1), n - 1)).PLAN
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    geo = memory.dense_geometry(
        info, batch=batch, heads=heads, nq=n, nk=n, head_dim=head_dim, dtype=torch_dtype, group=plan.group_size
    )
    cost = memory.projection_memory(geo)
    projects = plan.has_query or plan.has_key
    refusal = memory.in_tile_refusal(info, compiling=False)
    runs = {
        phase: memory.resolve_strategy(
            "auto", projects, refusal, lambda backward=backward: memory.auto_strategy(cost, limit, backward, geo)
        )
        for phase, backward in (("forward", False), ("backward", True))
    }
    tiled = None if not projects or refusal else {"forward": cost.tiled_forward, "backward": cost.tiled_backward}
    if not projects:
        refusal = "the spec has no query or key term, so nothing is stored: 'tiled' runs the stored kernels"
    return {
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "budget": limit,
        "budget_origin": "--budget" if budget is not None else memory.budget_origin(device),
        "stored": {"forward": cost.stored_forward, "backward": cost.stored_backward},
        "tiled": tiled,
        "tiled_refusal": refusal,
        "runs": runs,
    }


def cmd_validate(args: argparse.Namespace) -> int:
    status = 0
    for path in args.specs:
        try:
            _, plan = _analyze(path, args.seq_len)
        except (ValueError, NotImplementedError) as err:
            status = _error(str(err))
            continue
        print(f"ok  {path}  {plan.summary()}")
    return status


def explain_text(spec: MechanismSpec, plan: Plan) -> str:
    """The plan as a readable table (the spec's own text with its unprintable characters as spaces)."""
    n = plan.seq_len
    lines: list[str] = []

    def row(label: str, value: object) -> None:
        lines.append(f"  {label:<22}{value}")

    lines.append(f"{plan.spec_name} at N = {n}  (spec hash {plan.spec_hash})")
    if spec.description:
        lines.extend(
            textwrap.wrap(_printable(spec.description), width=110, initial_indent="  ", subsequent_indent="  ")
        )
    lines.append("")
    row("map", _map_text(spec))
    row("terms", " + ".join(_TERM_TEXT[t] for t in plan.terms))
    scale = _one_line(str(spec.scale)) if spec.scale is not None else "1/sqrt(d)"
    row("scale τ", f"{scale}  (= {spec.scale_value(64):.6g} at d = 64)")
    row("causal", "yes" if plan.causal else "no")
    if plan.has_local_window:
        row("local window", _local_window_text(plan))
    row("tables", "one per layer, shared by all heads" if plan.heads_share_tables else "one per head")
    length_note = "  (2N − 1: grows with the sequence length)" if plan.length_dependent else ""
    row("rows R", f"{plan.rows}{length_note}")
    if plan.contiguous:
        row("contiguity", "contiguous: every row covers one interval of offsets δ")
    else:
        split = [s for s in plan.row_spans if not s.contiguous]
        example = split[0]
        spans = ", ".join(f"[{a}, {b}]" for a, b in example.intervals[:4])
        more = ", ..." if len(example.intervals) > 4 else ""
        row(
            "contiguity",
            f"NOT contiguous: {len(split)} rows cover several intervals (row {example.row}: {spans}{more})",
        )
    if plan.path == "offset":
        row("path", "offset: atomic-free backward (one writer per gradient entry), bitwise deterministic")
    else:
        row(
            "path",
            f"{plan.path}: gradients use fp32 atomic adds and are NOT bitwise deterministic (run-to-run differences "
            "at fp32 rounding level)",
        )
    row("saturation low L", f"{plan.saturation_low}  (φ constant on δ ≤ L)")
    row("saturation high U", f"{plan.saturation_high}  (φ constant on δ ≥ U)")
    row("beyond the window", _proof_text(plan))
    row("expanded rows C", f"{plan.expanded_rows}  (= U − L + 1)")
    if plan.copy_is_identity:
        copies = "none: β is the identity, the expanded table is the table itself"
    elif plan.has_copies:
        copies = f"yes: {plan.rows} rows expand to {plan.expanded_rows} columns (β(s) = φ(s + L))"
    else:
        copies = "no: β is one-to-one (a reordering of the rows)"
    row("copies", copies)
    row("row order (by δ)", _abbreviate(plan.row_order))
    row("unreached rows", _abbreviate(plan.unreached_rows) if plan.unreached_rows else "none")
    row("group size G", plan.group_size)
    row("query window W", f"{plan.query_window}  (= min(C, N + G − 1))")
    row("key window", plan.key_window)
    row("groups", f"{plan.groups}  (= ⌈N / G⌉)")
    if plan.cost:
        lines.append("  cost (per batch·head):")
        for key, value in plan.cost.items():
            lines.append(f"    {_COST_TEXT.get(key, key):<32}{_number(value)}")
    return "\n".join(lines)


def projection_lines(report: dict[str, Any]) -> list[str]:
    """projection_report as explain's rows: the call, each strategy's bytes, and what projections="auto" runs."""

    def size(n: int) -> str:
        unit, scale = next(
            ((u, z) for u, z in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)) if n >= z), ("", 1)
        )
        return f"{n} bytes" + (f" ({n / scale:.2f} {unit})" if unit else "")

    def phases(cost: dict[str, int]) -> str:
        return f"forward {size(cost['forward'])}, backward {size(cost['backward'])}"

    r = report
    call = f"B = {r['batch']}, H = {r['heads']}, d = {r['head_dim']}, {r['dtype']}"
    tiled = phases(r["tiled"]) if r["tiled"] is not None else f"not run: {r['tiled_refusal']}"
    runs = r["runs"]
    return [
        f"  {'relation products':<22}{call}; budget {size(r['budget'])}: {r['budget_origin']}",
        f"  {'  stored':<22}{phases(r['stored'])}",
        f"  {'  tiled':<22}{tiled}",
        f"  {'  auto runs':<22}{runs['forward']} (forward alone), {runs['backward']} (forward and backward)",
    ]


_TERM_TEXT = {"query": "query (q_i·a^Q_φ)", "key": "key (k_j·a^K_φ)", "bias": "bias (b_φ)"}
_COST_TEXT = {
    "head_dim": "head dim d",
    "projection_flops": "projection FLOPs",
    "projection_bytes": "stored projections (fp16 bytes)",
    "score_tiles": "live score tiles",
    "band_tile_fraction": "band tile fraction",
}


def _map_text(spec: MechanismSpec) -> str:
    fields = spec.map.model_dump()
    kind = fields.pop("kind")
    params = ", ".join(f"{k}={v}" for k, v in fields.items())
    return _one_line(f"{kind} ({params})" if params else kind)


def _local_window_text(plan: Plan) -> str:
    right_bound = 0 if plan.causal else plan.local_right  # causal admits no key after the query
    left = f"{plan.local_left} before" if plan.local_left is not None else "all before"
    right = f"{right_bound} after" if right_bound is not None else "all after"
    admitted = local_window_text(plan.local_left, right_bound)
    return f"keys {left}, {right} the query: δ ∈ {admitted}; tiles outside it are skipped"


def _proof_text(plan: Plan) -> str:
    if plan.length_dependent:
        return "no: identity map, L = −(N − 1) and U = N − 1 grow with N"
    if plan.saturation_proven:
        return "yes: proven, the bounds hold for every longer sequence"
    return "not proven: the bounds hold within this window only (longer sequences are re-planned)"


def _abbreviate(values: Sequence[int], head: int = 6, tail: int = 3) -> str:
    if len(values) <= head + tail + 1:
        return ", ".join(map(str, values))
    return f"{', '.join(map(str, values[:head]))}, ..., {', '.join(map(str, values[-tail:]))}  ({len(values)} rows)"


def _number(value: float) -> str:
    if float(value).is_integer():
        value = int(value)
        if abs(value) < 10_000:
            return str(value)
        unit, size = next((u, z) for u, z in (("G", 1e9), ("M", 1e6), ("k", 1e3)) if abs(value) >= z)
        return f"{value}  ({value / size:.1f} {unit})"
    return f"{value:.3g}"


# ------------------------------------------------------------------------------------------------------------
# hooks and the bench passthrough
# ------------------------------------------------------------------------------------------------------------
def _hook(command: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        module_name, function_name = HOOKS[command]
        _interpret_without_gpu()
        function = getattr(_import(module_name, command), function_name, None)
        if function is None:
            raise CommandError(f"'relgen {command}' is not available ({module_name}.{function_name} is missing)")
        return int(function(args) or 0)

    return run


def _bench(argv: list[str]) -> int:
    _interpret_without_gpu()
    function = getattr(_import(BENCH_MODULE, "bench"), "main", None)
    if function is None:
        raise CommandError(f"'relgen bench' is not available ({BENCH_MODULE}.main is missing)")
    return int(function(argv) or 0)


def _import(module_name: str, command: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise CommandError(f"'relgen {command}' is not available ({module_name} is missing)") from None
        raise


def _interpret_without_gpu() -> None:
    """Without a CUDA GPU, run kernels in Triton's interpreter (must happen before triton is imported)."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


if __name__ == "__main__":
    sys.exit(main())
