"""Nineteenth session: plain attention in Gluon with the next key tile's QK product in flight during the current
tile's softmax (FlashAttention-3's intra-warpgroup overlap), to learn whether that schedule — which Triton 3.6 does
not generate for relgen's forward (it waits for a QK product right after issuing it, even one a loop iteration
ahead; CPU TTGIR, NOTES.md nineteenth session) — lifts the forward's plain-attention ceiling (0.958 ms at 8K on the
H200, plain SDPA 0.85–0.94). Not part of relgen: plain attention only (no relative terms), non-causal, fp16, d = 64,
N a multiple of the key tile, GPU only for timing (Gluon does not run in Triton's interpreter).

Per program BM queries of one (batch, head), one warp group (4 warps). K and V stream through a cp.async ring of
STAGES slots (one copy group per key tile). Iteration j, with S_j = Q·K_jᵀ in registers:
  a. wait for tile j + 1's copies;
  b. issue S_{j+1} = Q·K_{j+1}ᵀ, asynchronous (the last iteration multiplies an empty slot and drops the result);
  c. the online softmax of S_j (exp2, scale folded), P_j in fp16;
  d. wait for O += P_{j−1}·V_{j−1} (the oldest outstanding product; S_{j+1} stays in flight);
  e. issue O = α·O + P_j·V_j, asynchronous;
  f. a CTA barrier, then the copies of tile j + STAGES − 1 into the slot tile j − 1 used (its products are done);
  g. wait for S_{j+1} (O += P_j·V_j stays in flight).

    python 2026-11-30_nineteenth_gluon_overlap.py --compile OUT_DIR   sm_90 PTX/TTGIR and ptxas registers on the CPU
    python 2026-11-30_nineteenth_gluon_overlap.py --time [N]          on the H200: error against SDPA, then
                                                                      do_bench against SDPA and relgen's plain
                                                                      ceiling kernel (benchmarks/plain_ceiling.py)

Compiled on the CPU only (this session's device time was spent); not yet run.
"""

import json
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634


@gluon.jit
def _kv_copy(k_slot, v_slot, K, V, row0, tile, NT, BN: gl.constexpr, D: gl.constexpr, blk: gl.constexpr):
    """One copy group: tile `tile`'s K and V rows into a ring slot (an empty group past the last tile, so that the
    groups still count one per tile)."""
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    at = (row0 + tile * BN + offs_n)[:, None] * D + offs_d[None, :]
    real = (tile < NT) & (offs_n < BN)[:, None]
    async_copy.async_copy_global_to_shared(k_slot, K + at, mask=real)
    async_copy.async_copy_global_to_shared(v_slot, V + at, mask=real)
    async_copy.commit_group()


@gluon.jit
def plain_overlap(Q, K, V, Out, N, qk_scale, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.float16)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.float16)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    rows_o: gl.constexpr = gl.SliceLayout(1, mma_o)

    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    i0 = pid_m * BM
    row0 = bh * N
    NT = N // BN
    offs_qm = gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q = gl.load(Q + (row0 + i0 + offs_qm)[:, None] * D + offs_d[None, :])
    q_smem = gl.allocate_shared_memory(gl.float16, [BM, D], q_sl, q)
    k_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], kv_sl)
    v_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], kv_sl)

    for t in gl.static_range(STAGES - 1):
        _kv_copy(k_smem.index(t), v_smem.index(t), K, V, row0, t, NT, BN, D, blk)
    async_copy.wait_group(STAGES - 2)  # tile 0
    gl.thread_barrier()
    fence_async_shared()
    zeros_s = gl.zeros([BM, BN], gl.float32, mma)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zeros_s, use_acc=False)
    m_i = gl.full([BM], float("-inf"), gl.float32, rows_l)
    l_i = gl.zeros([BM], gl.float32, rows_l)
    acc = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, mma_o))
    for j in range(NT):
        # a. tile j + 1 has landed (groups issued: tiles up to j + STAGES − 2)
        async_copy.wait_group(STAGES - 3)
        gl.thread_barrier()
        fence_async_shared()
        # b. the next tile's scores, in flight during this tile's softmax
        s_next = warpgroup_mma(
            q_smem, k_smem.index((j + 1) % STAGES).permute((1, 0)), zeros_s, use_acc=False, is_async=True
        )
        # c. online softmax of S_j
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        p16 = gl.convert_layout(p.to(gl.float16), p_op)
        # d. O += P_{j−1}·V_{j−1} done (S_{j+1} stays in flight)
        o = warpgroup_mma_wait(1, deps=[acc])
        # e.
        acc = warpgroup_mma(p16, v_smem.index(j % STAGES), o * gl.convert_layout(alpha, rows_o)[:, None], is_async=True)
        # f. tile j − 1's slot is free once every warp is past d: tile j + STAGES − 1 goes there
        gl.thread_barrier()
        nxt = j + STAGES - 1
        _kv_copy(k_smem.index(nxt % STAGES), v_smem.index(nxt % STAGES), K, V, row0, nxt, NT, BN, D, blk)
        # g. S_{j+1} (O += P_j·V_j stays in flight)
        s = warpgroup_mma_wait(1, deps=[s_next])
    o = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)
    out = o / gl.convert_layout(l_i, rows_o)[:, None]
    offs_m = gl.arange(0, BM, layout=rows_o)
    offs_od = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
    gl.store(Out + (row0 + i0 + offs_m)[:, None] * D + offs_od[None, :], out.to(gl.float16))


