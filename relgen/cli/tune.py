"""`relgen tune` and `relgen warmup`: tile configurations measured on the GPU, and compilation ahead of time.

Tuning (CUDA only). For every spec and sequence-length bucket (relgen.tiles.tuning.BUCKETS, or --seq-lens) it times a
short list of candidate `KernelConfig`s with the paper's shapes (batch B = 16384 // N, H = 12 heads), forward and
backward separately, each with `triton.testing.do_bench` (median):

1. forward tiles (FORWARD_TILES, plus the heuristic's own), with the heuristic's projection tiles;
2. projection tiles (PROJECT_TILES) with the best forward tiles;
3. backward tiles (BACKWARD_TILES, plus the heuristic's) for both passes, with the heuristic's reduction tiles;
4. the key-parallel pass's own tiles (KEY_PASS_TILES, in both orientations: AttnTiles.key_major), the query
   pass's kept from step 3;
5. the query-parallel pass's tiles (BACKWARD_TILES) again, the key pass's kept from step 4;
6. reduction tiles (REDUCE_TILES) with the best backward tiles.

The group size stays 128 (the analyzer plans with it). Forward and backward winners are picked independently
(the backward only depends on the group, which all candidates share). A candidate that fails to compile, runs
out of resources or memory, or gives a result that differs from the heuristic configuration's beyond
`relgen.testing.check_close` is skipped and the reason recorded. Specs whose kernels share a table key
(`relgen.tiles.tuning.table_key`: kernel family, dtype, head dim, bucket) are timed together: a candidate's time is
the sum over them.

The winners are merged into relgen/tiles/tuning_tables/sm{major}{minor}.json (or --out), the file that
`relgen.tiles.tuning.lookup` reads, after every finished entry (so a run stopped by --budget-s or killed keeps what it
finished); the measured times go to the file's "_timings" section. --resume skips entries already in the file.

Warmup (CUDA only): one forward and backward per bucket, batch 1, 12 heads, so that the kernels of every
configuration the lookup picks are compiled (and in Triton's on-disk cache) before the real calls. Triton
specializes integer arguments on divisibility by 16, so a sequence length that is not a multiple of 16 may still
compile once more; pass the lengths you use with --seq-lens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

#: The tuning problem: the paper's kernel-benchmark shapes (B = TOKENS // N sequences of N tokens, H heads).
TOKENS = 16384
HEADS = 12
GROUP = 128

#: Candidate tiles. Forward / backward: (block_m, block_n, num_warps, num_stages).
#: 64x64 with 8 warps and 64x32: no spills by ptxas for query+key band tiles, where 64x64 with 4 warps spills.
#: 128x64 with 4 warps and 4 stages: the fastest plain attention of the forward's design on the H200
#: (benchmarks/plain_ceiling.py, docs/performance.md). 64x128: fewer, wider key tiles for short lengths, where
#: band tiles are most of the work (sm_90 at 512: T5 230 registers, no spills, 106 KB shared; Shaw, TXL and
#: DeBERTa spill 0.2-2 KB with it).
FORWARD_TILES = (
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 64, 4, 4),
    (128, 32, 4, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (128, 128, 8, 2),
    (64, 64, 8, 3),
    (64, 32, 4, 3),
)
#: 64x64 with 8 warps: no spills by ptxas where 4 warps spill, yet it lost at 8K for every spec on the H200; 64x128
#: never won.
BACKWARD_TILES = ((64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2))
#: The key pass on its own, in both orientations (AttnTiles.key_major). Query-major: 32 query rows per step won
#: for query+key at 4K and 8K (its gathers of both projections and the dZ̃^K scatter spill at 64 rows), so
#: neighbours of that shape too; not 32x128 with 8 warps, which gave a wrong dK on the H200 (T5 from 384 tokens,
#: Shaw/TXL at 128; exact in the CPU's interpreter), caught by the tuner's comparison. Key-major (no transposes of
#: P and dS): the same shapes, and 32x128 with 8 warps, exact there (tests/test_gpu.py::
#: test_every_backward_candidate_is_exact checks every candidate against FP64).
_KEY_PASS_SHAPES = (*BACKWARD_TILES, (32, 64, 4, 3), (16, 64, 4, 2), (32, 64, 2, 2))
KEY_PASS_TILES = (
    *((*t, False) for t in _KEY_PASS_SHAPES),
    *((*t, True) for t in (*_KEY_PASS_SHAPES, (32, 128, 8, 2))),
)
#: Projection: (block_t, block_w, num_warps, num_stages); reduction: (block_t, block_w, block_s, warps, stages).
#: A forward that writes its own Z̃^Q (GenerationFlags.fused_zq) takes only block_w from these, as its prologue's
#: column tile: 32 and 128 are there for it (H200, 8K: DeBERTa 2.349 ms with 128 against 2.366 with 64; Shaw
#: 1.221 with 32 against 1.232; docs/performance.md).
PROJECT_TILES = ((64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 2), (128, 128, 8, 2))
#: 64x64x64 with 3 stages: the table reduction −10 to −19 % for Shaw at 512–8K, −10 % for DeBERTa at 2K / 8K,
#: −13 % for TXL at 128 / 512, but +5 % for DeBERTa at 128 / 512 (H200, docs/performance.md; measured on a
#: flatter loop whose 2-stage times equal this one's within 1 %): so a candidate per bucket, not a new default
REDUCE_TILES = ((64, 64, 64, 4, 2), (64, 64, 64, 4, 3), (128, 64, 32, 8, 2))

#: do_bench settings: short, the candidate lists are many.
WARMUP_MS = 10
REP_MS = 40

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class OutOfBudget(Exception):
    """--budget-s is spent: stop before the next measurement."""


class FatalCudaError(Exception):
    """The CUDA context is unusable (e.g. an illegal memory access): later measurements would all fail."""


# ------------------------------------------------------------------------------------------------------------
# helpers shared by tune and warmup
# ------------------------------------------------------------------------------------------------------------
def _require_cuda(command: str, why: str) -> None:
    from relgen.backend import interpreting
    from relgen.cli.main import CommandError

    if not torch.cuda.is_available():
        raise CommandError(f"'relgen {command}' needs a CUDA GPU and none was found: {why}")
    if interpreting():
        raise CommandError(
            f"'relgen {command}' needs compiled kernels, but TRITON_INTERPRET is set (the kernels would run in "
            "Triton's interpreter): unset it"
        )


def _check_options(dtype: str, head_dim: int, seq_lens: Sequence[int] | None) -> None:
    from relgen.runtime.arguments import SUPPORTED_HEAD_DIMS

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"--head-dim: must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if seq_lens is not None and any(n < 1 for n in seq_lens):
        raise ValueError(f"--seq-lens: sequence lengths must be ≥ 1, got {min(seq_lens)}")


def _load_specs(paths: Sequence[str]) -> list[tuple[str, Any]]:
    """(path, spec) for every path; the first bad spec ends the command (exit 2) before any GPU time is spent."""
    from relgen.cli import main as cli

    return [(path, cli._analyze(path, None)[0]) for path in paths]


def _lengths(seq_lens: Sequence[int] | None) -> list[int]:
    """The sequence lengths to run: the given ones (one per bucket, the first wins), else every bucket's top."""
    from relgen.tiles import tuning

    if not seq_lens:
        return list(tuning.BUCKETS)
    chosen: dict[int, int] = {}
    for n in seq_lens:
        chosen.setdefault(tuning.bucket(n), n)
    return sorted(chosen.values())


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


