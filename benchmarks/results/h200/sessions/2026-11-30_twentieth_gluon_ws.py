"""Twentieth session: the nineteenth session's Gluon forward (`…_nineteenth_gluon_overlap.py`) with its K / V
copies moved to a producer warp (warp specialization): one warp issues TMA loads into a ring of STAGES slots and
signals them through mbarriers; the consumer warp group (the default partition, 4 warps) never computes an address
or waits at a CTA barrier inside the key loop. The nineteenth session's cp.async version ran plain attention at
1.17 ms (Triton's ceiling kernel 0.958, plain SDPA 0.88–0.96) and Shaw at 1.48 (relgen 1.22–1.25); this probe asks
whether TMA and the producer warp are what it lacked.

Consumer, per visit v (S_v with its relative entries and its per-query shift c_v in registers):
  a. wait for K_{v+1}'s slot, issue S_{v+1} = Q·K_{v+1}ᵀ asynchronously (past the last visit: nothing waited,
     the product of a stale slot dropped);
  b. the online softmax of S_v (exp2, scale folded), P_v in fp16;
  c. wait for O += P_{v−1}·V_{v−1} (S_{v+1} stays in flight), release slot v − 1 to the producer;
  d. wait for V_v, issue O = α·O + P_v·V_v asynchronously;
  e. wait for S_{v+1} (the PV product stays in flight); add its band entries, or take its shift.
With RELATIVE, the consumer first writes its block's Z̃^Q rows (the nineteenth session's prologue) while the
producer is already filling the ring; band tiles are visited first (`_tile_at`).

Not part of relgen: fp16, d = 64, non-causal, N a multiple of 128, no autograd; GPU only for timing.

    python 2026-11-30_twentieth_gluon_ws.py --compile OUT_DIR   sm_90 TTGIR/PTX and ptxas registers (CPU)
    python 2026-11-30_twentieth_gluon_ws.py --smoke [N]         one launch per configuration (a hang is named)
    python 2026-11-30_twentieth_gluon_ws.py --time [N]          on the H200 (relgen importable)
"""

import functools
import importlib.util
import json
import math
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parents[2]
_spec = importlib.util.spec_from_file_location("overlap", HERE / "2026-11-30_nineteenth_gluon_overlap.py")
overlap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overlap)
_tile_at, _band_entries, _write_zq_rows = overlap._tile_at, overlap._band_entries, overlap._write_zq_rows
_softmax_step, _q_block, _first_visit = overlap._softmax_step, overlap._q_block, overlap._first_visit
MAX_REL, ZS, LOG2E = overlap.MAX_REL, overlap.ZS, overlap.LOG2E

_BLK = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))


