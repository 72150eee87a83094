"""Attention dropout's random stream, shared by the generated kernels and `relgen.testing.dropout_keep_mask`.

Whether score (b, h, i, j) is kept depends on the seed, b, h and the absolute positions I = i + q_offset and
J = j + k_offset only: Philox 4x32-10 (Triton's `tl.philox`) with the seed as its key and the counter
(I, ⌊J / 8⌋, b, h) draws four 32-bit words for the eight consecutive key positions 8⌊J / 8⌋ … 8⌊J / 8⌋ + 7; J
reads the 16-bit half J mod 2 (0: the low half) of word ⌊(J mod 8) / 2⌋, and is kept when that half is at least
⌈p·2¹⁶⌉ (p in fp32). So a call draws the same mask whatever its lengths, tiles, tile order, layout or backward path,
and a part of a sequence (a chunk of a context-parallel call, a query block at an offset) draws exactly its part
of the whole call's mask. Every coordinate has a 32-bit word of its own (positions stay below
relgen.runtime.arguments.MAX_POSITION), so no two scores share a number. h is the query head (grouped-query
attention included); a packed sequence's b is its index in the batch and its positions start at 0.

Sixteen bits a score keep the rate to within 2⁻¹⁶ of p (the kept share is 1 − ⌈p·2¹⁶⌉/2¹⁶; outputs are scaled by
1/(1 − p) as torch's dropout does) at half the Philox rounds that a 32-bit number per score costs; the rounds are
what dropout costs in these kernels (ten rounds of two 32-bit multiplies for every call).

One Philox call serves eight scores when k_offset is a multiple of eight: a tile's keys then start on a group
(DROPOUT_ALIGNED). With any other k_offset a tile's groups straddle its keys, and no tiling of consecutive keys into
fixed groups could serve every offset, so those calls draw one Philox call per score and keep their half of it
(DROPOUT_PER_SCORE): the same mask, at eight times the Philox work.

The backward pass and `keep_mask` (relgen.runtime.dropout_stream: torch code, not a kernel) regenerate exactly the mask
the forward pass drew, and nothing is stored. The seed reaches the kernels as an int, or as a one-element tensor
they read (`seed_value`): the same seed draws the same mask either way.
"""

from __future__ import annotations

import triton
import triton.language as tl

from relgen.runtime.dropout_stream import (
    DROPOUT_ALIGNED,
    DROPOUT_OFF,
    DROPOUT_PER_SCORE,
    dropout_mode,
    keep_mask,
)

__all__ = [
    "DROPOUT_ALIGNED",
    "DROPOUT_OFF",
    "DROPOUT_PER_SCORE",
    "dropout_keep",
    "dropout_mode",
    "keep_mask",
    "seed_value",
]


@triton.jit
def seed_value(seed):
    """The seed the kernels draw with: an int argument, or read from a one-element integer tensor (a seed that
    changes between the replays of a CUDA graph, where an int would be captured once)."""
    if seed.dtype.is_ptr():
        return tl.load(seed).to(tl.int64)
    else:
        return seed


@triton.jit
def dropout_keep(
    seed,
    bh,
    H,
    offs_m,
    j_first,
    pos_q,
    pos_k,
    dropout_p,
    BLOCK_N: tl.constexpr,
    DESCENDING: tl.constexpr,
    KEY_MAJOR: tl.constexpr,
    MODE: tl.constexpr,
):
    """Where the scores of batch·head `bh` (H heads) are kept, for the queries offs_m and the tile's keys
    j_first + u, or j_first − u when DESCENDING (u = 0 … BLOCK_N − 1; a tile's keys start on a multiple of eight):
    [BM, BN], or [BN, BM] when KEY_MAJOR. pos_q, pos_k: the absolute positions of the call's query 0 and key 0
    (q_offset and k_offset); MODE: DROPOUT_ALIGNED (pos_k a multiple of eight) or DROPOUT_PER_SCORE."""
    rows = offs_m + pos_q  # I
    # b and h stay scalars: Philox's first round multiplies them once per program, not once per score
    b = bh // H
    h = bh % H
    threshold = tl.ceil(dropout_p * 65536.0).to(tl.uint32)
    if MODE == 1:  # DROPOUT_ALIGNED
        t = tl.arange(0, BLOCK_N // 8)
        if DESCENDING:  # noqa: SIM108 (constexpr branches: Triton compiles the taken one only)
            groups = (j_first + pos_k - 7) // 8 - t
        else:
            groups = (j_first + pos_k) // 8 + t
        i_full = tl.broadcast_to(rows[:, None], [offs_m.shape[0], BLOCK_N // 8])
        g_full = tl.broadcast_to(groups[None, :], [offs_m.shape[0], BLOCK_N // 8])
        r0, r1, r2, r3 = tl.philox(seed, i_full, g_full, b, h)
        # key 8g + 2w + s reads half s of word w; a tile lists a group's keys up (u = 8t + 2w + s) or down
        # (u = 8t + 7 − 2w − s), and join(join(a, c), join(b, d)) lays a, b, c, d out in that order
        if DESCENDING:
            words = tl.reshape(tl.join(tl.join(r3, r1), tl.join(r2, r0)), [offs_m.shape[0], BLOCK_N // 8, 4])
            halves = tl.join(words >> 16, words & 0xFFFF)
        else:
            words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [offs_m.shape[0], BLOCK_N // 8, 4])
            halves = tl.join(words & 0xFFFF, words >> 16)
        halves = tl.reshape(halves, [offs_m.shape[0], BLOCK_N])
    else:  # DROPOUT_PER_SCORE: key J takes half J mod 2 of word (J mod 8) / 2 of its group's call
        u = tl.arange(0, BLOCK_N)
        if DESCENDING:  # noqa: SIM108
            keys = j_first + pos_k - u
        else:
            keys = j_first + pos_k + u
        i_full = tl.broadcast_to(rows[:, None], [offs_m.shape[0], BLOCK_N])
        g_full = tl.broadcast_to(keys[None, :] // 8, [offs_m.shape[0], BLOCK_N])
        r0, r1, r2, r3 = tl.philox(seed, i_full, g_full, b, h)
        w = (keys[None, :] % 8) // 2
        words = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))
        halves = tl.where(keys[None, :] % 2 == 0, words & 0xFFFF, words >> 16)
    if KEY_MAJOR:
        halves = tl.trans(halves)
    return halves >= threshold