#: CUDA errors that leave the context unusable (sticky); out-of-memory and launch-resource errors are not.
_STICKY = ("illegal memory access", "illegal address", "misaligned address", "device-side assert", "launch failure")


def _is_fatal(err: BaseException) -> bool:
    text = str(err).lower()
    return any(words in text for words in _STICKY)


# ------------------------------------------------------------------------------------------------------------
# candidates
# ------------------------------------------------------------------------------------------------------------
def _unique(items: Sequence[Any]) -> list[Any]:
    seen: list[Any] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def forward_candidates(base):
    from relgen.tiles.configs import AttnTiles

    tiles = _unique([base.forward, *(AttnTiles(*t) for t in FORWARD_TILES)])
    return [replace(base, forward=t) for t in tiles]


def project_candidates(base):
    from relgen.tiles.configs import ProjectTiles

    tiles = _unique([base.project, *(ProjectTiles(*t) for t in PROJECT_TILES)])
    return [replace(base, project=t) for t in tiles]


def backward_candidates(base):
    from relgen.tiles.configs import AttnTiles

    tiles = _unique([base.backward, *(AttnTiles(*t) for t in BACKWARD_TILES)])
    return [replace(base, backward=t) for t in tiles]


def with_passes(base, query, key):
    """`base` with the query pass on `query` tiles and the key pass on `key` (None when they are the same)."""
    return replace(base, backward=query, backward_kv=None if key == query else key)


