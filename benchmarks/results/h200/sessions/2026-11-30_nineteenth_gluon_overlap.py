"""Nineteenth session: attention forwards in Gluon with the next key tile's QK product in flight during the current
tile's softmax (FlashAttention-3's intra-warp-group overlap), the schedule Triton 3.6 does not generate for relgen's
forward (it waits for a QK product right after issuing it, even one a loop iteration ahead:
`…_nineteenth_triton_skew_probe.py`). Two questions for the H200: does it lift plain attention above this design's
Triton ceiling (0.958 ms at 8K; plain SDPA 0.85–0.94), and Shaw's forward to the stretch (≤ 1.165 ms; relgen
1.214–1.232)? Not part of relgen: fp16, d = 64, non-causal, N a multiple of 128, no autograd; Shaw's map only
(clipped at ±256, query term); GPU only for timing (Gluon does not run in Triton's interpreter).

One kernel, `overlap_forward`; RELATIVE = False is plain attention. Per program BM queries of one (batch, head),
4 warps (one warp group). With RELATIVE, as the fourteenth session's prototype (`…_fourteenth_gluon_forward.py`):
a prologue writes the block's Z̃^Q rows (all 513 columns, pitch 520) by products against the table, band tiles
are visited first and read their entries at the clamped column in the accumulator's layout, saturated tiles add
one end entry per query. K and V stream through a cp.async ring of STAGES slots, one copy group per visit. Visit
v, with S_v (its relative entries added) and its per-query shift c_v in registers (`_visit`):
  a. wait for visit v + 1's copies;
  b. issue S_{v+1} = Q·K_{v+1}ᵀ asynchronously (past the last visit: an empty slot, the result dropped);
     b'. GATHER_AHEAD: load visit v + 1's band entries now, so that their latency passes during the softmax;
  c. the online softmax of S_v (exp2, scale folded), P_v in fp16;
  d. wait for O += P_{v−1}·V_{v−1}, the oldest outstanding product (S_{v+1} stays in flight);
  e. issue O = α·O + P_v·V_v asynchronously;
  f. a CTA barrier (a warp's wgmma wait covers the products it committed), then the copies of visit
     v + STAGES − 1 into the slot visit v − 1 used;
  g. wait for S_{v+1} (O += P_v·V_v stays in flight); add its band entries, or take its shift.
Band visits and saturated visits run as two loops over that one body (gathers only in the first).

    python 2026-11-30_nineteenth_gluon_overlap.py --compile OUT_DIR   sm_90 TTGIR/PTX and ptxas registers (CPU)
    python 2026-11-30_nineteenth_gluon_overlap.py --time [N]          on the H200 (relgen importable): errors,
        then do_bench in alternating rounds: plain against plain SDPA and the Triton ceiling kernel
        (benchmarks/plain_ceiling.py), Shaw against relgen and plain SDPA

Compiled on the CPU in the nineteenth session; run on the H200 in the twentieth
(`…_twentieth_call1_gluon_overlap_8192.log`: exact, and slower than Triton's kernels; NOTES.md, "Twentieth
session"). Its host-side helpers (`_emit`, `_problem`, `_compare`) and kernel helpers serve
`…_twentieth_gluon_ws.py` too.
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
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

BENCHMARKS = Path(__file__).resolve().parents[3]
MAX_REL = 256  # Shaw's clipping distance (specs/shaw.yaml)
ZS = 520  # Z̃^Q's row pitch: C = 513 columns padded to 8
LOG2E = 1.4426950408889634


@gluon.jit
def _tile_at(v, nb, b_lo):
    """The v-th key tile a program visits: its nb band tiles from b_lo on, then the others in ascending order."""
    return gl.where(v < nb, b_lo + v, gl.where(v - nb < b_lo, v - nb, v))


@gluon.jit
def _kv_copy(k_slot, v_slot, K, V, row0, v, NT, nb, b_lo, BN: gl.constexpr, D: gl.constexpr, blk: gl.constexpr):
    """One copy group: visit v's K and V rows into a ring slot (an empty group past the last visit, so that the
    groups still count one per visit)."""
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    at = (row0 + _tile_at(v, nb, b_lo) * BN + offs_n)[:, None] * D + offs_d[None, :]
    real = (v < NT) & (offs_n < BN)[:, None]
    async_copy.async_copy_global_to_shared(k_slot, K + at, mask=real)
    async_copy.async_copy_global_to_shared(v_slot, V + at, mask=real)
    async_copy.commit_group()


@gluon.jit
def _band_entries(zrows, i0, offs_m, offs_n, tile, band, MAXREL: gl.constexpr):
    """A band tile's entries q_i·a_{s(δ)} (fp16, the accumulator's layout), read at the clamped column; zeros (no
    memory traffic) when `band` is false."""
    C: gl.constexpr = 2 * MAXREL + 1
    j = tile * offs_n.shape[0] + offs_n
    cols = gl.minimum(gl.maximum((i0 + offs_m)[:, None] - j[None, :] + MAXREL, 0), C - 1)
    return gl.load(zrows[:, None] + cols, mask=band & (cols >= 0), other=0.0)


@gluon.jit
def _softmax_step(s, c, m_i, l_i, qk_scale, p_op: gl.constexpr):
    """One tile of the online softmax in exp2 (scale folded, c the per-query shift): the new running maximum and
    sum, the rescaling of what came before, and P in fp16 in the PV product's operand layout."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale + c)
    p = gl.exp2(s * qk_scale - (m_new - c)[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return m_new, l_i, alpha, gl.convert_layout(p.to(gl.float16), p_op)


@gluon.jit
def _q_block(Q, N, BM: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, blk: gl.constexpr):
    """The program's place (query block, batch·head, its first query and its sequence's first row, key tiles) and
    its [BM, D] query tile in shared memory."""
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    i0 = pid_m * BM
    row0 = bh * N
    offs_qm = gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    q = gl.load(Q + (row0 + i0 + offs_qm)[:, None] * D + offs_d[None, :])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.float16)
    return bh, i0, row0, N // BN, gl.allocate_shared_memory(gl.float16, [BM, D], q_sl, q)


@gluon.jit
def _first_visit(
    s, zrows, i0, offs_m, offs_n, nb, b_lo, c_hi, c_lo, MAXREL: gl.constexpr, RELATIVE: gl.constexpr, mma_o
):
    """Visit 0's scores with their relative entries (a band tile's) and per-query shift (a saturated tile's), and
    the online softmax's state before it: (S_0, c_0, m, l, O)."""
    BM: gl.constexpr = s.shape[0]
    D: gl.constexpr = mma_o.instr_shape[1]
    rows_l: gl.constexpr = gl.SliceLayout(1, s.type.layout)
    tile0 = _tile_at(0, nb, b_lo)
    if RELATIVE:
        s = s + _band_entries(zrows, i0, offs_m, offs_n, tile0, nb > 0, MAXREL).to(gl.float32)
    c = gl.where(nb > 0, 0.0, gl.where(tile0 < b_lo, c_hi, c_lo))
    m_i = gl.full([BM], float("-inf"), gl.float32, rows_l)
    l_i = gl.zeros([BM], gl.float32, rows_l)
    return s, c, m_i, l_i, warpgroup_mma_init(gl.zeros([BM, D], gl.float32, mma_o))


@gluon.jit
def _write_zq_rows(q_smem, a_smem, table, zrows, qk_scale, MAXREL: gl.constexpr, ZSTRIDE: gl.constexpr, mma, blk):
    """The prologue: the block's rows of Z̃^Q, Z̃^Q[i, s] = q_i · a_s (one head's table, a column tile of a_smem's
    height at a time); returns the end columns' terms, scaled, (δ ≥ MAXREL, δ ≤ −MAXREL)."""
    BM: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = a_smem.type.shape[0]
    C: gl.constexpr = 2 * MAXREL + 1
    offs_an = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    for w0 in range(0, ZSTRIDE, BN):
        a = gl.load(table + (w0 + offs_an)[:, None] * D + offs_d[None, :], mask=(w0 + offs_an < C)[:, None], other=0.0)
        a_smem.store(a)
        fence_async_shared()
        gl.thread_barrier()
        z = warpgroup_mma(q_smem, a_smem.permute((1, 0)), gl.zeros([BM, BN], gl.float32, mma), use_acc=False)
        cols = w0 + offs_n
        gl.store(zrows[:, None] + cols[None, :], z.to(gl.float16), mask=(cols < ZSTRIDE)[None, :])
        gl.thread_barrier()  # every warp's product is done before the next tile overwrites a_smem
    c_hi = gl.load(zrows + (C - 1)).to(gl.float32) * qk_scale  # pairs with δ ≥ MAXREL
    c_lo = gl.load(zrows).to(gl.float32) * qk_scale  # δ ≤ −MAXREL
    return c_hi, c_lo


@gluon.jit
def _visit(
    v,
    s,
    c,
    m_i,
    l_i,
    acc,
    q_smem,
    k_smem,
    v_smem,
    K,
    V,
    zrows,
    row0,
    i0,
    offs_m,
    offs_n,
    NT,
    nb,
    b_lo,
    c_hi,
    c_lo,
    qk_scale,
    MAXREL: gl.constexpr,
    BN: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    GATHER: gl.constexpr,
    GATHER_AHEAD: gl.constexpr,
    mma: gl.constexpr,
    mma_o: gl.constexpr,
    blk: gl.constexpr,
):
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    rows_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    # a.
    async_copy.wait_group(STAGES - 3)
    gl.thread_barrier()
    fence_async_shared()
    # b.
    zeros_s = gl.zeros([s.shape[0], BN], gl.float32, mma)
    s_next = warpgroup_mma(
        q_smem, k_smem.index((v + 1) % STAGES).permute((1, 0)), zeros_s, use_acc=False, is_async=True
    )
    tile_next = _tile_at(v + 1, nb, b_lo)
    band_next = (v + 1) < nb
    if GATHER and GATHER_AHEAD:
        rel = _band_entries(zrows, i0, offs_m, offs_n, tile_next, band_next, MAXREL)
    # c.
    m_new, l_i, alpha, p16 = _softmax_step(s, c, m_i, l_i, qk_scale, p_op)
    # d.
    o = warpgroup_mma_wait(1, deps=[acc])
    # e.
    acc = warpgroup_mma(p16, v_smem.index(v % STAGES), o * gl.convert_layout(alpha, rows_o)[:, None], is_async=True)
    # f.
    gl.thread_barrier()
    nxt = v + STAGES - 1
    _kv_copy(k_smem.index(nxt % STAGES), v_smem.index(nxt % STAGES), K, V, row0, nxt, NT, nb, b_lo, BN, D, blk)
    # g.
    s = warpgroup_mma_wait(1, deps=[s_next])
    if GATHER:
        if not GATHER_AHEAD:
            rel = _band_entries(zrows, i0, offs_m, offs_n, tile_next, band_next, MAXREL)
        s = s + rel.to(gl.float32)
    c = gl.where(band_next, 0.0, gl.where(tile_next < b_lo, c_hi, c_lo))
    return s, c, m_new, l_i, acc


@gluon.jit
def overlap_forward(
    Q,
    K,
    V,
    A,
    Z,
    Out,
    N,
    H,
    qk_scale,
    MAXREL: gl.constexpr,
    ZSTRIDE: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    GATHER_AHEAD: gl.constexpr,
    RELATIVE: gl.constexpr,
):
    """Q, K, V, Out: [B·H·N, D] rows; A: Shaw's table [H, 2·MAXREL + 1, D]; Z: Z̃^Q's rows [B·H·N, ZSTRIDE]
    (written here). RELATIVE = False: plain attention (A and Z unused)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.float16)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    rows_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    C: gl.constexpr = 2 * MAXREL + 1

    bh, i0, row0, NT, q_smem = _q_block(Q, N, BM, D, BN, blk)
    offs_m = gl.arange(0, BM, layout=rows_l)
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    zrows = Z + (row0 + i0 + offs_m).to(gl.int64) * ZSTRIDE

    if RELATIVE:
        # prologue: Z̃^Q[i, s] = q_i · a_s for the block's rows
        a_smem = gl.allocate_shared_memory(gl.float16, [BN, D], kv_sl)
        c_hi, c_lo = _write_zq_rows(q_smem, a_smem, A + (bh % H) * C * D, zrows, qk_scale, MAXREL, ZSTRIDE, mma, blk)
        b_lo = (gl.maximum(i0 - (MAXREL + BN - 1), -BN) + BN) // BN
        nb = gl.minimum(NT, (i0 + BM - 1 + MAXREL + BN) // BN) - b_lo
    else:  # every visit in order, no band, no shift
        c_hi = gl.zeros([BM], gl.float32, rows_l)
        c_lo = c_hi
        b_lo = 0
        nb = 0

    k_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], kv_sl)
    v_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], kv_sl)
    for t in gl.static_range(STAGES - 1):
        _kv_copy(k_smem.index(t), v_smem.index(t), K, V, row0, t, NT, nb, b_lo, BN, D, blk)
    async_copy.wait_group(STAGES - 2)  # visit 0
    gl.thread_barrier()
    fence_async_shared()
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BM, BN], gl.float32, mma), use_acc=False)
    s, c, m_i, l_i, acc = _first_visit(s, zrows, i0, offs_m, offs_n, nb, b_lo, c_hi, c_lo, MAXREL, RELATIVE, mma_o)
    args = (q_smem, k_smem, v_smem, K, V, zrows, row0, i0, offs_m, offs_n, NT, nb, b_lo, c_hi, c_lo, qk_scale)
    for v in range(0, nb):  # band visits: the next visit's entries are gathered (past the band: none)
        s, c, m_i, l_i, acc = _visit(
            v, s, c, m_i, l_i, acc, *args, MAXREL, BN, D, STAGES, True, GATHER_AHEAD, mma, mma_o, blk
        )
    for v in range(nb, NT):  # saturated visits (plain attention: every visit), per-query shifts only
        s, c, m_i, l_i, acc = _visit(
            v, s, c, m_i, l_i, acc, *args, MAXREL, BN, D, STAGES, False, False, mma, mma_o, blk
        )
    o = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)
    out = o / gl.convert_layout(l_i, rows_o)[:, None]
    offs_mo = gl.arange(0, BM, layout=rows_o)
    offs_od = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
    gl.store(Out + (row0 + i0 + offs_mo)[:, None] * D + offs_od[None, :], out.to(gl.float16))


#: (RELATIVE, BM, BN, STAGES, GATHER_AHEAD)
CONFIGS = (
    (False, 128, 64, 3, False),
    (False, 128, 64, 4, False),
    (False, 64, 64, 3, False),
    (False, 64, 128, 3, False),
    (True, 128, 64, 3, False),
    (True, 128, 64, 3, True),
    (True, 128, 64, 4, False),
    (True, 64, 64, 3, False),
    (True, 64, 64, 3, True),
)


def _name(relative, bm, bn, stages, ahead):
    return f"{'shaw' if relative else 'plain'}_{bm}x{bn}_s{stages}{'_ahead' if ahead else ''}"


def _emit(kernel, signature: dict, constexprs: dict, attrs: dict, options: dict, out: Path, name: str) -> None:
    """Compile a Gluon kernel for sm_90 on any machine: its TTGIR and PTX into `out`, one JSON line with its shared
    memory and ptxas's registers and spills."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(BENCHMARKS))
    from compile_check import ptxas_usage

    out.mkdir(parents=True, exist_ok=True)
    src = GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    (out / f"{name}.ttgir").write_text(compiled.asm["ttgir"])
    (out / f"{name}.ptx").write_text(compiled.asm["ptx"])
    usage = ptxas_usage(compiled.asm["ptx"], 90)
    print(json.dumps({"config": name, "shared": compiled.metadata.shared, "ptxas": usage}), flush=True)


def _compile(out: Path) -> None:
    from triton.backends.nvidia.compiler import CUDABackend

    pointers = ("Q", "K", "V", "A", "Z", "Out")
    signature = {**dict.fromkeys(pointers, "*fp16"), "N": "i32", "H": "i32", "qk_scale": "fp32"}
    constant = ("MAXREL", "ZSTRIDE", "BM", "BN", "D", "STAGES", "GATHER_AHEAD", "RELATIVE")
    signature |= dict.fromkeys(constant, "constexpr")
    attrs = {(i,): CUDABackend.parse_attr("D") for i in range(len(pointers) + 1)}  # at N = 8192: aligned, N % 16 = 0
    for relative, bm, bn, stages, ahead in CONFIGS:
        values = (MAX_REL, ZS, bm, bn, 64, stages, ahead, relative)
        constexprs = dict(zip(constant, values, strict=True))
        name = _name(relative, bm, bn, stages, ahead)
        _emit(overlap_forward, signature, constexprs, attrs, {"num_warps": 4}, out, name)


def _rounds(systems, rounds: int = 3) -> dict:
    """do_bench medians (ms) of each system, in alternating rounds; a failure is recorded, not raised."""
    from triton.testing import do_bench

    times = {name: [] for name, _ in systems}
    for _ in range(rounds):
        for name, fn in systems:
            try:
                times[name].append(round(do_bench(fn, warmup=50, rep=200, return_mode="median"), 4))
            except Exception as exc:  # a configuration that fails to compile or launch is a finding
                times[name].append(f"{type(exc).__name__}"[:80])
    return times


def _problem(n: int, heads: int = 12, tokens: int = 16384, d: int = 64):
    """The benchmark's problem at length n (fp16, d = 64) with Shaw's table and room for Z̃^Q's rows."""
    import torch

    b = tokens // n
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, d, device="cuda", generator=gen).half() for _ in range(3))
    table = (0.5 * torch.randn(heads, 2 * MAX_REL + 1, d, device="cuda", generator=gen)).half()
    z = torch.empty(b * heads * n, ZS, device="cuda", dtype=torch.float16)
    return q, k, v, table, z


