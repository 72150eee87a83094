"""Attention dropout's random stream (relgen.runtime.dropout) in torch: the keep mask a call draws, regenerated from the
seed and the absolute positions by the same Philox 4x32-10 the kernels run (`tl.philox`), read as the same 16-bit
halves, on any device, without a kernel. Also which of the kernels' dropout modes a call takes. Pure torch:
importing it defines no kernel."""

from __future__ import annotations

import math

import torch

__all__ = [
    "DROPOUT_ALIGNED",
    "DROPOUT_OFF",
    "DROPOUT_PER_SCORE",
    "dropout_mode",
    "keep_mask",
    "philox4x32",
    "threshold",
]

#: the kernels' DROPOUT constexpr: off, one Philox call per eight scores, one per score (k_offset not a multiple of 8)
DROPOUT_OFF, DROPOUT_ALIGNED, DROPOUT_PER_SCORE = 0, 1, 2
#: Philox 4x32's round multipliers and key increments (Salmon et al., Random123; Triton's tl.philox)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10  # tl.philox's default
_WORD = 0xFFFFFFFF
#: keys per Philox call: four 32-bit words, a 16-bit half per key
GROUP = 8


def dropout_mode(dropout_p: float, k_offset: int) -> int:
    """The kernels' DROPOUT constexpr for a call with this dropout_p and k_offset."""
    if not dropout_p:
        return DROPOUT_OFF
    return DROPOUT_ALIGNED if k_offset % GROUP == 0 else DROPOUT_PER_SCORE


# ------------------------------------------------------------------------------------------------------------
def _mul_words(a: torch.Tensor, constant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a·constant for 32-bit words a (int64 tensors): in 16-bit halves of the
    constant, so no product leaves int64's range."""
    low_part = a * (constant & 0xFFFF)  # < 2^48
    high_part = a * (constant >> 16)  # < 2^48
    high = (high_part + (low_part >> 16)) >> 16
    low = ((high_part & 0xFFFF) << 16) + low_part
    return high & _WORD, low & _WORD


def philox4x32(counter: tuple[torch.Tensor, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """Philox 4x32-10 of the counter words (c0, c1, c2, c3) (int64 tensors of 32-bit words, broadcast together)
    under the 64-bit key `seed`, as `tl.philox(seed, c0, c1, c2, c3)` computes it: four int64 tensors."""
    c0, c1, c2, c3 = torch.broadcast_tensors(*(c.to(torch.int64) & _WORD for c in counter))
    k0, k1 = seed & _WORD, (seed >> 32) & _WORD
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul_words(c2, _ROUND_B)
        hi_a, lo_a = _mul_words(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _WORD, (k1 + _KEY_B) & _WORD
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """The least 16-bit half that keeps a score: ⌈p·2¹⁶⌉ of p in fp32, as the kernels compute it (exact: p·2¹⁶ in
    fp32 only moves p's exponent)."""
    return math.ceil(float(torch.tensor(p, dtype=torch.float32)) * 65536.0)


def keep_mask(
    shape: tuple[int, int, int, int], p: float, seed: int, device, q_offset: int = 0, k_offset: int = 0
) -> torch.Tensor:
    """The bool keep mask [B, H, Nq, Nk] a call with `dropout_p=p, dropout_seed=seed` and these offsets uses
    (packed sequences: [S, H, max_seqlen, max_seqlen], offsets 0)."""
    b, h, nq, nk = shape
    first, last = k_offset // GROUP, (k_offset + nk + GROUP - 1) // GROUP  # the groups of keys k_offset … + nk − 1

    def axis(values: torch.Tensor, dim: int) -> torch.Tensor:
        return values.to(device).reshape([-1 if d == dim else 1 for d in range(4)])

    counter = (
        axis(torch.arange(q_offset, q_offset + nq), 2),
        axis(torch.arange(first, last), 3),
        axis(torch.arange(b), 0),
        axis(torch.arange(h), 1),
    )
    words = torch.stack(philox4x32(counter, seed), dim=-1)  # [B, H, Nq, groups, 4]
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).reshape(b, h, nq, GROUP * (last - first))
    start = k_offset - GROUP * first
    return halves[..., start : start + nk] >= threshold(p)
