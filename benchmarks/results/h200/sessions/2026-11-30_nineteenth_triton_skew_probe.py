"""Nineteenth session, CPU only: does Triton 3.6 keep a key tile's QK product in flight across the previous tile's
softmax when the loop is skewed by hand (S_{j+1} = Q·K_{j+1}ᵀ issued before the softmax of S_j)? Compiles such a
plain-attention loop for sm_90 and writes its TTGIR: the product is issued asynchronously and waited for at once
(`warp_group_dot_wait … {pendings = 0}` right after it, as in the straight loop of benchmarks/plain_ceiling.py), so
it does not overlap the softmax.

    python 2026-11-30_nineteenth_triton_skew_probe.py OUT_DIR
"""

import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource


@triton.jit
def _softmax_step(qk, v, m_i, l_i, acc, qk_scale):
    """One key tile of the online softmax, from its scores qk: (m, ℓ, O) updated."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def plain_skewed(Q, K, V, Out, N, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    base = bh.to(tl.int64) * N * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + offs_d[None, :]  # a key tile's offsets from its first row
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    NT = N // BLOCK_N
    qk = tl.dot(q, tl.trans(tl.load(K + base + rows)))
    for tile in range(0, NT - 1):
        qk_next = tl.dot(q, tl.trans(tl.load(K + base + (tile + 1) * BLOCK_N * HEAD_DIM + rows)))
        v = tl.load(V + base + tile * BLOCK_N * HEAD_DIM + rows)
        m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, qk_scale)
        qk = qk_next
    v = tl.load(V + base + (NT - 1) * BLOCK_N * HEAD_DIM + rows)
    m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, qk_scale)
    tl.store(Out + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty))


def compile_one(bm: int, bn: int, warps: int, stages: int, out: str) -> None:
    """Compile one tile shape for sm_90 as a launch at N = 8192 would be specialised; OUT.ttgir and OUT.ptx."""
    sig = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "Out": "*fp16", "N": "i32", "qk_scale": "fp32"}
    sig |= {"HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    attrs = {(i,): CUDABackend.parse_attr("D") for i in range(5)}
    src = ASTSource(plain_skewed, sig, constexprs={"HEAD_DIM": 64, "BLOCK_M": bm, "BLOCK_N": bn}, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    Path(out + ".ttgir").write_text(c.asm["ttgir"])
    Path(out + ".ptx").write_text(c.asm["ptx"])
    waits = [line.split("{")[1].split("}")[0] for line in c.asm["ttgir"].splitlines() if "warp_group_dot_wait" in line]
    print(out, "shared", c.metadata.shared, "waits:", waits)


if __name__ == "__main__":
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    for bm, bn, w, s in ((128, 64, 4, 3), (64, 64, 4, 3)):
        compile_one(bm, bn, w, s, f"{sys.argv[1]}/skewed_{bm}x{bn}")
