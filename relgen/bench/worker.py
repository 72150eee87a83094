"""One benchmark process: ``python -m relgen.bench.worker '<json config>'``.

The config names one mechanism at one length and a list of measurements (system, pass, variant). For each, the
worker prints a ``RELGEN_BENCH_START`` line, then builds the system, warms it up (compilation and autotuning happen
here, outside timing), measures its peak memory in one separate call, times it with triton.testing.do_bench
(median, L2 flushed before every run), checks its outputs against the FP32 reference and prints one
``RELGEN_BENCH_RECORD <json>`` line. The parent runs one measurement per process by default (the paper's protocol);
``--process-per group`` hands it all systems of one (mechanism, N).

Forward: O from q, k, v and the tables, with autograd recording (a training forward: what the backward keeps is
part of its memory). Backward: the forward runs once outside timing and its state is kept; the timed call is
``torch.autograd.grad(O, inputs, dO, retain_graph=True)``.

Peak memory: max_memory_allocated() during the measured call minus memory_allocated() just before it, i.e.
beyond the inputs (and, for the backward, beyond the kept forward state, O and dO).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from relgen.bench import common
from relgen.bench.common import BUILT_MARK, DTYPES, RECORD_MARK, START_MARK, SYSTEMS, check_close, credited_flops
from relgen.spec.model import load_spec

#: The reference is computed in query blocks whose largest tensors stay within this many bytes (it runs after the
#: system under test has been freed, so it may use the GPU's memory).
REFERENCE_BUDGET = 4 << 30


def emit(mark: str, payload: dict[str, Any]) -> None:
    print(mark + json.dumps(payload, allow_nan=False), flush=True)


def base_record(cfg: dict[str, Any], measurement: dict[str, Any]) -> dict[str, Any]:
    """The fields every record has, whatever happens to the measurement."""
    spec = load_spec(cfg["spec"])
    system = measurement["system"]
    n, b, h, d = cfg["seq_len"], cfg["batch"], cfg["heads"], cfg["head_dim"]
    flops = credited_flops(spec, n, b, h, d, measurement["pass"])
    return {
        "mechanism": cfg["mechanism"],
        "system": system,
        "variant": measurement.get("variant"),
        "seq_len": n,
        "pass": measurement["pass"],
        "status": "error",
        "ms": None,
        "tflops": None,
        "peak_mib": None,
        "exact": None,
        "relative_terms": SYSTEMS[system]["relative"],
        "batch": b,
        "heads": h,
        "head_dim": d,
        "dtype": cfg["dtype"],
        "rows": common.plan_rows(spec, n),
        "flops": flops,
        "spec_source": cfg.get("spec_source"),
        "compile_mode": cfg.get("compile_mode") if SYSTEMS[system]["compiled"] else None,
        "process_per": cfg.get("process_per"),
        "order_seed": cfg.get("order_seed"),
        "order": measurement.get("order"),
        "data_seed": cfg["seed"],
        "error": None,
    }


# -- environment ------------------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = props.name
        env["gpu_sms"] = props.multi_processor_count
        env["gpu_memory_mib"] = props.total_memory // (1 << 20)
    else:
        env["gpu"] = None
    return env


def gpu_state() -> dict[str, Any] | None:
    """SM and memory clocks (MHz), power (W) and temperature (°C) now, through NVML or nvidia-smi."""
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            return {
                "sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "mem_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                "temp_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    try:
        import subprocess

        line = subprocess.run(
            [
                "nvidia-smi",
                f"--id={torch.cuda.current_device()}",
                "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        sm, mem, power, temp = (part.strip() for part in line.split(","))
        return {"sm_mhz": float(sm), "mem_mhz": float(mem), "power_w": float(power), "temp_c": float(temp)}
    except Exception:
        return None


# -- timing and memory ------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup_ms: float, rep_ms: float, min_reps: int) -> dict:
    """Median latency. CUDA: triton.testing.do_bench (L2 flushed before each run), with `rep` raised so that at
    least `min_reps` runs are timed. CPU (tests only): wall clock."""
    if device.type != "cuda":
        times = []
        for _ in range(max(min_reps, 1)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return {"ms": statistics.median(times), "reps": len(times), "timer": "perf_counter"}
    import triton.testing

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    synchronize(device)
    estimate = max(start.elapsed_time(end), 1e-3)
    rep = max(rep_ms, 1.2 * min_reps * estimate)
    ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep, return_mode="median")
    return {
        "ms": float(ms),
        "reps": max(1, int(rep / estimate)),
        "timer": "triton.testing.do_bench",
        "host_ms": host_ms(fn, device, queued_calls(estimate)),
    }


def queued_calls(estimate_ms: float) -> int:
    """How many calls host_ms issues: at most ~20 ms of GPU work queued, so that the GPU never holds the host back."""
    return max(1, min(50, int(20 / estimate_ms)))


def host_ms(fn: Callable[[], Any], device: torch.device, calls: int) -> float:
    """The host's time per call: `calls` calls issued back to back without a sync. do_bench flushes L2 between its
    calls; a system whose host time is about its reading or more leaves the GPU idle between them, and its reading
    is the host's time, not its kernels'."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    synchronize(device)
    return elapsed / calls * 1e3


