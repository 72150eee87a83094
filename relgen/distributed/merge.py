"""Merging the partial attention of one query chunk over several key chunks through their log-sum-exp.

A pass over one key chunk b gives O_b = Σ_j exp(s_ij − lse_b) v_j and lse_b = log Σ_j exp(s_ij) (relgen's kernels
return it in base 2; with dropout O_b holds the kept terms and lse_b is still the softmax's). Over the union of
chunks, lse = log Σ_b exp(lse_b) and O = Σ_b exp(lse_b − lse) O_b: the softmax over every key, exactly. A query
with no key in a chunk has O_b = 0 and lse_b = −inf, which must weigh nothing; a query with no key in any chunk
keeps O = 0 and lse = −inf, as in an unsharded call.
"""

from __future__ import annotations

import torch

__all__ = ["merge"]


def merge(
    o: torch.Tensor, lse2: torch.Tensor, o_part: torch.Tensor, lse2_part: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, lse) of the union of two sets of keys, from each set's O [..., n, d] and base-2 lse [..., n]. Computed
    in fp32 whatever the O's dtypes; `o` and `lse2` are the running totals: fp32, or the first set's own (its O in
    its dtype: a ring starts from its first pair rather than from an empty total). Merging into the empty total
    (zeros and −inf) gives `o_part` and `lse2_part` unchanged, so starting from the first set changes no bit."""
    high = torch.maximum(lse2, lse2_part)
    # rows that no key has reached yet stay at 0 / −inf: a finite reference point keeps exp2 away from −inf − −inf
    high = torch.where(high == float("-inf"), 0.0, high)
    w = torch.exp2(lse2 - high)
    w_part = torch.exp2(lse2_part - high)
    total = w + w_part
    reached = total > 0
    lse2 = torch.where(reached, high + torch.log2(torch.where(reached, total, 1.0)), float("-inf"))
    inv = torch.where(reached, 1.0 / torch.where(reached, total, 1.0), 0.0)
    o = (o * (w * inv).unsqueeze(-1)).addcmul_(o_part.float(), (w_part * inv).unsqueeze(-1))
    return o, lse2
