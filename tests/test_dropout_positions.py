"""Dropout keyed by absolute positions: the stream against Philox 4x32-10's published answers and an independent
scalar rendering of its definition, the mask of a part of a sequence as that part of the whole mask, and the
kernels at offsets (on and off multiples of eight) against the FP64 reference with the regenerated mask."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import assert_all_close, compare, make_inputs

import relgen
from relgen.testing import dropout_keep_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = {"t5": "specs/t5.yaml", "deberta_v3": "specs/deberta_v3.yaml", "t5_decoder": "specs/t5_decoder.yaml"}
MASK = 0xFFFFFFFF


def _philox_scalar(counter: tuple[int, int, int, int], key: int) -> tuple[int, ...]:
    """Philox 4x32-10 on Python ints, as Salmon et al. define it (Random123's philox4x32round and bumpkey)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key & MASK, key >> 32 & MASK
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
        k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
    return c0, c1, c2, c3


def _kept(seed: int, b: int, h: int, i: int, j: int, p: float) -> bool:
    """Whether score (b, h, I = i, J = j) is kept: half J mod 2 (0: low) of word (J mod 8) // 2 of
    Philox((I, ⌊J/8⌋, b, h)), at least ⌈p·2¹⁶⌉ for p in fp32."""
    word = _philox_scalar((i, j // 8, b, h), seed)[(j % 8) // 2]
    half = (word >> 16 * (j % 2)) & 0xFFFF
    p32 = float(torch.tensor(p, dtype=torch.float32))
    return half >= math.ceil(p32 * 2**16)


# Random123's known-answer vectors for philox4x32 with 10 rounds: counter, key (k1·2³² + k0), the four words
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK, MASK, MASK, MASK), (MASK << 32) | MASK, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0x299F31D0 << 32) | 0xA4093822,
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "words"), KNOWN_ANSWERS)
def test_the_stream_is_philox_4x32_10(counter, key, words):
    from relgen.runtime.dropout_stream import philox4x32

    assert _philox_scalar(counter, key) == words
    got = philox4x32(tuple(torch.tensor([c]) for c in counter), key)
    assert tuple(int(w) for w in got) == words


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**63 - 1),
    q_offset=st.integers(0, (1 << 29) - 8),
    k_offset=st.integers(0, (1 << 29) - 8),
    p=st.sampled_from([0.1, 0.5, 0.9]),
)
def test_the_mask_is_a_function_of_absolute_positions(seed, q_offset, k_offset, p):
    """Entry (b, h, i, j) of the mask at offsets is the keep decision of (seed, b, h, i + q_offset, j + k_offset),
    computed score by score from the definition, up to the largest positions a call may reach."""
    keep = dropout_keep_mask((2, 3, 5, 7), p, seed, q_offset=q_offset, k_offset=k_offset)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 6), (0, 1, 2, 3), (1, 0, 3, 5), (1, 2, 0, 1)]:
        assert bool(keep[b, h, i, j]) == _kept(seed, b, h, i + q_offset, j + k_offset, p), (b, h, i, j)


@settings(max_examples=30, deadline=None)
@given(
    q0=st.integers(0, 40),
    k0=st.integers(0, 40),
    nq=st.integers(1, 24),
    nk=st.integers(1, 24),
    seed=st.integers(0, 2**40),
)
def test_a_part_of_a_sequence_draws_that_part_of_the_whole_mask(q0, k0, nq, nk, seed):
    """Whatever the lengths and offsets (on a multiple of eight or not): a chunk's mask is the whole call's."""
    whole = dropout_keep_mask((1, 2, 64, 64), 0.4, seed)
    part = dropout_keep_mask((1, 2, nq, nk), 0.4, seed, q_offset=q0, k_offset=k0)
    assert torch.equal(part, whole[:, :, q0 : q0 + nq, k0 : k0 + nk])


def test_the_batch_and_head_words_keep_streams_apart():
    """(b, h) = (0, 1) and (1, 0) draw different masks whatever H is (no b·H + h that could coincide)."""
    keep = dropout_keep_mask((2, 2, 16, 16), 0.5, 3)
    assert not torch.equal(keep[0, 1], keep[1, 0])
    assert torch.equal(dropout_keep_mask((2, 5, 16, 16), 0.5, 3)[:, :2], keep)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_kept_share_is_one_minus_p(p):
    """A quarter of a million scores keep 1 − p of them, to within four standard deviations."""
    keep = dropout_keep_mask((1, 2, 512, 256), p, 2024)
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs(keep.float().mean().item() - (1 - p)) < 4 * sigma


def test_bad_offsets_name_the_argument():
    with pytest.raises(ValueError, match="k_offset"):
        dropout_keep_mask((1, 1, 4, 4), 0.1, 1, k_offset=-1)
    with pytest.raises(ValueError, match="q_offset"):
        dropout_keep_mask((1, 1, 4, 4), 0.1, 1, q_offset=1.5)


@pytest.mark.parametrize(("name", "q_offset", "k_offset"), [("t5", 6, 8), ("t5", 6, 3), ("t5_decoder", 9, 1)])
def test_kernels_at_offsets_draw_the_regenerated_mask(name, q_offset, k_offset):
    """The forward and both backward passes at offsets (k_offset on a multiple of eight: one Philox call per eight
    scores; off it: one per score) against the FP64 reference with the mask dropout_keep_mask regenerates."""
    spec = relgen.load_spec(SPECS[name])
    b, h, nq, nk, p, seed = 1, 2, 24, 28, 0.3, 77
    length = max(q_offset + nq, k_offset + nk)
    inputs = make_inputs(spec, b=b, h=h, nq=nq, nk=nk, d=16, device=DEVICE, seed=5, length=length)
    keep = dropout_keep_mask((b, h, nq, nk), p, seed, device=DEVICE, q_offset=q_offset, k_offset=k_offset)
    options = {"q_offset": q_offset, "k_offset": k_offset, "dropout_p": p, "dropout_seed": seed}
    assert_all_close(compare(spec, inputs, keep_mask=keep, **options), f"{name} offsets {q_offset}, {k_offset}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("q_offset", "k_offset"), [(0, 0), (512, 256), (300, 131)])
@pytest.mark.parametrize("name", ["t5", "deberta_v3", "t5_decoder"])
def test_gpu_dropout_at_offsets(name, q_offset, k_offset, dtype):
    """The compiled kernels (descriptor tiles, GPU tiles, both dropout modes) at offsets, with the regenerated
    mask; and the same query block split in two at its offsets draws the same output bit for bit."""
    spec = relgen.load_spec(SPECS[name])
    b, h, nq, nk, p, seed = 2, 2, 1024, 1024, 0.1, 123
    length = max(q_offset + nq, k_offset + nk)
    inputs = make_inputs(spec, b=b, h=h, nq=nq, nk=nk, d=64, dtype=dtype, device="cuda", seed=2, length=length)
    keep = dropout_keep_mask((b, h, nq, nk), p, seed, device="cuda", q_offset=q_offset, k_offset=k_offset)
    options = {"q_offset": q_offset, "k_offset": k_offset, "dropout_p": p, "dropout_seed": seed}
    assert_all_close(compare(spec, inputs, keep_mask=keep, **options), f"{name} offsets {q_offset}, {k_offset}")
    fn = relgen.compile_mechanism(spec)
    whole = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    half = nq // 2
    second = fn(inputs.q[:, :, half:], inputs.k, inputs.v, **inputs.tables, **{**options, "q_offset": q_offset + half})
    assert torch.equal(second, whole[:, :, half:])
