"""Fourteenth session: a Gluon prototype of Shaw's forward (saturating clipped map, query term, non-causal, no
masks or dropout, fp16, d = 64), to learn on the H200 whether the band gathers loaded in the wgmma accumulator's
layout bring the forward within the stretch (0.75× plain SDPA). Not part of relgen: one problem shape, no
autograd, GPU only (Gluon does not run in Triton's interpreter).

Per program, 128 queries of one (batch, head), 4 warps:
- prologue: Z̃^Q for the block's rows, all C = 2·256 + 1 columns (row i, column s = clip(δ, −256, 256) + 256),
  by wgmma against 64-row tiles of the table, stored at a row pitch of 520 as relgen does; then a CTA barrier;
- one pipelined loop over the key tiles (cp.async into a two-slot ring): the band tiles first, each reading its
  entries at the clamped column straight into the accumulator's layout and using them as the QK product's
  accumulator; then the saturated tiles, whose entry is one per query (column 512 before the band, 0 after),
  added as a per-row shift of the online softmax.

    python 2026-11-30_fourteenth_gluon_forward.py --compile OUT_DIR   sm_90 SASS on the CPU
    python 2026-11-30_fourteenth_gluon_forward.py --time              on the H200 (relgen and pydantic importable)
"""

import json
import math
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
)

MAX_REL = 256  # Shaw's clipping distance (specs/shaw.yaml)
ZS = 520  # Z̃^Q's row pitch: C = 513 columns padded to 8


@gluon.jit
def _kv_copy(k_slot, v_slot, K, V, row0, tile, BN: gl.constexpr, D: gl.constexpr, blk: gl.constexpr):
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    at = (row0 + tile * BN + offs_n)[:, None] * D + offs_d[None, :]
    async_copy.async_copy_global_to_shared(k_slot, K + at)
    async_copy.async_copy_global_to_shared(v_slot, V + at)
    async_copy.commit_group()


@gluon.jit
def _tile_at(v, nb, b_lo):
    """The v-th key tile a program visits: its nb band tiles from b_lo on, then the others in ascending order."""
    return gl.where(v < nb, b_lo + v, gl.where(v - nb < b_lo, v - nb, v))