@gluon.constexpr_function
def _mma_layout(n):
    """The wgmma accumulator's layout of a [BM, n] tile over one warp group."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _producer(descs, ring, bars, coords, STAGES: gl.constexpr):
    k_desc, v_desc = descs
    k_smem, v_smem = ring
    ready_k, ready_v, empty = bars
    _, row0, _, _, NT, nb, b_lo = coords
    BN: gl.constexpr = k_desc.block_type.shape[0]
    for v in range(NT):
        slot = v % STAGES
        mbarrier.wait(empty.index(slot), ((v // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        row = row0 + _tile_at(v, nb, b_lo) * BN
        mbarrier.expect(ready_k.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, 0], ready_k.index(slot), k_smem.index(slot))
        mbarrier.expect(ready_v.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, 0], ready_v.index(slot), v_smem.index(slot))


@gluon.jit
def _consumer(
    q_smem,
    a_smem,
    ring,
    bars,
    coords,
    A,
    Out,
    zrows,
    qk_scale,
    MAXREL: gl.constexpr,
    ZSTRIDE: gl.constexpr,
    STAGES: gl.constexpr,
    RELATIVE: gl.constexpr,
):
    k_smem, v_smem = ring
    ready_k, ready_v, empty = bars
    i0, row0, bh, H, NT, nb, b_lo = coords
    BM: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k_smem.type.shape[1]
    mma: gl.constexpr = _mma_layout(BN)
    mma_o: gl.constexpr = _mma_layout(D)
    C: gl.constexpr = 2 * MAXREL + 1
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    rows_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    offs_m = gl.arange(0, BM, layout=rows_l)
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    zeros_s = gl.zeros([BM, BN], gl.float32, mma)

    if RELATIVE:  # the prologue, while the producer fills the ring
        c_hi, c_lo = _write_zq_rows(q_smem, a_smem, A + (bh % H) * C * D, zrows, qk_scale, MAXREL, ZSTRIDE, mma, _BLK)
    else:
        c_hi = gl.zeros([BM], gl.float32, rows_l)
        c_lo = c_hi

    mbarrier.wait(ready_k.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zeros_s, use_acc=False)
    s, c, m_i, l_i, acc = _first_visit(s, zrows, i0, offs_m, offs_n, nb, b_lo, c_hi, c_lo, MAXREL, RELATIVE, mma_o)
    for v in range(NT):
        nxt = v + 1
        more = nxt < NT
        slot_n = nxt % STAGES
        # a.
        mbarrier.wait(ready_k.index(slot_n), (nxt // STAGES) & 1, pred=more)
        s_next = warpgroup_mma(q_smem, k_smem.index(slot_n).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        # b.
        m_new, l_i, alpha, p16 = _softmax_step(s, c, m_i, l_i, qk_scale, p_op)
        # c.
        o = warpgroup_mma_wait(1, deps=[acc])
        mbarrier.arrive(empty.index((v + STAGES - 1) % STAGES), pred=v > 0)
        # d.
        slot = v % STAGES
        mbarrier.wait(ready_v.index(slot), (v // STAGES) & 1)
        acc = warpgroup_mma(p16, v_smem.index(slot), o * gl.convert_layout(alpha, rows_o)[:, None], is_async=True)
        # e.
        s = warpgroup_mma_wait(1, deps=[s_next])
        tile_n = _tile_at(nxt, nb, b_lo)
        band_n = nxt < nb
        if RELATIVE:
            s = s + _band_entries(zrows, i0, offs_m, offs_n, tile_n, band_n, MAXREL).to(gl.float32)
        c = gl.where(band_n, 0.0, gl.where(tile_n < b_lo, c_hi, c_lo))
        m_i = m_new
    o = warpgroup_mma_wait(0, deps=[acc])
    out = o / gl.convert_layout(l_i, rows_o)[:, None]
    offs_mo = gl.arange(0, BM, layout=rows_o)
    offs_od = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
    gl.store(Out + (row0 + i0 + offs_mo)[:, None] * D + offs_od[None, :], out.to(gl.float16))


@gluon.jit
def ws_forward(
    Q,
    k_desc,
    v_desc,
    A,
    Z,
    Out,
    N,
    H,
    qk_scale,
    MAXREL: gl.constexpr,
    ZSTRIDE: gl.constexpr,
    BM: gl.constexpr,
    STAGES: gl.constexpr,
    RELATIVE: gl.constexpr,
):
    """Q, Out: [B·H·N, D] rows; k_desc, v_desc: TMA descriptors of K and V as [B·H·N, D] with [BN, D] boxes; A:
    Shaw's table [H, 2·MAXREL + 1, D]; Z: Z̃^Q's rows [B·H·N, ZSTRIDE] (written here). RELATIVE = False: plain
    attention (A and Z unused)."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    # visit v waits for K_{v+1}, whose slot visit v − 1 releases only after its PV product: two slots deadlock
    gl.static_assert(STAGES >= 3)
    mma: gl.constexpr = _mma_layout(BN)

    bh, i0, row0, NT, q_smem = _q_block(Q, N, BM, D, BN, _BLK)
    k_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], v_desc.layout)
    a_smem = gl.allocate_shared_memory(gl.float16, [BN if RELATIVE else 8, D], k_desc.layout)
    ready_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(STAGES):
        mbarrier.init(ready_k.index(t), count=1)
        mbarrier.init(ready_v.index(t), count=1)
        mbarrier.init(empty.index(t), count=1)
    fence_async_shared()
    if RELATIVE:
        b_lo = (gl.maximum(i0 - (MAXREL + BN - 1), -BN) + BN) // BN
        nb = gl.minimum(NT, (i0 + BM - 1 + MAXREL + BN) // BN) - b_lo
    else:
        b_lo = 0
        nb = 0
    zrows = Z + (row0 + i0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))).to(gl.int64) * ZSTRIDE
    ring = (k_smem, v_smem)
    bars = (ready_k, ready_v, empty)
    coords = (i0, row0, bh, H, NT, nb, b_lo)
    # the constexprs go straight into the list: a tuple assigned to a name first loses their constexpr-ness
    gl.warp_specialize(
        [
            (
                _consumer,
                (q_smem, a_smem, ring, bars, coords, A, Out, zrows, qk_scale, MAXREL, ZSTRIDE, STAGES, RELATIVE),
            ),
            (_producer, ((k_desc, v_desc), ring, bars, coords, STAGES)),
        ],
        [1],  # one producer warp
        [24],  # its registers
    )


