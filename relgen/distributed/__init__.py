"""Context parallelism: relgen's attention over a sequence sharded across the ranks of a torch.distributed group
(NCCL on GPUs, gloo on CPUs), by ring attention.

    import relgen.distributed as rd
    cp_fn = rd.context_parallel(fn, group=None, sharding="contiguous")   # or "zigzag"
    q_local = rd.shard(q, group, "contiguous", dim=2)                    # likewise k, v; a padding mask: dim=1
    out_local = cp_fn(q_local, k_local, v_local, aq=aq, ak=ak, bias=bias, **options)

relgen's kernels take absolute positions (`q_offset`, `k_offset`) and return the log-sum-exp, so each pair of
chunks is an ordinary call of the mechanism's generated module, offset terms and all: no N×N bias exists on
any rank. The key chunks go round the ring by point-to-point transfers posted before the kernels run on the
current chunk; the partial outputs merge through their log-sum-exp in fp32; the backward runs the ring again
with the gathered log-sum-exp, and dK, dV travel with their chunk back to its owner. Dropout draws the unsharded
call's mask: the kernels key it by absolute positions (relgen.runtime.dropout). Packed sequences (cu_seqlens) are not
supported. Modules: `sharding` (who holds which chunk), `ring` (neighbours, transfers), `blocks` (one chunk pair
through the module's passes), `merge`, `schedule` (the two ring passes), `autograd`, `parallel` (the user-facing
callable).
"""

from relgen.distributed.parallel import ContextParallel, context_parallel
from relgen.distributed.sharding import SHARDINGS, shard, unshard

__all__ = ["SHARDINGS", "ContextParallel", "context_parallel", "shard", "unshard"]
