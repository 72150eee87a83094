"""The benchmark's FP32 reference: the relation equations evaluated a block of queries at a time.

Each relation term is the table row φ(i−j) dotted with its token: the block computes x·Aᵀ for its tokens against
all R rows (full-precision matmuls, no reachable ranges, no saturation, no tiling: nothing the systems under test
rely on) and gathers entry (i, φ(i−j)) for every pair; b is gathered the same way. Autograd then gives the
gradients on the loss <dO, O>, summed over blocks: the gathers' backward adds each pair's score gradient into
its row, so the table gradients stay cheap at 8K tokens (gathering a d-vector per pair, the textbook form, costs
N²·d memory traffic per table and contended atomics in its backward). tests/test_bench.py checks it against
relgen.reference, the FP64 pair-by-pair oracle.
"""

from __future__ import annotations

import torch

from relgen.bench.peers import Problem

Tensor = torch.Tensor


def block_size(problem: Problem, budget_bytes: int, with_grad: bool) -> int:
    """Queries per block so that the block's largest tensors stay within `budget_bytes`."""
    n, b, h = problem.seq_len, problem.batch, problem.heads
    spec = problem.spec
    grad = 3 if with_grad else 1
    per_query = 4 * b * h * (problem.rows * int(spec.has_query) * grad + n * (8 if with_grad else 4))
    return max(1, min(n, budget_bytes // per_query))


def reference(
    problem: Problem,
    *,
    relative: bool = True,
    with_grad: bool = True,
    dtype: torch.dtype = torch.float32,
    budget_bytes: int = 1 << 30,
) -> dict[str, Tensor]:
    """O and (with_grad) the gradients of <dO, O> w.r.t. q, k, v and the present tables, in `dtype`.

    `relative=False` drops the relative terms (the reference of the plain-SDPA ceiling).
    """
    p = problem
    n = p.seq_len
    cast = {name: t.detach().to(dtype) for name, t in p.inputs(relative)}
    q, k, v = cast["q"], cast["k"], cast["v"]
    aq, ak, bias = cast.get("aq"), cast.get("ak"), cast.get("bias")
    d_out = p.d_out.detach().to(dtype)
    leaves = [t for t in (k, v, aq, ak, bias) if t is not None]
    for t in leaves:
        t.requires_grad_(with_grad)
    grads = {name: torch.zeros_like(t) for name, t in cast.items()} if with_grad else {}
    out = torch.empty_like(q)
    rows = p.offset_rows
    bq = block_size(p, budget_bytes, with_grad)
    j = torch.arange(n, device=q.device)
    with _no_tf32():
        for i0 in range(0, n, bq):
            i1 = min(n, i0 + bq)
            with torch.set_grad_enabled(with_grad):
                qb = q[:, :, i0:i1].detach().requires_grad_(with_grad)
                i = torch.arange(i0, i1, device=q.device)
                phi = rows[i[:, None] - j[None, :] + (n - 1)]  # [Bq, N]
                scores = torch.matmul(qb, k.transpose(-1, -2))
                if relative and aq is not None:  # q_i · a^Q_φ(i−j): entry (i, φ) of q·(A^Q)ᵀ
                    zq = torch.matmul(qb, aq.transpose(-1, -2))  # [B, H, Bq, R]
                    scores = scores + torch.gather(zq, -1, phi.expand(*zq.shape[:-1], n))
                if relative and ak is not None:  # k_j · a^K_φ(i−j): entry (φ, j) of A^K·kᵀ
                    zk = torch.matmul(ak, k.transpose(-1, -2))  # [B, H, R, N]
                    scores = scores + torch.gather(zk, -2, phi.expand(*zk.shape[:-2], i1 - i0, n))
                if relative and bias is not None:  # b_φ(i−j)
                    scores = scores + bias[..., phi]
                probs = torch.softmax(scores * p.tau, dim=-1)
                ob = torch.matmul(probs, v)
                out[:, :, i0:i1] = ob.detach()
                if with_grad:
                    loss = (ob * d_out[:, :, i0:i1]).sum()
                    names = ["q"] + [nm for nm in ("k", "v", "aq", "ak", "bias") if nm in cast]
                    tensors = [qb] + [cast[nm] for nm in names[1:]]
                    block_grads = torch.autograd.grad(loss, tensors)
                    grads["q"][:, :, i0:i1] = block_grads[0]
                    for nm, g in zip(names[1:], block_grads[1:], strict=True):
                        grads[nm] += g
    return {"out": out, **grads}


class _no_tf32:
    """FP32 matmuls in full precision while the reference runs (restores the previous settings)."""

    def __enter__(self):
        self._matmul = torch.backends.cuda.matmul.allow_tf32
        self._cudnn = torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return self

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self._matmul
        torch.backends.cudnn.allow_tf32 = self._cudnn
        return False
