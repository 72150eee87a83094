"""The commands that run kernels or write files, imported only when their subcommand runs (they pull in jinja,
torch and triton): `relgen build` (relgen.codegen) and `relgen check` (relgen.check)."""

from __future__ import annotations

import argparse
import sys
import time

from relgen import codegen
from relgen.cli import main as cli


def cli_build(args) -> int:
    """`relgen build SPEC... [-o DIR]`: a spec that cannot be loaded, analyzed or generated is reported (one line)
    and the others are still built, exit status 2; a folder or file that cannot be written stops the command."""
    status = 0
    for source in args.specs:
        try:
            _, plan = cli._analyze(source, None)
            codegen.PlanValues.of(plan)
        except (ValueError, NotImplementedError) as err:
            status = cli._error(str(err) if str(err).startswith(source) else f"{source}: {err}")
            continue
        try:
            path = codegen.write_module(plan, args.out)
        except OSError as err:
            raise cli.CommandError(f"--out: cannot write the module of {source}: {cli.os_error_text(err)}") from None
        print(f"wrote {path}")
    return status


def cli_check(args: argparse.Namespace) -> int:
    """`relgen check SPEC... [--seq-len N ...]`: exit 0 if every tensor passes, 1 if any fails (or a run raises),
    else 2 if a spec cannot be loaded or analyzed or a check is not run (each reported, the other specs are still
    checked)."""
    from relgen.check.verify import (
        DEFAULT_SEQ_LENS,
        DTYPES,
        MAX_CHECK_SEQ_LEN,
        CheckResult,
        check_spec,
        default_device,
        format_table,
    )
    from relgen.runtime.arguments import SUPPORTED_HEAD_DIMS

    seq_lens = tuple(getattr(args, "seq_len", None) or DEFAULT_SEQ_LENS)
    bad = [n for n in seq_lens if not 1 <= n <= MAX_CHECK_SEQ_LEN]
    if bad:
        raise ValueError(
            f"--seq-len: expected lengths from 1 to {MAX_CHECK_SEQ_LEN} (the FP64 reference holds every score), "
            f"got {bad[0]}"
        )
    dtype_name = getattr(args, "dtype", None)
    dtype = DTYPES[dtype_name] if dtype_name else None
    head_dim = getattr(args, "head_dim", None)
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"--head-dim: expected one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))}, got {head_dim}")
    device = default_device()
    failures = refusals = False
    started = time.perf_counter()
    for path in args.specs:
        try:
            spec, plan = cli._analyze(path, None)
            codegen.PlanValues.of(plan)  # a plan code generation refuses is the spec's problem, not a kernel's
        except (ValueError, NotImplementedError) as err:
            cli._error(str(err) if str(err).startswith(path) else f"{path}: {err}")
            refusals = True
            continue
        t0 = time.perf_counter()
        results: list[CheckResult] = []
        errors: list[str] = []
        not_run: dict[str, list[int]] = {}  # reason → lengths
        for n in seq_lens:
            try:
                results.extend(check_spec(spec, (n,), device=device, dtype=dtype, head_dim=head_dim))
            except NotImplementedError as err:  # unsupported here: neither a pass nor a failure
                not_run.setdefault(cli._one_line(str(err)), []).append(n)
            except Exception as err:  # a kernel that does not compile or run: a failure, not a crash
                errors.append(f"N={n}: {type(err).__name__}: {cli._one_line(str(err))}")
        failed = [r for r in results if not r.ok]
        if results:
            r = results[0]
            setting = f"{r.device}, {r.dtype}, d={r.head_dim}, batch 1, 2 heads"
        else:
            setting = f"{device}, {dtype_name}" if dtype_name else str(device)
        passed = len(results) - len(failed)
        verdict = "FAILED" if failed or errors else ("INCOMPLETE" if results else "NOT RUN") if not_run else "ok"
        print(f"{verdict}  {path}  {spec.name}  ({setting})  rel-l2 vs FP64 reference")
        if results:
            print("\n".join(format_table(results)))
        for r in failed:
            print(f"  FAIL N={r.seq_len} {r.tensor}: {r.message}")
        for line in errors:
            print(f"  ERROR {line}")
        for reason, lengths in not_run.items():
            print(f"  NOT RUN N={', '.join(map(str, lengths))}: {reason}")
        extra = f", {len(errors)} lengths raised" if errors else ""
        extra += f", {sum(map(len, not_run.values()))} lengths not run" if not_run else ""
        print(f"  {passed}/{len(results)} tensors passed{extra}  ({time.perf_counter() - t0:.1f} s)")
        sys.stdout.flush()
        failures = failures or bool(failed or errors)
        refusals = refusals or bool(not_run)
    if len(args.specs) > 1:
        print(f"total {time.perf_counter() - started:.1f} s")
    return 1 if failures else cli.EXIT_ERROR if refusals else 0