def measure_peak(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float | None]:
    """Run fn once; its result and the peak memory (MiB) it allocated beyond what was live before it."""
    if device.type != "cuda":
        return fn(), None
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return result, peak / float(1 << 20)


def is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    text = f"{type(err).__name__}: {err}".lower()
    return "out of memory" in text or "outofmemory" in text


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# -- checking ---------------------------------------------------------------------------------------------------
class References:
    """FP32 references of one problem, computed on first use and kept for every system of the process."""

    def __init__(self, problem):
        self.problem = problem
        self._cache: dict[tuple[bool, bool], dict[str, torch.Tensor]] = {}

    def get(self, relative: bool, with_grad: bool) -> dict[str, torch.Tensor]:
        from relgen.bench.oracle import reference

        key = (relative, with_grad)
        if key not in self._cache:
            if (relative, True) in self._cache:
                return self._cache[(relative, True)]
            dtype = torch.float64 if self.problem.dtype == torch.float64 else torch.float32
            self._cache[key] = reference(
                self.problem, relative=relative, with_grad=with_grad, dtype=dtype, budget_bytes=REFERENCE_BUDGET
            )
        return self._cache[key]


def check(
    result: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype, on_device: bool = True
) -> tuple[bool, dict]:
    """Every output and gradient against the reference; (all passed, message per tensor)."""
    details: dict[str, str] = {}
    ok = True
    for name, tensor in result.items():
        if tensor is None:
            details[name] = "no gradient returned"
            ok = False
            continue
        passed, message = check_close(tensor, expected[name], dtype, on_device=on_device)
        details[name] = message if message.startswith(("ok", "FAIL")) else ("ok: " if passed else "FAILED: ") + message
        ok = ok and passed
    return ok, details


#: A system kept built between two measurements of one group process (see `measure`'s `keep`).
_HELD: dict[Any, Any] = {}


# -- one measurement --------------------------------------------------------------------------------------------
def _key(measurement: dict[str, Any]) -> tuple:
    return (measurement["system"], measurement.get("variant"))


def _run_system(
    cfg: dict[str, Any], measurement: dict[str, Any], problem, record: dict[str, Any], held: dict
) -> tuple[dict, bool]:
    """Build, warm up, measure memory and time one system; returns its outputs and whether it has relative terms.

    Everything the system holds (compiled code, index tensors, the kept forward state) dies with this frame, unless
    `held` asks to keep the built system for the next measurement (a group process timing the same system's
    backward right after its forward reuses the compiled forward).
    """
    from relgen.bench.peers import build_system

    device = problem.device
    started = time.perf_counter()
    built = held.pop(_key(measurement), None) or build_system(
        measurement["system"], problem, cfg.get("compile_mode", "max-autotune"), measurement.get("variant")
    )
    names = [n for n, _ in built.inputs]
    tensors = [t for _, t in built.inputs]
    if measurement["pass"] == "fwd":

        def run():
            return built.forward()

    else:
        out = built.forward()  # the forward state the backward keeps, made outside timing
        d_out = problem.d_out

        def run():
            return torch.autograd.grad(out, tensors, d_out, retain_graph=True)

    for _ in range(int(cfg.get("warmup_calls", 2))):  # compilation and autotuning happen here
        run()
    synchronize(device)
    record["warmup_s"] = round(time.perf_counter() - started, 3)
    emit(BUILT_MARK, {"warmup_s": record["warmup_s"]})
    value, peak = measure_peak(run, device)
    if measurement["pass"] == "fwd":
        result = {"out": value.detach()}
    else:
        result = {"out": out.detach(), **dict(zip(names, value, strict=True))}
    timing = time_ms(run, device, cfg["warmup_ms"], cfg["rep_ms"], cfg["min_reps"])
    record["gpu_state"] = gpu_state()
    record.update(
        status="ok",
        ms=timing["ms"],
        reps=timing["reps"],
        timer=timing["timer"],
        host_ms=timing.get("host_ms"),
        tflops=record["flops"] / (timing["ms"] * 1e-3) / 1e12,
        peak_mib=common.finite_or_none(peak),
    )
    if held.get("keep"):
        held[_key(measurement)] = built
    return result, built.relative