@gluon.jit
def shaw_forward(Q, K, V, A, Z, Out, N, H, qk_scale, MAXREL: gl.constexpr, ZSTRIDE: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, GATHER: gl.constexpr = True,
                 STAGES: gl.constexpr = 2):
    """GATHER = False: the band tiles add nothing (wrong results; their cost by difference). STAGES: slots of
    the K/V ring (copies run STAGES − 1 tiles ahead)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.float16)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.float16)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    C: gl.constexpr = 2 * MAXREL + 1

    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    i0 = pid_m * BM
    row0 = bh * N  # this (batch, head)'s first token row
    offs_qm = gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q = gl.load(Q + (row0 + i0 + offs_qm)[:, None] * D + offs_d[None, :])
    q_smem = gl.allocate_shared_memory(gl.float16, [BM, D], q_sl, q)
    offs_m = gl.arange(0, BM, layout=rows_l)
    offs_n = gl.arange(0, BN, layout=cols_l)
    zrows = Z + (row0 + i0 + offs_m).to(gl.int64) * ZSTRIDE

    # prologue: Z̃^Q[i, s] = q_i · a_s for the block's rows
    a_smem = gl.allocate_shared_memory(gl.float16, [BN, D], kv_sl)
    offs_an = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    table = A + (bh % H) * C * D
    for w0 in range(0, ZSTRIDE, BN):
        a = gl.load(table + (w0 + offs_an)[:, None] * D + offs_d[None, :], mask=(w0 + offs_an < C)[:, None],
                    other=0.0)
        a_smem.store(a)
        fence_async_shared()
        gl.thread_barrier()
        z = warpgroup_mma(q_smem, a_smem.permute((1, 0)), gl.zeros([BM, BN], gl.float32, mma), use_acc=False)
        cols = w0 + offs_n
        gl.store(zrows[:, None] + cols[None, :], z.to(gl.float16), mask=(cols < ZSTRIDE)[None, :])
        gl.thread_barrier()  # every warp's product is done before the next tile overwrites a_smem
    c_hi = gl.load(zrows + (C - 1)).to(gl.float32) * qk_scale  # pairs with δ ≥ 256
    c_lo = gl.load(zrows).to(gl.float32) * qk_scale  # δ ≤ −256

    # key tiles: band [b_lo, b_hi) first, then the rest in ascending order
    NT = N // BN
    b_lo = (gl.maximum(i0 - (MAXREL + BN - 1), -BN) + BN) // BN
    b_hi = gl.minimum(NT, (i0 + BM - 1 + MAXREL + BN) // BN)
    nb = b_hi - b_lo

    k_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], kv_sl)
    v_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], kv_sl)
    m_i = gl.full([BM], float("-inf"), gl.float32, rows_l)
    l_i = gl.zeros([BM], gl.float32, rows_l)
    acc = gl.zeros([BM, D], gl.float32, mma)
    for t in gl.static_range(STAGES - 1):  # one copy group per tile, empty where there is none
        if t < NT:
            _kv_copy(k_smem.index(t), v_smem.index(t), K, V, row0, _tile_at(t, nb, b_lo), BN, D, blk)
        else:
            async_copy.commit_group()
    for v in range(NT):
        tile = _tile_at(v, nb, b_lo)
        slot = v % STAGES
        async_copy.wait_group(STAGES - 2)  # tile v's copies have landed
        gl.thread_barrier()  # ... for every thread, and every warp is done with tile v − 1's slot
        fence_async_shared()
        nxt = v + STAGES - 1
        if nxt < NT:
            _kv_copy(k_smem.index(nxt % STAGES), v_smem.index(nxt % STAGES), K, V, row0, _tile_at(nxt, nb, b_lo),
                     BN, D, blk)
        else:
            async_copy.commit_group()
        if GATHER and (v < nb):
            offs_j = tile * BN + offs_n
            cols = gl.minimum(gl.maximum((i0 + offs_m)[:, None] - offs_j[None, :] + MAXREL, 0), C - 1)
            rel = gl.load(zrows[:, None] + cols).to(gl.float32)
            c = gl.zeros([BM], gl.float32, rows_l)
        else:
            rel = gl.zeros([BM, BN], gl.float32, mma)
            c = gl.where(v < nb, 0.0, gl.where(tile < b_lo, c_hi, c_lo))
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), rel)
        x = s * qk_scale + c[:, None]
        m_new = gl.maximum(m_i, gl.max(x, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(x - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        p16 = gl.convert_layout(p.to(gl.float16), p_op)
        acc = warpgroup_mma(p16, v_smem.index(slot), acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    offs_od = gl.arange(0, D, layout=cols_l)
    gl.store(Out + (row0 + i0 + offs_m)[:, None] * D + offs_od[None, :], out.to(gl.float16))


def _compile(out: Path) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    out.mkdir(parents=True, exist_ok=True)
    from triton.backends.nvidia.compiler import CUDABackend

    signature = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "A": "*fp16", "Z": "*fp16", "Out": "*fp16", "N": "i32",
                 "H": "i32", "qk_scale": "fp32", "MAXREL": "constexpr", "ZSTRIDE": "constexpr", "BM": "constexpr",
                 "BN": "constexpr", "D": "constexpr", "GATHER": "constexpr", "STAGES": "constexpr"}
    constexprs = {"MAXREL": MAX_REL, "ZSTRIDE": ZS, "BM": 128, "BN": 64, "D": 64, "GATHER": True, "STAGES": 3}
    # what the JIT would specialise a launch at N = 8192 on: 16-byte aligned pointers, N a multiple of 16
    attrs = {(i,): CUDABackend.parse_attr("D") for i in range(7)}
    src = GluonASTSource(shaw_forward, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    (out / "shaw_forward.ttgir").write_text(compiled.asm["ttgir"])
    (out / "shaw_forward.ptx").write_text(compiled.asm["ptx"])
    (out / "shaw_forward.cubin").write_bytes(compiled.asm["cubin"])
    print(f"compiled: shared memory {compiled.metadata.shared} B -> {out}")


def _time(n: int = 8192, heads: int = 12, tokens: int = 16384, d: int = 64) -> None:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    import relgen

    b = tokens // n
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, d, device="cuda", generator=gen).half() for _ in range(3))
    table = (0.5 * torch.randn(heads, 2 * MAX_REL + 1, d, device="cuda", generator=gen)).half()
    z = torch.empty(b * heads * n, ZS, device="cuda", dtype=torch.float16)
    o = torch.empty_like(q)
    scale = 1 / math.sqrt(d)

    def gluon_fwd(gather=True, stages=2):
        shaw_forward[(n // 128, b * heads)](q, k, v, table, z, o, n, heads, scale * 1.4426950408889634, MAX_REL, ZS,
                                            128, 64, d, gather, stages, num_warps=4)

    def gluon_nogather():
        gluon_fwd(False)

    def gluon_s3():
        gluon_fwd(True, 3)

    fn = relgen.compile_mechanism(relgen.load_spec(Path(__file__).resolve().parents[4] / "specs" / "shaw.yaml"))

    def relgen_fwd():
        return fn(q, k, v, aq=table)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v)

    gluon_fwd()
    want = relgen_fwd()
    o2 = o.clone()
    gluon_s3()
    torch.cuda.synchronize()
    three_stages_same = torch.equal(o, o2)
    torch.cuda.synchronize()
    # the FP32 oracle on one head: S = (q·k + q·a_{clip(i−j)}) / sqrt(d)
    qf, kf, vf, af = q[0, 0].float(), k[0, 0].float(), v[0, 0].float(), table[0].float()
    idx = torch.arange(n, device="cuda")
    rows = (idx[:, None] - idx[None, :]).clamp(-MAX_REL, MAX_REL) + MAX_REL
    ref = torch.softmax(((qf @ kf.T) + torch.gather(qf @ af.T, 1, rows)) * scale, -1) @ vf
    report = {
        "n": n,
        "gluon_vs_fp32": (o[0, 0].float() - ref).abs().max().item(),
        "relgen_vs_fp32": (want[0, 0].float() - ref).abs().max().item(),
        "gluon_vs_relgen": (o.float() - want.float()).abs().max().item(),
        "three_stages_bitwise_same": three_stages_same,
    }
    print(json.dumps(report), flush=True)
    systems = (("gluon", gluon_fwd), ("relgen", relgen_fwd), ("sdpa_plain", sdpa), ("gluon_nogather", gluon_nogather),
               ("gluon_3_stages", gluon_s3))
    times = {name: [] for name, _ in systems}
    for _ in range(3):  # alternating rounds
        for name, f in systems:
            times[name].append(round(do_bench(f, warmup=100, rep=400), 4))
    print(json.dumps({"n": n, "ms": times}))


if __name__ == "__main__":
    if sys.argv[1] == "--compile":
        _compile(Path(sys.argv[2]))
    else:
        _time(*(int(a) for a in sys.argv[2:]))
