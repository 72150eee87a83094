"""Tile configurations: the tiles, warps and stages of each kernel (KernelConfig), the interpreter's, and the
resource heuristic used where no tuned table entry exists (relgen.tiles.tuning)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from relgen.backend import interpreting


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
    #: the key pass only: into how many programs (at most) a grouped-query group's heads split per key tile (each
    #: part's fp32 dK and dV are added afterwards in a fixed order); 0: chosen by tiles.grid.group_splits (a head
    #: a part without dZ̃^K on stored projections, else as many as the GPU needs)
    group_split: int = 0


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

    def with_changes(self, changes: list[str]) -> KernelConfig:
        """This configuration with fields changed as "PART.FIELD=N" (e.g. "forward.num_warps=8"; a change to
        `backward_kv` starts from the key pass's tiles): the what-ifs of benchmarks and compile checks."""
        config = self
        for change in changes:
            try:
                name, value = change.split("=")
                part, field = name.split(".")
                current = getattr(config, part) if part != "backward_kv" else config.key_pass
                config = replace(config, **{part: replace(current, **{field: int(value)})})
            except (AttributeError, TypeError, ValueError) as err:
                raise ValueError(f"tiles: expected PART.FIELD=N (e.g. forward.num_warps=8), got {change!r}") from err
        config.check()
        return config

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
        if self.forward.group_split or (self.backward_kv is not None and self.backward.group_split):
            raise ValueError("group_split is the key pass's only (KernelConfig.backward_kv)")
        split = self.key_pass.group_split
        if split < 0:
            raise ValueError(f"group_split: expected 0 (by the grid) or a part count ≥ 1, got {split}")


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
    # 4 warps beat 8 on the H200 for every shipped spec at 8K (docs/performance.md, tile tuning), except with in-tile
    # products, whose [BM, 2·BN] window of fp32 products spills with 4 (sm_90: TXL 928 B a thread, Shaw 2.1 KB,
    # DeBERTa 6.8 KB; with 8: 0, 148 B, 1.6 KB): TXL's forward 88.3 → 60.7 ms at 32K on the H200
    fwd = AttnTiles(
        128 if wide_rows else 64,
        64 if not big_d else 32,
        num_warps=8 if (big_d or in_tile) and not fp32 else 4,
        num_stages=3 if not big_d else 2,
    )
    # in-tile products: the backward's passes also skew dS back onto the band (_unskew) and the table pass holds
    # [2B, d] fp32 accumulators; with 4 warps TXL's query pass spills 3.8 KB per thread at 8K, with 8 warps 1.2 KB
    # (benchmarks/compile_check.py, sm_90)
    bwd = AttnTiles(64, 64 if not (big_d or fp32) else 32, num_warps=8 if big_d or in_tile else 4, num_stages=2)
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
