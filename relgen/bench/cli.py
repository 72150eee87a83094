"""``relgen bench``: relgen's kernels against the strongest peers, the paper's protocol (§5.2, App. D), one run.

The parent process plans the sweep and runs every measurement in a fresh worker process
(``python -m relgen.bench.worker``), systems of each (mechanism, N) in a random order; it merges each record into
``<out>/attention.json`` as soon as it arrives (partial results survive a crash or a lost lease), then writes the
Markdown tables and the plots (relgen.bench.report).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from relgen.bench import common, report
from relgen.bench.common import (
    ABLATIONS,
    BUILT_MARK,
    MECHANISMS,
    PASSES,
    QUICK_SEQ_LENS,
    RECORD_MARK,
    SEQ_LENS,
    START_MARK,
    SYSTEMS,
)

DEFAULT_OUT = "benchmarks/results/h200"
#: Statuses that --resume does not measure again.
FINAL_STATUSES = ("ok", "oom", "unsupported")


def _int_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        factor = 1024 if part.endswith("k") else 1
        values.append(int(part.rstrip("k")) * factor)
    return values


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="relgen bench",
        description="Benchmark relgen's kernels against eager PyTorch, SDPA and FlexAttention (the paper's §5.2).",
    )
    ap.add_argument("--mechanisms", type=_name_list, default=list(MECHANISMS), help="names in specs/ or YAML paths")
    ap.add_argument("--seq-lens", type=_int_list, default=None, help="comma list, e.g. 128,256,1k,8k")
    ap.add_argument("--systems", type=_name_list, default=list(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    ap.add_argument("--passes", type=_name_list, default=list(PASSES), help="fwd,bwd")
    ap.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help="results folder (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=common.TOKENS, help="token budget: B = tokens / N")
    ap.add_argument("--heads", type=int, default=common.HEADS)
    ap.add_argument("--head-dim", type=int, default=common.HEAD_DIM)
    ap.add_argument("--dtype", choices=sorted(common.DTYPES), default="fp16")
    ap.add_argument(
        "--ablation",
        nargs="*",
        default=None,
        metavar="VARIANT",
        help=f"time relgen with one component off (Table 7) instead of the peers; variants: {','.join(ABLATIONS)} "
        "(none given: all); results go to ablation.json",
    )
    ap.add_argument("--quick", action="store_true", help=f"N in {QUICK_SEQ_LENS}, shorter timing")
    ap.add_argument(
        "--process-per",
        choices=("measurement", "group"),
        default="measurement",
        help="fresh process per measurement (the protocol) or one per (mechanism, N) (faster, a documented deviation)",
    )
    ap.add_argument(
        "--flex-mode",
        choices=("max-autotune", "default", "none"),
        default=common.PROTOCOL_COMPILE_MODE,
        help="torch.compile mode of the compiled peers: max-autotune-no-cudagraphs (the paper's), the default mode, "
        "or none (no compilation; debugging only)",
    )
    ap.add_argument("--warmup-ms", type=float, default=None, help="do_bench warmup (default 50, quick 10)")
    ap.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition time (default 100, quick 40)")
    ap.add_argument("--min-reps", type=int, default=10, help="at least this many timed runs (rep is raised)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement before it is killed")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop after this many seconds (the measurement in flight is dropped, not recorded), write the report "
        "and exit 0; with --resume a later run continues where this one stopped",
    )
    ap.add_argument("--no-check", action="store_true", help="skip the FP32 exactness check (records exact: null)")
    ap.add_argument(
        "--check-on-cpu",
        action="store_true",
        help="judge with relgen.testing.check_close itself (float64 on the CPU, seconds per tensor) instead of the "
        "same rule evaluated on the GPU",
    )
    ap.add_argument("--seed", type=int, default=None, help="seed of the random system order (default: random)")
    ap.add_argument(
        "--resume",
        action="store_true",
        help=f"skip measurements already recorded as {FINAL_STATUSES}, or timed out under a limit at least --timeout",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--report-only", action="store_true", help="only rewrite the Markdown and plots from the JSON")
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="merge result files of parallel runs into OUT's results (newest record per measurement wins), then "
        "rewrite the report",
    )
    ap.add_argument("--log-dir", type=Path, default=None, help="worker stderr logs (default: a temporary folder)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: tests of the runner only
    return ap


def data_seed(mechanism: str, seq_len: int) -> int:
    """Inputs depend on (mechanism, N) only, so every system of a group reads the same tensors."""
    return zlib.crc32(f"{mechanism}:{seq_len}".encode()) & 0x7FFFFFFF


def plan(args: argparse.Namespace, order_seed: int) -> list[dict[str, Any]]:
    """One config per (mechanism, N) with its measurements in the order they run."""
    rng = random.Random(order_seed)
    seq_lens = args.seq_lens or (list(QUICK_SEQ_LENS) if args.quick else list(SEQ_LENS))
    variants: list[str | None]
    if args.ablation is not None:
        systems = ["relgen"]
        variants = [None, *(args.ablation or list(ABLATIONS))]
    else:
        systems = list(args.systems)
        variants = [None]
    groups = []
    for mechanism in args.mechanisms:
        spec, source = common.resolve_spec(mechanism)
        name = spec.name if mechanism.endswith((".yaml", ".yml")) else mechanism
        for n in seq_lens:
            entries = [(s, v) for s in systems for v in variants]
            rng.shuffle(entries)  # systems in random order within each mechanism and length
            measurements = []
            for system, variant in entries:
                for pass_ in args.passes:
                    if variant is not None and pass_ not in ABLATIONS[variant]:
                        continue
                    measurements.append({"system": system, "pass": pass_, "variant": variant})
            for i, m in enumerate(measurements):
                m["order"] = i
            groups.append(
                {
                    "mechanism": name,
                    "spec": spec.model_dump(mode="json"),
                    "spec_source": source,
                    "seq_len": n,
                    "batch": common.batch_for(n, args.tokens),
                    "heads": args.heads,
                    "head_dim": args.head_dim,
                    "dtype": args.dtype,
                    "seed": data_seed(name, n),
                    "order_seed": order_seed,
                    "compile_mode": args.flex_mode,
                    "process_per": args.process_per,
                    "warmup_ms": args.warmup_ms if args.warmup_ms is not None else (10.0 if args.quick else 50.0),
                    "rep_ms": args.rep_ms if args.rep_ms is not None else (40.0 if args.quick else 100.0),
                    "min_reps": args.min_reps,
                    "check": not args.no_check,
                    "check_on_device": not args.check_on_cpu,
                    "device": args.device,
                    "measurements": measurements,
                }
            )
    return groups


# -- running workers --------------------------------------------------------------------------------------------
def worker_command() -> list[str]:
    return [sys.executable, "-m", "relgen.bench.worker", "-"]


def settled(record: dict[str, Any], timeout_s: float, compile_mode: str | None = None) -> bool:
    """Whether --resume keeps a record: a final status, or a timeout that a rerun with this limit would repeat.

    A compiled peer's record counts only under the run's torch.compile mode (`compile_mode`; None: any), so a
    max-autotune run measures again what a default-mode run left. A timeout while building (compiling,
    autotuning) is never final: with warmer compile caches a rerun can get to the timing.
    """
    recorded_mode = record.get("compile_mode")
    if compile_mode is not None and recorded_mode is not None and recorded_mode != compile_mode:
        return False
    if record.get("status") in FINAL_STATUSES:
        return True
    if common.killed_while_building(record):
        return False
    return record.get("status") == "timeout" and record.get("timeout_s", 0.0) >= timeout_s


def failure_record(cfg: dict[str, Any], measurement: dict[str, Any], status: str, error: str) -> dict[str, Any]:
    from relgen.bench.worker import base_record

    record = base_record(cfg, measurement)
    record.update(status=status, error=error[-2000:], timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return record


def _same(measurement: dict[str, Any], payload: dict[str, Any]) -> bool:
    return all(measurement.get(k) == payload.get(k) for k in ("system", "pass", "variant"))


def run_group(
    cfg: dict[str, Any],
    timeout_s: float,
    log_path: Path,
    command: Callable[[], list[str]] = worker_command,
    stop_at: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Run cfg's measurements in worker processes, yielding one record per measurement as it finishes.

    A worker that crashes or exceeds `timeout_s` on a measurement gets that one recorded as "error" / "timeout"
    (with its stderr's tail) and a fresh worker continues with the rest. At `stop_at` (time.monotonic()) the worker
    is ended and the generator stops, recording nothing for the unfinished measurements (--resume runs them).
    A worker never outlives this generator: it is killed on any exit, including SIGTERM turned into SystemExit.
    """
    remaining = list(cfg["measurements"])
    env = dict(os.environ)
    root = str(common.repo_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    while remaining:
        sub = dict(cfg, measurements=remaining)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {cfg['mechanism']} N={cfg['seq_len']} {remaining}\n")
            log.flush()
            proc = subprocess.Popen(
                command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                start_new_session=True,  # its own process group, so a timeout ends inductor's helpers too
            )
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(json.dumps(sub))
                proc.stdin.close()
                lines: queue.Queue[str | None] = queue.Queue()
                threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
                current: dict[str, Any] | None = None
                built = False  # whether `current`'s system got through its build and warm-up
                deadline = time.monotonic() + timeout_s
                outcome = "exited"
                while True:
                    limit = deadline if stop_at is None else min(deadline, stop_at)
                    try:
                        line = lines.get(timeout=max(0.0, limit - time.monotonic()))
                    except queue.Empty:
                        outcome = "budget" if stop_at is not None and time.monotonic() >= stop_at else "timeout"
                        _kill(proc)
                        break
                    if line is None:
                        break
                    line = line.rstrip("\n")
                    if line.startswith(START_MARK):
                        payload = json.loads(line[len(START_MARK) :])
                        current = next((m for m in remaining if _same(m, payload)), None)
                        built = False
                        deadline = time.monotonic() + timeout_s
                    elif line.startswith(BUILT_MARK):
                        built = True
                    elif line.startswith(RECORD_MARK):
                        record = json.loads(line[len(RECORD_MARK) :])
                        done = next((m for m in remaining if _same(m, record)), None)
                        if done is not None:
                            remaining.remove(done)
                        current = None
                        yield record
                    else:
                        log.write(line + "\n")
                rc = proc.wait()
            finally:
                if proc.poll() is None:
                    _kill(proc)
                    proc.wait()
        if not remaining or outcome == "budget":
            return
        failed = current or remaining[0]
        remaining.remove(failed)
        if outcome == "timeout":
            phase = "timing" if built else "build"
            what = "timing" if built else "building (compiling, autotuning, warming up)"
            record = failure_record(cfg, failed, "timeout", f"no record within {timeout_s:.0f} s (killed while {what})")
            yield {**record, "timeout_s": timeout_s, "phase": phase}
        else:
            yield failure_record(cfg, failed, "error", f"worker exited with code {rc}: {_tail(log_path)}")


def _pump(stream, lines: queue.Queue) -> None:
    """Move a worker's stdout lines into a queue (None at the end), so the parent can wait with a timeout."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:].strip()


# -- the sweep --------------------------------------------------------------------------------------------------
def results_name(args: argparse.Namespace) -> str:
    return "ablation" if args.ablation is not None else "attention"


def _describe(record: dict[str, Any]) -> str:
    what = f"{record['mechanism']} N={record['seq_len']} {record['system']}"
    if record.get("variant"):
        what += f"[{record['variant']}]"
    what += f" {record['pass']}"
    if record["status"] != "ok":
        return f"{what}: {record['status']} {(record.get('error') or '')[:160]}"
    exact = {True: "exact", False: "INEXACT", None: "unchecked"}[record.get("exact")]
    mem = f"{record['peak_mib']:.0f} MiB" if record.get("peak_mib") is not None else "? MiB"
    return f"{what}: {record['ms']:.3f} ms {record['tflops']:.1f} TFLOP/s {mem} {exact}"


def sweep(args: argparse.Namespace, command: Callable[[], list[str]] = worker_command) -> Path:
    order_seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    groups = plan(args, order_seed)
    out: Path = args.out
    path = out / f"{results_name(args)}.json"
    records = common.load_records(path)
    if args.resume:
        done = {common.record_key(r) for r in records if settled(r, args.timeout, args.flex_mode)}
        for cfg in groups:
            cfg["measurements"] = [
                m
                for m in cfg["measurements"]
                if common.record_key({**_key_fields(cfg), **m, "seq_len": cfg["seq_len"]}) not in done
            ]
        groups = [g for g in groups if g["measurements"]]
    total = sum(len(g["measurements"]) for g in groups)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="relgen-bench-logs-"))
    print(
        f"relgen bench: {total} measurements in {len(groups)} groups, order seed {order_seed}, "
        f"one process per {args.process_per}; results {path}; worker logs {log_dir}",
        flush=True,
    )
    started = time.monotonic()
    stop_at = started + args.budget_s if args.budget_s else None
    try:  # SIGTERM (e.g. from `timeout`) becomes SystemExit, which unwinds run_group, which ends its worker
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread
        previous = None
    try:
        _sweep_groups(args, groups, path, records, log_dir, started, stop_at, total, command)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"relgen bench: done in {time.monotonic() - started:.0f} s", flush=True)
    return path


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _sweep_groups(args, groups, path, records, log_dir, started, stop_at, total, command) -> None:
    count = 0
    for cfg in groups:
        log_path = log_dir / f"{cfg['mechanism']}-{cfg['seq_len']}.log"
        chunks = [[m] for m in cfg["measurements"]] if args.process_per == "measurement" else [cfg["measurements"]]
        for chunk in chunks:
            if stop_at is not None and time.monotonic() >= stop_at:
                print(f"relgen bench: --budget-s reached after {count}/{total}; rerun with --resume", flush=True)
                return
            for record in run_group(dict(cfg, measurements=chunk), args.timeout, log_path, command, stop_at):
                count += 1
                records = common.merge_records(records, [record])
                common.write_records(path, records)
                elapsed = time.monotonic() - started
                print(f"[{count}/{total} {elapsed:6.0f}s] {_describe(record)}", flush=True)


def _key_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: cfg[k] for k in ("mechanism", "dtype", "batch", "heads", "head_dim")}


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        print(f"relgen bench: unknown systems {unknown}; expected some of {list(SYSTEMS)}", file=sys.stderr)
        return 2
    bad_passes = [p for p in args.passes if p not in PASSES]
    if bad_passes:
        print(f"relgen bench: unknown passes {bad_passes}; expected fwd and/or bwd", file=sys.stderr)
        return 2
    if args.ablation:
        unknown = [a for a in args.ablation if a not in ABLATIONS]
        if unknown:
            print(f"relgen bench: unknown ablations {unknown}; expected some of {list(ABLATIONS)}", file=sys.stderr)
            return 2
    if args.merge:
        path = args.out / f"{results_name(args)}.json"
        missing = [str(p) for p in args.merge if not p.exists()]
        if missing:
            print(f"relgen bench: --merge: no such file {missing}", file=sys.stderr)
            return 2
        try:
            lists = [common.load_records(path), *(common.load_records(p) for p in args.merge)]
        except ValueError as err:
            print(f"relgen bench: --merge: {err}", file=sys.stderr)
            return 2
        common.write_records(path, common.newest_records(*lists))
        print(path)
        args.report_only = True
    if args.report_only:
        written = report.write_reports(args.out)
        for p in written:
            print(p)
        return 0 if written else 1
    try:
        groups = plan(args, args.seed if args.seed is not None else 0)
    except (FileNotFoundError, ValueError) as err:
        print(f"relgen bench: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        for cfg in groups:
            items = ", ".join(
                f"{m['system']}{'[' + m['variant'] + ']' if m['variant'] else ''}:{m['pass']}"
                for m in cfg["measurements"]
            )
            print(f"{cfg['mechanism']} N={cfg['seq_len']} B={cfg['batch']} ({cfg['spec_source']}): {items}")
        return 0
    sweep(args)
    for p in report.write_reports(args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