#: (RELATIVE, BM, BN, STAGES, maxnreg)
CONFIGS = (
    (False, 128, 64, 3, 128),
    (False, 128, 64, 4, 128),
    (False, 64, 128, 3, 128),
    (False, 64, 64, 4, 96),
    (True, 128, 64, 3, 128),
    (True, 128, 64, 4, 128),
    (True, 64, 64, 3, 128),
    (True, 64, 128, 3, 128),
)


def _name(relative, bm, bn, stages, maxnreg):
    return f"{'shaw' if relative else 'plain'}_{bm}x{bn}_s{stages}_r{maxnreg}"


def _compile(out: Path) -> None:
    from triton.backends.nvidia.compiler import CUDABackend

    for relative, bm, bn, stages, maxnreg in CONFIGS:
        layout = gl.NVMMASharedLayout.get_default_for([bn, 64], gl.float16)
        desc = f"tensordesc<fp16[{bn}, 64],{layout!r}>"
        signature = {"Q": "*fp16", "k_desc": desc, "v_desc": desc, "A": "*fp16", "Z": "*fp16", "Out": "*fp16"}
        signature |= {"N": "i32", "H": "i32", "qk_scale": "fp32"}
        constant = ("MAXREL", "ZSTRIDE", "BM", "STAGES", "RELATIVE")
        signature |= dict.fromkeys(constant, "constexpr")
        attrs = {(i,): CUDABackend.parse_attr("D") for i in (0, 3, 4, 5, 6)}
        constexprs = dict(zip(constant, (MAX_REL, ZS, bm, stages, relative), strict=True))
        options = {"num_warps": 4, "maxnreg": maxnreg}
        overlap._emit(ws_forward, signature, constexprs, attrs, options, out, _name(relative, bm, bn, stages, maxnreg))


def _time(n: int = 8192, smoke: bool = False) -> None:
    """Errors and do_bench times at length n; with `smoke`, one launch per configuration, announced before and
    after, so that a configuration that hangs can be named and left out (WS_SKIP, comma-separated names)."""
    import os

    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    q, k, v, table, z = overlap._problem(n)
    b, heads, _, d = q.shape

    def descs(bn):
        layout = gl.NVMMASharedLayout.get_default_for([bn, d], gl.float16)
        return tuple(TensorDescriptor.from_tensor(t.view(-1, d), [bn, d], layout) for t in (k, v))

    def gluon_ws(relative, bm, bn, stages, maxnreg, kd, vd):
        o = torch.empty_like(q)
        ws_forward[(n // bm, b * heads)](
            q, kd, vd, table, z, o, n, heads, LOG2E / math.sqrt(d), MAX_REL, ZS, bm, stages, relative,
            num_warps=4, maxnreg=maxnreg,
        )  # fmt: skip
        return o

    skip = set(os.environ.get("WS_SKIP", "").split(","))
    ws = [
        (cfg[0], _name(*cfg), functools.partial(gluon_ws, *cfg, *descs(cfg[2])))
        for cfg in CONFIGS
        if _name(*cfg) not in skip
    ]
    if smoke:
        for _, name, f in ws:
            print(json.dumps({"start": name}), flush=True)
            f()
            torch.cuda.synchronize()
            print(json.dumps({"done": name}), flush=True)
        return
    plain = [(name, f) for relative, name, f in ws if not relative]
    overlap._compare(q, k, v, table, plain, [(name, f) for relative, name, f in ws if relative], reruns=20)


if __name__ == "__main__":
    if sys.argv[1] == "--compile":
        _compile(Path(sys.argv[2]))
    else:
        _time(*(int(a) for a in sys.argv[2:]), smoke=sys.argv[1] == "--smoke")