def key_pass_candidates(base):
    """The key-parallel pass on its own tiles, the query pass's kept (the passes spill differently)."""
    from relgen.tiles.configs import AttnTiles

    tiles = _unique([base.key_pass, *(AttnTiles(*t) for t in KEY_PASS_TILES)])
    return [with_passes(base, base.backward, t) for t in tiles]


def query_pass_candidates(base):
    """The query-parallel pass's tiles again, now that the key pass has its own."""
    from relgen.tiles.configs import AttnTiles

    tiles = _unique([base.backward, *(AttnTiles(*t) for t in BACKWARD_TILES)])
    return [with_passes(base, t, base.key_pass) for t in tiles]


def reduce_candidates(base):
    from relgen.tiles.configs import ReduceTiles

    tiles = _unique([base.reduce, *(ReduceTiles(*t) for t in REDUCE_TILES)])
    return [replace(base, reduce=t) for t in tiles]


def _attn_label(t) -> str:
    return f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}{' key-major' if t.key_major else ''}"


def forward_label(cfg) -> str:
    p = cfg.project
    return f"fwd {_attn_label(cfg.forward)} | proj {p.block_t}x{p.block_w} w{p.num_warps} s{p.num_stages}"


def backward_label(cfg) -> str:
    r = cfg.reduce
    kv = f" / kv {_attn_label(cfg.backward_kv)}" if cfg.backward_kv is not None else ""
    reduce = f"red {r.block_t}x{r.block_w}x{r.block_s} w{r.num_warps} s{r.num_stages}"
    return f"bwd {_attn_label(cfg.backward)}{kv} | {reduce}"


def config_entry(cfg) -> dict[str, Any]:
    """The table entry of a KernelConfig, in the format relgen.tiles.tuning.lookup parses."""
    return {
        "group": cfg.group,
        "forward": asdict(cfg.forward),
        "backward": asdict(cfg.backward),
        "project": asdict(cfg.project),
        "reduce": asdict(cfg.reduce),
        **({"backward_kv": asdict(cfg.backward_kv)} if cfg.backward_kv is not None else {}),
    }


# ------------------------------------------------------------------------------------------------------------
# the table file
# ------------------------------------------------------------------------------------------------------------
def default_table_path() -> Path:
    from relgen.tiles import tuning

    major, minor = torch.cuda.get_device_capability()
    return tuning.TABLES / f"sm{major}{minor}.json"