def _forget_compiled(measurement: dict[str, Any]) -> None:
    """Drop dynamo's compiled graphs so the next system of a group process starts clean."""
    if SYSTEMS[measurement["system"]]["compiled"]:
        with contextlib.suppress(Exception):
            torch._dynamo.reset()


def measure(
    cfg: dict[str, Any], measurement: dict[str, Any], problem, refs: References, keep: bool = False
) -> dict[str, Any]:
    """One record: status "ok" with numbers, or "oom" / "error" / "unsupported" with the message.

    `keep`: the next measurement times the same system, so keep it built (compiled) in between.
    """
    record = base_record(cfg, measurement)
    device = problem.device
    started = time.perf_counter()
    held = _HELD
    held["keep"] = keep
    try:
        result, relative = _run_system(cfg, measurement, problem, record, held)
    except NotImplementedError as err:
        record.update(status="unsupported", error=f"{type(err).__name__}: {err}"[:2000])
    except Exception as err:
        record.update(status="oom" if is_oom(err) else "error", error=f"{type(err).__name__}: {err}"[:2000])
        traceback.print_exc(file=sys.stderr)
    else:
        if not keep:
            _forget_compiled(measurement)
        cleanup(device)
        if cfg.get("check", True):
            try:
                expected = refs.get(relative, with_grad=measurement["pass"] == "bwd")
                record["exact"], record["check"] = check(
                    result, expected, problem.dtype, on_device=cfg.get("check_on_device", True)
                )
            except Exception as err:  # the numbers stand; only the check could not be made
                record["check"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
                traceback.print_exc(file=sys.stderr)
    finally:
        record["wall_s"] = round(time.perf_counter() - started, 3)
        if _key(measurement) not in held:
            _forget_compiled(measurement)
        cleanup(device)
    return record


def run(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every measurement of `cfg` in order, emitting START and RECORD lines; returns the records."""
    from relgen.bench.peers import make_problem

    device = torch.device(cfg.get("device", "cuda"))
    if device.type == "cuda":
        if device.index is None:  # set_device and the memory statistics want an explicit index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("highest")
    env = environment()
    spec = load_spec(cfg["spec"])
    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    records = []
    problem = None
    measurements = cfg["measurements"]
    for position, measurement in enumerate(measurements):
        emit(START_MARK, {k: measurement.get(k) for k in ("system", "pass", "variant")})
        if problem is None:
            try:
                problem = make_problem(
                    spec, cfg["seq_len"], cfg["batch"], cfg["heads"], cfg["head_dim"], dtype, device, cfg["seed"]
                )
                refs = References(problem)
            except Exception as err:  # inputs alone do not fit: every measurement of this length fails alike
                record = base_record(cfg, measurement)
                record.update(status="oom" if is_oom(err) else "error", error=f"{type(err).__name__}: {err}"[:2000])
                record.update(env)
                emit(RECORD_MARK, record)
                records.append(record)
                cleanup(device)
                continue
        following = measurements[position + 1] if position + 1 < len(measurements) else None
        record = measure(
            cfg, measurement, problem, refs, keep=following is not None and _key(following) == _key(measurement)
        )
        record.update(env)
        record["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        emit(RECORD_MARK, _json_safe(record))
        records.append(record)
    return records


def _json_safe(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m relgen.bench.worker '<json config>' (or '-' to read it from stdin)", file=sys.stderr)
        return 2
    text = sys.stdin.read() if argv[0] == "-" else argv[0]
    cfg = json.loads(text)
    if not str(cfg.get("device", "cuda")).startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # relgen's kernels run in Triton's interpreter on the CPU
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
