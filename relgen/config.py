"""How relgen's kernels run here: Triton's set-up (its interpreter without a GPU), the storage of the stored
projections, and the tile configurations (the interpreter's, the tuned tables' (relgen.tuning) and the resource
heuristic's)."""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from relgen.geometry import PlanInfo


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (CUDA graphs; torch.compile's mode='reduce-overhead')."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------------------------------------------------
# Triton's set-up: its interpreter on a machine without a CUDA device
# ------------------------------------------------------------------------------------------------------------
#: the first numpy whose integer semantics break the interpreter's loops with bounds known only at run time
INTERPRETER_NUMPY_LIMIT = (2, 4)


def configure_triton() -> None:
    """Run relgen's kernels in Triton's interpreter on the CPU when no CUDA device exists and TRITON_INTERPRET is
    unset (the Python API, the CLI and the tests call this before relgen's first kernel is defined), and check
    that the interpreter can run them. An explicit TRITON_INTERPRET is left as it is.

    Triton reads TRITON_INTERPRET when a kernel is decorated, so importing triton earlier does no harm; kernels
    relgen decorated before (relgen.dropout) without it cannot be redone, which is a one-line RuntimeError."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        dropout = sys.modules.get("relgen.dropout")  # relgen's kernels outside the generated modules
        if dropout is not None and type(dropout.dropout_keep).__name__ != "InterpretedFunction":
            raise RuntimeError(
                "relgen: no CUDA device, and relgen's kernels were defined before TRITON_INTERPRET was set: set "
                "TRITON_INTERPRET=1 in the environment before Python starts (relgen then runs them in Triton's "
                "interpreter on the CPU)"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    if interpreting():
        import numpy

        check_interpreter_numpy(numpy.__version__)


def check_interpreter_numpy(version: str) -> None:
    """A RuntimeError when numpy `version` is one Triton's interpreter cannot run relgen's kernels with."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return  # a development build: let it try
    if (major, minor) >= INTERPRETER_NUMPY_LIMIT:
        raise RuntimeError(
            f"relgen: Triton's interpreter (TRITON_INTERPRET=1, used without a CUDA device) cannot run relgen's "
            f"kernels with numpy {version}: install numpy<2.4 (pip install 'numpy<2.4')"
        )


# ------------------------------------------------------------------------------------------------------------
# storage of the stored projections Z̃ and their gradients dZ̃ for half-precision inputs
# ------------------------------------------------------------------------------------------------------------
#: "fp16" (the default): Z̃ (and dZ̃ for fp16 inputs on the offset path) in fp16, half the buffers' memory and
#: band-gather bytes of fp32, each buffer scaled by a power of two that the device derives from a bound on its
#: entries before writing it, so that no entry overflows for any finite input (relgen.storage); no host check.
#: "fp32": Z̃ and dZ̃ in fp32 for fp16 and bf16 inputs, unscaled.
PROJECTION_STORAGES = ("fp16", "fp32")
#: the environment variable that chooses the storage at start-up
PROJECTION_STORAGE_ENV = "RELGEN_PROJECTION_STORAGE"
_storage: list[str] = []


def projection_storage() -> str:
    """The storage calls use now: set_projection_storage's, else $RELGEN_PROJECTION_STORAGE, else "fp16"."""
    if not _storage:
        mode = os.environ.get(PROJECTION_STORAGE_ENV) or "fp16"
        if mode not in PROJECTION_STORAGES:
            raise ValueError(f"{PROJECTION_STORAGE_ENV}: expected one of {PROJECTION_STORAGES}, got {mode!r}")
        _storage.append(mode)
    return _storage[0]


def set_projection_storage(mode: str) -> None:
    """Choose the storage of every later call in this process (one of PROJECTION_STORAGES)."""
    if not isinstance(mode, str) or mode not in PROJECTION_STORAGES:
        raise ValueError(f"mode: expected one of {PROJECTION_STORAGES}, got {mode!r}")
    _storage[:] = [mode]


# ------------------------------------------------------------------------------------------------------------
# tile configurations: the tuned tables per GPU (relgen.tuning), else the heuristic; the interpreter's
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnTiles:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    #: the key pass only: score tiles [BN, BM] (keys × queries), whose P and dS feed dV's and dK's products with no
    #: transpose. On the H200 that wins for query+key specs (DeBERTa at 8K: 7.6 vs 10.2 ms backward) and loses for
    #: query-only ones (Shaw's key pass 2.86 vs 2.48 ms), so the tuner tries both
    key_major: bool = False


@dataclass(frozen=True)
class ProjectTiles:
    block_t: int
    block_w: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class ReduceTiles:
    block_t: int
    block_w: int
    block_s: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelConfig:
    group: int
    forward: AttnTiles
    backward: AttnTiles  # the query-parallel pass (and the preprocessing)
    project: ProjectTiles
    reduce: ReduceTiles
    backward_kv: AttnTiles | None = None  # the key-parallel pass, when its registers want other tiles

    @property
    def key_pass(self) -> AttnTiles:
        return self.backward_kv or self.backward

    def check(self) -> None:
        tiles = (
            self.forward.block_m,
            self.forward.block_n,
            self.backward.block_m,
            self.backward.block_n,
            self.key_pass.block_m,
            self.key_pass.block_n,
            self.project.block_t,
            self.reduce.block_t,
        )
        bad = [t for t in tiles if self.group % t]
        if bad:
            raise ValueError(f"tile sizes {bad} must divide the group size G={self.group}")
        if self.forward.key_major or self.backward.key_major:
            raise ValueError("key_major tiles are the key pass's only (KernelConfig.backward_kv)")


#: The interpreter runs tiles as numpy arrays: small, unequal tiles keep tests quick and catch index mix-ups
#: (the two backward passes differ too, so neither may assume the other's tiles). The projection's token tile is
#: the forward's query tile: both multiply [32, d] tiles by the table, so that their Z̃^Q agree bitwise here as they
#: do on a GPU (the interpreter's products go through numpy's BLAS, whose rounding can depend on the matrix shape:
#: with 16-token projection tiles an AMD EPYC's OpenBLAS wrote entries one fp32 unit apart).
INTERPRETER_CONFIG = KernelConfig(
    group=32,
    forward=AttnTiles(32, 16),
    backward=AttnTiles(16, 32),
    project=ProjectTiles(32, 32),
    reduce=ReduceTiles(16, 32, 16),
    backward_kv=AttnTiles(32, 16, key_major=True),
)

_override: list[KernelConfig] = []


class override_config:
    """Force a kernel configuration (tests, tuning): `with override_config(cfg): fn(...)`."""

    def __init__(self, config: KernelConfig):
        config.check()
        self.config = config

    def __enter__(self) -> KernelConfig:
        _override.append(self.config)
        return self.config

    def __exit__(self, *exc: object) -> None:
        _override.pop()


def head_block(head_dim: int) -> int:
    """The tile width of the kernels along d: the power of two ≥ d (at least 16, tl.dot's least inner size). A
    head dim that is not a power of two is padded to it, its loads and stores masked along d."""
    return max(16, 1 << (head_dim - 1).bit_length())


def default_config(
    dtype: torch.dtype, head_dim: int, seq_len: int, terms: tuple[str, ...] = ("query",), in_tile: bool = False
) -> KernelConfig:
    """Resource heuristic for CUDA GPUs when no tuned entry exists. in_tile: the band tiles form their relation
    products from Ã (ablation no_projections)."""
    if interpreting():
        return INTERPRETER_CONFIG
    # tiles follow the padded width: d = 80 or 96 runs d = 128's tiles
    block_d = head_block(head_dim)
    big_d = block_d > 64
    fp32 = dtype == torch.float32
    if block_d > 128:
        return _widest_config(fp32, terms)
    # a band tile that gathers both Z^Q and Z^K holds twice the per-score registers: on the H200 64-row forward
    # tiles beat 128 rows for query+key at every tuned length (1.9× at 512 and 2K, 1.35× at 8K; sm90.json)
    two_gathers = "query" in terms and "key" in terms
    # in-tile products hold a [BM, BM + BN − 1] window of fp32 products per band tile: with 128 rows Shaw's 8K
    # forward spills 38 KB per thread, with 64 rows 2 KB (benchmarks/compile_check.py, sm_90)
    wide_rows = not (fp32 or two_gathers or in_tile)
    # 4 warps beat 8 on the H200 for every shipped spec at 8K (docs/performance.md, tile tuning)
    fwd = AttnTiles(
        128 if wide_rows else 64,
        64 if not big_d else 32,
        num_warps=8 if big_d and not fp32 else 4,
        num_stages=3 if not big_d else 2,
    )
    bwd = AttnTiles(64, 64 if not (big_d or fp32) else 32, num_warps=4 if not big_d else 8, num_stages=2)
    return KernelConfig(
        group=128,
        forward=fwd,
        backward=bwd,
        project=ProjectTiles(128, 64, num_warps=4, num_stages=3),
        reduce=ReduceTiles(64, 64, 64 if not big_d else 32, num_warps=4, num_stages=2),
        backward_kv=replace(bwd, key_major=True) if two_gathers else None,
    )


def _widest_config(fp32: bool, terms: tuple[str, ...]) -> KernelConfig:
    """Tiles for d up to 256 (BLOCK_D = 256): a [BN, 256] tile of K or V is 16 KB per 32 keys in fp16 (32 KB in
    fp32), and each pipeline stage holds one of each, so key tiles shrink to 32 keys (16 in fp32) and the stages to
    two, keeping the operands of a stage well inside the H200's 227 KB of shared memory per block; the key pass
    keeps dK and dV [BN, 256] in fp32 registers, so its key tiles are 32 wide (16 in fp32) too."""
    keys = 16 if fp32 else 32
    fwd = AttnTiles(64 if not fp32 else 32, keys, num_warps=8, num_stages=2)
    bwd = AttnTiles(64 if not fp32 else 32, keys, num_warps=8, num_stages=2)
    kv = AttnTiles(32, keys, num_warps=8, num_stages=2, key_major="query" in terms and "key" in terms)
    return KernelConfig(
        group=128,
        forward=fwd,
        backward=bwd,
        project=ProjectTiles(64, 64 if not fp32 else 32, num_warps=4, num_stages=2),
        reduce=ReduceTiles(64, 32, 32, num_warps=4, num_stages=2),
        backward_kv=kv,
    )


def overridden() -> bool:
    """Whether an override_config is active (select_config then ignores the tables)."""
    return bool(_override)


def select_config(plan: PlanInfo, dtype: torch.dtype, head_dim: int, seq_len: int) -> KernelConfig:
    """An override (tests, tuning), else the tuned table entry for this GPU, else the resource heuristic."""
    if _override:
        return _override[-1]
    from relgen import tuning  # lookup tables (relgen tune writes them)

    family = tuning.plan_family(plan)
    return _selected(plan.terms, family, tuning.in_tile(plan), dtype, head_dim, tuning.bucket(seq_len), interpreting())


@functools.lru_cache(maxsize=256)
def _selected(
    terms: tuple[str, ...],
    family: str,
    in_tile: bool,
    dtype: torch.dtype,
    head_dim: int,
    bucket: int,
    interpreted: bool,
):
    """select_config once per (kernel family, dtype, head dim, length bucket): every length of a bucket shares it."""
    from relgen import tuning

    return tuning.lookup(family, dtype, head_dim, bucket) or default_config(dtype, head_dim, bucket, terms, in_tile)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the host (triton.cdiv is a constexpr function now, ten times the cost per call)."""
    return -(-a // b)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def column_splits(token_programs: int, column_blocks: int, device: torch.device) -> int:
    """Into how many runs of columns the projection splits each window: one per token block when that alone
    fills the GPU (each program then streams its whole window), more when there are few token blocks."""
    if device.type != "cuda":
        return min(column_blocks, 2)
    return max(1, min(column_blocks, math.ceil(4 * _sm_count(device) / max(token_programs, 1))))


def table_chunks(items: int, column_programs: int, device: torch.device) -> int:
    """How many fp32 partials the table reductions write: enough programs to fill the GPU, no more."""
    if device.type != "cuda":
        return max(1, min(items, 2))  # at least one: an empty batch still writes its (zero) partial
    return max(1, min(items, math.ceil(2 * _sm_count(device) / max(column_programs, 1))))