def read_table(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of tuned entries")
    return data


def write_entry(path: Path, key: str, entry: dict[str, Any], timings: dict[str, Any]) -> None:
    """Merge one entry (and its timings, under "_timings") into the table file, atomically."""
    from relgen.tiles import tuning

    table = read_table(path)
    table[key] = entry
    table.setdefault("_timings", {})[key] = timings
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    tuning._table.cache_clear()  # lookup() reads the new entries in this process too


# ------------------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Problem:
    """One spec at one length: the mechanism, its inputs and the heuristic configuration's results."""

    name: str
    mechanism: Any
    inputs: Any
    d_out: torch.Tensor
    reference: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # "forward"/"backward" → tensors

    def leaves(self) -> list[torch.Tensor]:
        return list(self.inputs.leaves.values())

    def forward(self) -> torch.Tensor:
        i = self.inputs
        return self.mechanism(i.q, i.k, i.v, **i.tables)


def _log(line: str) -> None:
    print(line, flush=True)  # a run cut short (timeout) keeps its lines


@dataclass
class Tuner:
    """Times the candidates. `device`, `tokens`, `heads` and `timer` exist for the CPU tests (Triton's
    interpreter, a fake timer); `relgen tune` uses the defaults."""

    dtype: torch.dtype
    head_dim: int
    budget_s: float | None = None
    device: str = "cuda"
    tokens: int = TOKENS
    heads: int = HEADS
    timer: Callable[[Callable[[], Any]], float] | None = None  # fn → ms; default do_bench's median
    started: float = field(default_factory=time.monotonic)
    log: Callable[[str], None] = field(default=_log)

    def _spend(self) -> None:
        if self.budget_s is not None and time.monotonic() - self.started > self.budget_s:
            raise OutOfBudget

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self._cuda() else str(self.device)

    def _cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def _sync(self) -> None:
        if self._cuda():
            torch.cuda.synchronize()

    def _free(self) -> None:
        if self._cuda():
            torch.cuda.empty_cache()

    def _time(self, fn: Callable[[], Any]) -> float:
        if self.timer is not None:
            return float(self.timer(fn))
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))

    def batch(self, seq_len: int) -> int:
        return max(1, self.tokens // seq_len)

    def _sample(self, t: torch.Tensor) -> torch.Tensor:
        """The part of a result that the sanity check compares (every position, two heads: cheap on the CPU)."""
        t = t.detach()
        if t.dim() == 4:  # [B, H, N, d]: the first sequence, two heads
            t = t[:1, :2]
        elif t.dim() >= 2 and t.shape[0] == self.heads:  # per-head tables [H, R, d] / [H, R]
            t = t[:2]
        return t.clone()

    def problem(self, spec, seq_len: int) -> Problem:
        from relgen.check.verify import make_inputs
        from relgen.runtime.mechanism import compile_mechanism

        inputs = make_inputs(
            spec,
            b=self.batch(seq_len),
            h=self.heads,
            nq=seq_len,
            d=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            seed=seq_len,
            bias_dtype=self.dtype,  # every table in the inputs' dtype, as users and the benchmark pass them
        )
        gen = torch.Generator(device="cpu").manual_seed(1)
        d_out = torch.randn(inputs.q.shape, generator=gen).to(device=self.device, dtype=self.dtype)
        return Problem(spec.name, compile_mechanism(spec), inputs, d_out)

    def _run(self, problem: Problem, cfg, which: str) -> float:
        """Compile and run once (checking the result), then time; returns the median in ms."""
        from relgen.testing import check_close
        from relgen.tiles.select import override_config

        with override_config(cfg):
            if which == "forward":
                got = {"out": problem.forward()}
                fn = problem.forward
            else:
                out = problem.forward()
                leaves, d_out = problem.leaves(), problem.d_out

                def fn():
                    return torch.autograd.grad(out, leaves, d_out, retain_graph=True)

                got = dict(zip(problem.inputs.leaves, fn(), strict=True))
            self._sync()
            got = {k: self._sample(v) for k, v in got.items()}
            want = problem.reference.setdefault(which, got)
            for name, tensor in got.items():
                ok, message = check_close(tensor, want[name], self.dtype)
                if not ok:
                    raise ValueError(f"result differs from the heuristic configuration's: {name}: {message}")
            return self._time(fn)

    def measure(self, problems: Sequence[Problem], candidates, which: str, label, record: dict[str, Any]):
        """Time every candidate on every problem; the best (lowest total) candidate and its total ms."""
        best, best_ms = None, float("inf")
        for cfg in candidates:
            self._spend()
            name = label(cfg)
            if name in record:  # measured in an earlier stage (the stages share their first candidate)
                total = record[name]
            else:
                try:
                    cfg.check()
                    total = sum(self._run(p, cfg, which) for p in problems)
                except Exception as err:
                    if _is_fatal(err):
                        raise FatalCudaError(_short(err)) from err
                    self._free()
                    record[name] = f"skipped: {_short(err)}"
                    self.log(f"    {name:<48} skipped: {_short(err)[:120]}")
                    continue
                record[name] = round(total, 5)
                self.log(f"    {name:<48} {total:9.3f} ms")
            if isinstance(total, float) and total < best_ms:
                best, best_ms = cfg, total
        return best, best_ms

    def tune(self, specs: Sequence[Any], seq_len: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The table entry and timings of one key (specs sharing it) at one length; None if nothing ran."""
        from relgen.tiles.configs import default_config

        problems = [self.problem(spec, seq_len) for spec in specs]
        terms = tuple(problems[0].mechanism.module.PLAN.terms)
        base = replace(default_config(self.dtype, self.head_dim, seq_len, terms), group=GROUP)
        fwd: dict[str, Any] = {}
        bwd: dict[str, Any] = {}
        try:
            best, _ = self.measure(problems, forward_candidates(base), "forward", forward_label, fwd)
            if best is None:
                return None
            best_fwd, fwd_ms = self.measure(problems, project_candidates(best), "forward", forward_label, fwd)
            best, _ = self.measure(problems, backward_candidates(base), "backward", backward_label, bwd)
            if best is None:
                return None
            best, _ = self.measure(problems, key_pass_candidates(best), "backward", backward_label, bwd)
            best, _ = self.measure(problems, query_pass_candidates(best), "backward", backward_label, bwd)
            best_bwd, bwd_ms = self.measure(problems, reduce_candidates(best), "backward", backward_label, bwd)
        finally:
            del problems
            self._free()
        if best_fwd is None or best_bwd is None:
            return None
        chosen = replace(best_fwd, backward=best_bwd.backward, backward_kv=best_bwd.backward_kv, reduce=best_bwd.reduce)
        chosen.check()
        base_fwd, base_bwd = fwd.get(forward_label(base)), bwd.get(backward_label(base))
        timings = {
            "seq_len": seq_len,
            "batch": self.batch(seq_len),
            "heads": self.heads,
            "specs": [s.name for s in specs],
            "gpu": self.device_name(),
            "torch": torch.__version__,
            "triton": _triton_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "timer": f"triton.testing.do_bench median (warmup {WARMUP_MS} ms, rep {REP_MS} ms), summed over specs",
            "forward_ms": fwd,
            "backward_ms": bwd,
            "chosen": {"forward": forward_label(chosen), "backward": backward_label(chosen)},
            "chosen_ms": {"forward": round(fwd_ms, 5), "backward": round(bwd_ms, 5)},
            "heuristic_ms": {"forward": base_fwd, "backward": base_bwd},
        }
        return config_entry(chosen), timings


def _triton_version() -> str:
    import triton

    return triton.__version__


def _family_groups(specs: Sequence[Any]) -> dict[str, list[Any]]:
    """Specs grouped by the kernel families of their plans (the part of the table key that depends on the spec)."""
    from relgen.runtime.mechanism import compile_mechanism
    from relgen.tiles import tuning

    groups: dict[str, list[Any]] = {}
    for spec in specs:
        groups.setdefault(tuning.plan_family(compile_mechanism(spec).module.PLAN), []).append(spec)
    return groups


# ------------------------------------------------------------------------------------------------------------
# relgen tune
# ------------------------------------------------------------------------------------------------------------
def cli_tune(args: argparse.Namespace) -> int:
    """`relgen tune SPEC... [--out PATH] [--seq-lens N ...] [--dtype fp16] [--head-dim 64] [--budget-s S]
    [--resume]`: exit 0 when done or stopped by the budget, 1 if an entry could not be tuned or CUDA failed."""
    _require_cuda("tune", "tile configurations are timed on the GPU (Triton's interpreter on the CPU has no speed)")
    from relgen.tiles import tuning

    dtype_name, head_dim = getattr(args, "dtype", "fp16"), getattr(args, "head_dim", 64)
    seq_lens = getattr(args, "seq_lens", None)
    _check_options(dtype_name, head_dim, seq_lens)
    dtype = DTYPES[dtype_name]
    specs = [spec for _, spec in _load_specs(args.specs)]
    out = Path(args.out) if getattr(args, "out", None) else default_table_path()
    existing = read_table(out)
    tuner = Tuner(dtype, head_dim, budget_s=getattr(args, "budget_s", None))
    lengths = _lengths(seq_lens)
    print(
        f"tuning {len(specs)} spec(s) on {tuner.device_name()} ({dtype_name}, d={head_dim}, "
        f"N ∈ {lengths}, B = {tuner.tokens} // N, H = {tuner.heads}) → {out}",
        flush=True,
    )
    status, written = 0, 0
    try:
        for family, group in _family_groups(specs).items():
            for n in lengths:
                entry_key = tuning.table_key(family, dtype, head_dim, n)
                if getattr(args, "resume", False) and entry_key in existing:
                    print(f"{entry_key}: already tuned, skipped (--resume)")
                    continue
                t0 = time.monotonic()
                print(f"{entry_key}  N={n}  specs: {', '.join(s.name for s in group)}", flush=True)
                result = tuner.tune(group, n)
                if result is None:
                    print(f"  {entry_key}: no candidate ran; nothing written")
                    status = 1
                    continue
                entry, timings = result
                write_entry(out, entry_key, entry, timings)
                written += 1
                print(
                    f"  → {timings['chosen']['forward']}  ({timings['chosen_ms']['forward']:.3f} ms; heuristic "
                    f"{_ms(timings['heuristic_ms']['forward'])})\n"
                    f"  → {timings['chosen']['backward']}  ({timings['chosen_ms']['backward']:.3f} ms; heuristic "
                    f"{_ms(timings['heuristic_ms']['backward'])})  [{time.monotonic() - t0:.0f} s]",
                    flush=True,
                )
    except OutOfBudget:
        print(f"budget of {tuner.budget_s:g} s spent: stopped; the entry in progress was not written")
    except FatalCudaError as err:
        print(f"CUDA failed, stopped (the process's CUDA context is unusable): {err}")
        status = 1
    print(f"{written} entr{'y' if written == 1 else 'ies'} written to {out} ({time.monotonic() - tuner.started:.0f} s)")
    return status


def _ms(value: Any) -> str:
    return f"{value:.3f} ms" if isinstance(value, float) else str(value)


# ------------------------------------------------------------------------------------------------------------
# relgen warmup
# ------------------------------------------------------------------------------------------------------------
def cli_warmup(args: argparse.Namespace) -> int:
    """`relgen warmup SPEC... [--dtype fp16] [--head-dim 64] [--seq-lens N ...]`: one forward and backward per
    length (batch 1, 12 heads) to compile every configuration the lookup picks; prints the times."""
    _require_cuda("warmup", "Triton's interpreter on the CPU compiles nothing, so there is nothing to warm up")
    from relgen.check.verify import make_inputs
    from relgen.runtime import descriptors
    from relgen.runtime.mechanism import compile_mechanism
    from relgen.tiles import tuning

    dtype_name, head_dim = getattr(args, "dtype", "fp16"), getattr(args, "head_dim", 64)
    seq_lens = getattr(args, "seq_lens", None)
    _check_options(dtype_name, head_dim, seq_lens)
    dtype = DTYPES[dtype_name]
    specs = _load_specs(args.specs)
    lengths = _lengths(seq_lens)
    status = 0
    started = time.perf_counter()
    for path, spec in specs:
        t0 = time.perf_counter()
        mechanism = compile_mechanism(spec)
        print(f"{path}  {spec.name}  ({dtype_name}, d={head_dim}): generated in {time.perf_counter() - t0:.1f} s")
        family = tuning.plan_family(mechanism.module.PLAN)
        for n in lengths:
            source = "tuned" if tuning.lookup(family, dtype, head_dim, n) is not None else "heuristic"
            try:
                inputs = make_inputs(
                    spec, b=1, h=HEADS, nq=n, d=head_dim, dtype=dtype, device="cuda", seed=0, bias_dtype=dtype
                )
                t1 = time.perf_counter()
                for tma in (True, False):  # saturated key tiles through descriptors and through pointers
                    with descriptors.forced(tma):
                        out = mechanism(inputs.q, inputs.k, inputs.v, **inputs.tables)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                torch.autograd.grad(out, list(inputs.leaves.values()), torch.ones_like(out))
                torch.cuda.synchronize()
                t3 = time.perf_counter()
            except Exception as err:
                print(f"  N={n:>5}  ERROR {_short(err)}")
                status = 1
                if _is_fatal(err):
                    return status
                continue
            finally:
                inputs = out = None
            print(f"  N={n:>5}  {source:<9}  forward {t2 - t1:6.2f} s  backward {t3 - t2:6.2f} s", flush=True)
    print(f"warm-up done in {time.perf_counter() - started:.1f} s")
    return status