def _compare(q, k, v, table, plain: list, shaw: list, reruns: int = 0) -> None:
    """Errors against the oracles, then alternating do_bench rounds, of plain attention's systems (plain SDPA, the
    Triton ceiling kernel first) and Shaw's (relgen, plain SDPA first). The oracles: plain SDPA; FP32 on one head
    for Shaw, S = (q·k + q·a_{clip(i−j)}) / sqrt(d). With `reruns`, also the largest difference of that many
    reruns from the first output (a race shows there)."""
    import functools

    import torch
    import torch.nn.functional as F

    import relgen

    sys.path.insert(0, str(BENCHMARKS))
    from plain_ceiling import plain_forward

    n, d = q.shape[2], q.shape[3]
    fn = relgen.compile_mechanism(relgen.load_spec(BENCHMARKS.parent / "specs" / "shaw.yaml"))
    sdpa = ("sdpa_plain", lambda: F.scaled_dot_product_attention(q, k, v))
    ceiling = ("triton_128x64_s4", functools.partial(plain_forward, q, k, v, 128, 64, 4, 4, True, False))
    plain = [sdpa, ceiling, *plain]
    shaw = [("relgen", lambda: fn(q, k, v, aq=table)), sdpa, *shaw]
    ref_plain = F.scaled_dot_product_attention(q, k, v).float()
    qf, kf, vf, af = q[0, 0].float(), k[0, 0].float(), v[0, 0].float(), table[0].float()
    idx = torch.arange(n, device="cuda")
    rows = (idx[:, None] - idx[None, :]).clamp(-MAX_REL, MAX_REL) + MAX_REL
    ref_shaw = torch.softmax(((qf @ kf.T) + torch.gather(qf @ af.T, 1, rows)) * d**-0.5, -1) @ vf
    del rows
    for systems, error in ((plain, lambda o: o.float() - ref_plain), (shaw, lambda o: o[0, 0].float() - ref_shaw)):
        for name, f in systems:
            if name == "sdpa_plain":
                continue
            record = {"system": name}
            try:
                o = f()
                record["max_err"] = error(o).abs().max().item()
                if reruns:
                    record["rerun_diff"] = max((f().float() - o.float()).abs().max().item() for _ in range(reruns))
            except Exception as exc:
                record["max_err"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(record), flush=True)
        print(json.dumps({"n": n, "ms": _rounds(systems)}), flush=True)


def _time(n: int = 8192) -> None:
    import functools

    import torch

    q, k, v, table, z = _problem(n)
    b, heads, _, d = q.shape

    def gluon(relative, bm, bn, stages, ahead):
        o = torch.empty_like(q)
        overlap_forward[(n // bm, b * heads)](
            q, k, v, table, z, o, n, heads, LOG2E / math.sqrt(d), MAX_REL, ZS, bm, bn, d, stages, ahead, relative,
            num_warps=4,
        )  # fmt: skip
        return o

    systems = [(cfg[0], _name(*cfg), functools.partial(gluon, *cfg)) for cfg in CONFIGS]
    plain = [(name, f) for relative, name, f in systems if not relative]
    _compare(q, k, v, table, plain, [(name, f) for relative, name, f in systems if relative])


if __name__ == "__main__":
    if sys.argv[1] == "--compile":
        _compile(Path(sys.argv[2]))
    else:
        _time(*(int(a) for a in sys.argv[2:]))