CONFIGS = ((128, 64, 3), (128, 64, 4), (64, 64, 3), (64, 128, 3), (128, 128, 3))


def _compile(out: Path) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/, for compile_check's ptxas report
    from compile_check import ptxas_usage

    out.mkdir(parents=True, exist_ok=True)
    signature = {
        "Q": "*fp16",
        "K": "*fp16",
        "V": "*fp16",
        "Out": "*fp16",
        "N": "i32",
        "qk_scale": "fp32",
        "BM": "constexpr",
        "BN": "constexpr",
        "D": "constexpr",
        "STAGES": "constexpr",
    }
    attrs = {(i,): CUDABackend.parse_attr("D") for i in range(5)}  # a launch at N = 8192: aligned, N % 16 = 0
    for bm, bn, stages in CONFIGS:
        constexprs = {"BM": bm, "BN": bn, "D": 64, "STAGES": stages}
        src = GluonASTSource(plain_overlap, signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        name = f"plain_overlap_{bm}x{bn}_s{stages}"
        (out / f"{name}.ttgir").write_text(compiled.asm["ttgir"])
        (out / f"{name}.ptx").write_text(compiled.asm["ptx"])
        usage = ptxas_usage(compiled.asm["ptx"], 90)
        print(json.dumps({"config": name, "shared": compiled.metadata.shared, "ptxas": usage}), flush=True)


def _time(n: int = 8192, heads: int = 12, tokens: int = 16384, d: int = 64) -> None:
    import functools
    import math

    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
    from plain_ceiling import plain_forward

    b = tokens // n
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, d, device="cuda", generator=gen).half() for _ in range(3))
    scale = LOG2E / math.sqrt(d)
    ref = F.scaled_dot_product_attention(q, k, v)

    def gluon_fwd(bm, bn, stages):
        o = torch.empty_like(q)
        plain_overlap[(n // bm, b * heads)](q, k, v, o, n, scale, bm, bn, d, stages, num_warps=4)
        return o

    systems = [
        ("sdpa_plain", lambda: F.scaled_dot_product_attention(q, k, v)),
        ("triton_128x64_s4", functools.partial(plain_forward, q, k, v, 128, 64, 4, 4, True, False)),
    ]
    systems += [(f"gluon_{bm}x{bn}_s{s}", functools.partial(gluon_fwd, bm, bn, s)) for bm, bn, s in CONFIGS]
    for name, fn in systems:
        try:
            err = (fn().float() - ref.float()).abs().max().item()
        except Exception as exc:  # a configuration that fails to compile or launch is a finding
            err = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps({"system": name, "max_err_vs_sdpa": err}), flush=True)
    times = {name: [] for name, _ in systems}
    for _ in range(3):  # alternating rounds
        for name, fn in systems:
            try:
                times[name].append(round(do_bench(fn, warmup=50, rep=200, return_mode="median"), 4))
            except Exception as exc:
                times[name].append(f"{type(exc).__name__}"[:80])
    print(json.dumps({"n": n, "ms": times}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--compile":
        _compile(Path(sys.argv[2]))
    else:
        _time(*(int(a) for a in sys.argv[2:]))
