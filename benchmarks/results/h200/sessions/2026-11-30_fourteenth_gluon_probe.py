"""Fourteenth session, CPU only: what a band tile's clamped gather costs when it is loaded straight into the wgmma
accumulator's layout (Gluon), against Triton's choice (one row per thread, then a conversion through shared
memory: 1075-1093 SASS instructions and 17 barriers per edge-tile iteration of Shaw's 8K forward). The same loop is
also compiled as plain Triton (band_probe_triton), so that the two compilers' choices are compared on one loop.

The probe kernel is one band loop reduced to what the gather touches: per key tile, K into shared memory, the
clamped entries of Z̃^Q loaded in the accumulator's layout, S = Q·Kᵀ + rel by one wgmma with rel as its
accumulator, and exp2(S) summed (a stand-in for the softmax, so that nothing is dead code). Compiled for sm_90
with Triton's bundled ptxas (no GPU needed), once with the gather and once with rel = 0; SASS per loop counted by
`2026-11-30_thirteenth_sass_loops.py` (cuobjdump -sass K.cubin > K.sass first).

    python 2026-11-30_fourteenth_gluon_probe.py OUT_DIR     compile for sm_90 (no GPU needed)
    python 2026-11-30_fourteenth_gluon_probe.py --time      on a GPU: time the four loops
"""

import json
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def band_probe(Q, K, Z, OUT, ZS, first0, W, n_tiles, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
               GATHER: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.float16)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.float16)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    offs_qm = gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
    pid = gl.program_id(0)
    Q += pid * BM * D
    Z += pid * BM * ZS
    OUT += pid * BM * BN
    q_smem = gl.allocate_shared_memory(gl.float16, [BM, D], q_sl, gl.load(Q + offs_qm[:, None] * D + offs_d[None, :]))
    k_smem = gl.allocate_shared_memory(gl.float16, [BN, D], k_sl)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    offs_kn = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    rows = Z + offs_m * ZS
    acc = gl.zeros([BM, BN], gl.float32, mma)
    for t in range(n_tiles):
        k_smem.store(gl.load(K + (t * BN + offs_kn)[:, None] * D + offs_d[None, :]))
        fence_async_shared()
        if GATHER:
            cols = gl.minimum(gl.maximum(offs_m[:, None] + (first0 - t * BN) - offs_n[None, :], 0), W - 1)
            rel = gl.load(rows[:, None] + cols).to(gl.float32)
        else:
            rel = gl.zeros([BM, BN], gl.float32, mma)
        s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), rel, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        acc += gl.exp2(s)
    gl.store(OUT + offs_m[:, None] * BN + offs_n[None, :], acc)


@triton.jit
def band_probe_triton(Q, K, Z, OUT, ZS, first0, W, n_tiles, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                      GATHER: tl.constexpr):
    """The same loop in Triton, whose compiler chooses the gather's layout."""
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    pid = tl.program_id(0)
    Q += pid * BM * D
    Z += pid * BM * ZS
    OUT += pid * BM * BN
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])
    acc = tl.zeros([BM, BN], tl.float32)
    for t in range(n_tiles):
        k = tl.load(K + (t * BN + offs_n)[:, None] * D + offs_d[None, :])
        if GATHER:
            cols = tl.minimum(tl.maximum(offs_m[:, None] + (first0 - t * BN) - offs_n[None, :], 0), W - 1)
            rel = tl.load(Z + offs_m[:, None] * ZS + cols).to(tl.float32)
        else:
            rel = tl.zeros([BM, BN], tl.float32)
        acc += tl.exp2(tl.dot(q, tl.trans(k), rel))
    tl.store(OUT + offs_m[:, None] * BN + offs_n[None, :], acc)


def time_on_gpu(programs: int = 1536, tiles: int = 10) -> None:
    """On a GPU: each variant over `programs` blocks of 128 queries and `tiles` key tiles (Shaw's 8K forward has
    1536 programs and 10 band tiles each), its ms by do_bench, and Gluon's sums against Triton's."""
    import torch
    from triton.testing import do_bench

    BM, BN, D, ZS, W = 128, 64, 64, 520, 513
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(programs * BM, D, device="cuda", generator=gen).half()
    k = torch.randn(tiles * BN, D, device="cuda", generator=gen).half()
    z = torch.randn(programs * BM, ZS, device="cuda", generator=gen).half()
    first0 = 256 + BN * (tiles // 2)  # the clamp reaches both ends of the window over the tiles
    sums = {}
    for gather in (True, False):
        for name, kernel in (("gluon", band_probe), ("triton", band_probe_triton)):
            out = torch.empty(programs * BM, BN, device="cuda")

            def run(kernel=kernel, out=out, gather=gather):
                kernel[(programs,)](q, k, z, out, ZS, first0, W, tiles, BM, BN, D, gather, num_warps=4)

            run()
            sums[name, gather] = out.clone()
            print(json.dumps({"probe": name, "gather": gather, "ms": do_bench(run, warmup=50, rep=300)}))
    same = torch.allclose(sums["gluon", True], sums["triton", True], rtol=1e-5, atol=1e-3)
    print(json.dumps({"gluon_matches_triton": same}))


def main() -> None:
    if sys.argv[1:] == ["--time"]:
        time_on_gpu()
        return
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    signature = {"Q": "*fp16", "K": "*fp16", "Z": "*fp16", "OUT": "*fp32", "ZS": "i32", "first0": "i32", "W": "i32",
                 "n_tiles": "i32", "BM": "constexpr", "BN": "constexpr", "D": "constexpr", "GATHER": "constexpr"}
    for gather in (True, False):  # the gather's cost is the difference of the two loops
        name = "band_probe" if gather else "band_probe_nogather"
        src = GluonASTSource(band_probe, signature, constexprs={"BM": 128, "BN": 64, "D": 64, "GATHER": gather})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        for kind in ("ttgir", "ptx"):
            (out / f"{name}.{kind}").write_text(compiled.asm[kind])
        (out / f"{name}.cubin").write_bytes(compiled.asm["cubin"])
        print(f"{name}: {out / name}.cubin, shared memory {compiled.metadata.shared} B")
        src = ASTSource(band_probe_triton, signature, constexprs={"BM": 128, "BN": 64, "D": 64, "GATHER": gather})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
        (out / f"{name}_triton.cubin").write_bytes(compiled.asm["cubin"])
        (out / f"{name}_triton.ttgir").write_text(compiled.asm["ttgir"])
        print(f"{name}_triton: {out / name}_triton.cubin, shared memory {compiled.metadata.shared} B")


if __name__ == "__main__":
    main()
