"""Offsets past 2³¹ elements: the bounds a call is checked against (MAX_TOKEN_ROWS, MAX_GRID_Y, int32 sequence
starts), when the kernels take their strides in int64 (Geometry.int64_offsets, their INT64), and the INT64 kernels
in Triton's interpreter on views whose strides carry their offsets past 2³¹ (storage that is reserved, not touched:
only the pages of the elements a view holds are ever written). The Z̃ products themselves (a token times a row
stride, N·W > 2³¹) need N ≈ 46K: tests/test_gpu.py::test_identity_map_past_int32_rows runs them on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_cases import Inputs, assert_all_close, compare
from tiers import slow_values

import relgen
from relgen.runtime import arguments
from relgen.runtime.geometry import INT32_REACH, TILE_SLACK, tensor_reach

ROOT = Path(__file__).resolve().parent.parent


def module(name):
    return relgen.compile_mechanism(relgen.load_spec(ROOT / "specs" / f"{name}.yaml")).module


def txl_call(n, b=1, h=1, d=16):
    q = torch.randn(1, 1, 1, d).expand(b, h, n, d)  # no memory behind the sizes
    aq = torch.randn(1, 1, d).expand(h, 2 * n - 1, d).contiguous()
    return arguments.check_call(module("txl").PLAN, q, q, q, aq, None, None)


@pytest.mark.parametrize("n", [1 << 17, 1 << 18])
def test_txl_at_128k_and_256k_is_accepted_with_int64_offsets(n):
    geo = txl_call(n).geo
    assert (geo.c, geo.rows) == (2 * n - 1, 2 * n - 1)
    assert geo.nq * geo.row_stride(geo.wq) > 2**31  # Z̃^Q of one head: N × (N + G − 1)
    assert geo.int64_offsets


def test_short_calls_keep_int32_offsets():
    assert not txl_call(4096, b=2, h=4).geo.int64_offsets
    # an identity map's Z̃^Q rows pass INT32_REACH from about 46K tokens on (N·(N + G)), with the tiles' slack
    assert not txl_call(32768).geo.int64_offsets
    assert txl_call(49152).geo.int64_offsets


def test_qkv_reach_decides_int64_offsets():
    t5 = module("t5").PLAN
    bias = torch.randn(2, 32)
    small = torch.randn(1, 1, 1, 16).expand(4, 2, 256, 16)
    assert not arguments.check_call(t5, small, small, small, None, None, bias).geo.int64_offsets
    # the same shape read with a token stride that carries its last token past 2³¹ (a view into a wider tensor)
    base = torch.empty(0)
    wide = base.new_empty(0).set_(base.untyped_storage(), 0, (4, 2, 256, 16), (0, 0, 1 << 23, 1))
    assert tensor_reach(wide) == 255 * (1 << 23) + 15 + TILE_SLACK * (1 << 23) > INT32_REACH
    assert arguments.check_call(t5, wide, small, small, None, None, bias).geo.int64_offsets


def test_call_signature_tells_strides_apart():
    """A kept Geometry (prepare_call) is reused only for q, k, v of the same strides: their reach is part of it."""
    dense = torch.randn(1, 2, 8, 16)
    strided = torch.randn(1, 8, 2, 16).transpose(1, 2)
    signature = arguments._signature
    assert signature(dense, dense, dense, None, None, None, {}) != signature(
        strided, dense, dense, None, None, None, {}
    )


def test_batch_times_heads_past_the_grid_is_refused():
    q = torch.randn(1, 1, 1, 16).expand(2048, 64, 4, 16)
    with pytest.raises(ValueError, match=r"q: batch × heads = 2048 × 64 = 131072 exceeds 65535 .*MAX_GRID_Y"):
        arguments.check_call(module("t5").PLAN, q, q, q, None, None, torch.randn(64, 32))


def test_token_rows_past_int32_are_refused():
    q = torch.randn(1, 1, 1, 16).expand(1024, 32, 1 << 16, 16)
    with pytest.raises(ValueError, match=r"q: B·H·N = 1024·32·65536 = 2147483648 token rows exceeds .*MAX_TOKEN_ROWS"):
        arguments.check_call(module("t5").PLAN, q, q, q, None, None, torch.randn(32, 32))


def test_packed_tokens_past_int32_starts_are_refused():
    q = torch.randn(1, 1, 16).expand(1 << 31, 1, 16)
    cu = torch.tensor([0, 2**31 - 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens: int32 sequence starts hold at most 2\*\*31 - 1 tokens"):
        arguments.check_call(module("t5").PLAN, q, q, q, None, None, torch.randn(1, 32), cu_seqlens=cu)


# ------------------------------------------------------------------------------------------------------------
# the INT64 kernels in the interpreter, through strides that carry offsets past 2³¹
# ------------------------------------------------------------------------------------------------------------
def spread(x: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """x's values in a view with these strides, over a storage that spans them (reserved, not written beyond x's
    own elements), as a leaf that requires grad."""
    span = sum((n - 1) * s for n, s in zip(x.shape, strides, strict=True)) + 1
    view = torch.empty(span, dtype=x.dtype).as_strided(x.shape, strides)
    with torch.no_grad():
        view.copy_(x)
    return view.requires_grad_()


def spread_inputs(spec_name, shape, strides, dtype):
    _, h, n, d = shape
    spec = relgen.load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (spread(torch.randn(shape, generator=gen).to(dtype), strides) for _ in range(3))
    rows = spec.map.num_rows(n)
    tables = {"aq": (torch.randn(h, rows, d, generator=gen) * 0.5).to(dtype).requires_grad_()}
    return spec, Inputs(q, k, v, tables)


@pytest.mark.parametrize(
    ("shape", "strides"),
    [
        # batch 2 starts at 2·(2³⁰ + 64) elements: b·stride_b with b and stride_b int32
        ((3, 1, 24, 16), ((1 << 30) + 64, 24 * 16, 16, 1)),
        # token 16 of 24 starts at 2³¹: a token times the token stride, in the loops over key and query tiles
        ((1, 1, 24, 16), (24 << 27, 16, 1 << 27, 1)),
    ],
    ids=["batch_stride", "token_stride"],
)
@pytest.mark.parametrize("spec_name", slow_values(["txl", "shaw"], slow=["shaw"]))
def test_offsets_past_int32_in_the_interpreter(spec_name, shape, strides):
    spec, inputs = spread_inputs(spec_name, shape, strides, torch.float16)
    assert tensor_reach(inputs.q) > INT32_REACH
    assert_all_close(compare(spec, inputs), f"{spec_name} {shape} strides {strides}")
