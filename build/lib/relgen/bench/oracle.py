"""The benchmark's FP32 reference: the relation equations evaluated pair by pair, a block of queries at a time.

For every pair (i, j) of a query block it gathers the relation vectors a^Q_φ(i−j), a^K_φ(i−j) and the scalar
b_φ(i−j) themselves (no projections, no shifts: nothing the systems under test do), so it is independent of every
system's code. Blocks keep the gathered [H, Bq, N, d] tensors within a memory budget, so it runs at 8K tokens.
Gradients come from autograd through each block on the loss <dO, O>, summed over blocks.
"""

from __future__ import annotations

import torch

from relgen.bench.peers import Problem

Tensor = torch.Tensor


def block_size(problem: Problem, budget_bytes: int, with_grad: bool) -> int:
    """Queries per block so that the block's largest tensors stay within `budget_bytes`."""
    n, b, h, d = problem.seq_len, problem.batch, problem.heads, problem.head_dim
    spec = problem.spec
    tables = int(spec.has_query) + int(spec.has_key)
    per_query = 4 * n * (h * d * tables * (3 if with_grad else 1) + b * h * (8 if with_grad else 4))
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
                if relative and aq is not None:  # q_i · a^Q_φ(i−j), the relation vector gathered per pair
                    a = aq[..., phi, :]  # [H, Bq, N, d], or [Bq, N, d] for tables shared by the heads
                    scores = scores + torch.einsum("bhid,hijd->bhij" if a.dim() == 4 else "bhid,ijd->bhij", qb, a)
                if relative and ak is not None:  # k_j · a^K_φ(i−j)
                    a = ak[..., phi, :]
                    scores = scores + torch.einsum("bhjd,hijd->bhij" if a.dim() == 4 else "bhjd,ijd->bhij", k, a)
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
