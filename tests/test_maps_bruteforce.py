"""The maps' row ids against the values read from the models (docs/mechanisms.md) and brute-force invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relgen.spec.maps import BoundariesMap, ClippedMap, IdentityMap, LogMap, T5Map


def rows(m, deltas, length=1):
    return [int(r) for r in m.row_ids(np.asarray(deltas, dtype=np.int64), length)]


def test_deberta_v3_buckets():
    m = LogMap(kind="log", position_buckets=256, max_position=512)
    # make_log_bucket_position samples (docs/mechanisms.md, DeBERTa), φ = clamp(bucket + 256, 0, 511)
    samples = {129: 129, 130: 130, 135: 133, 150: 143, 200: 169, 256: 192, 300: 207, 400: 233, 500: 254}
    samples |= {d: 255 for d in range(506, 512)} | {512: 256, 1000: 317, 5000: 465}
    for delta, bucket in samples.items():
        assert rows(m, [delta, -delta]) == [min(bucket + 256, 511), max(256 - bucket, 0)]
    assert rows(m, range(-128, 129)) == [d + 256 for d in range(-128, 129)]  # |δ| ≤ 128: exact
    assert rows(m, [505, 506, -505, -506, -511, -512, -(10**6)]) == [510, 511, 2, 1, 1, 0, 0]


def test_t5_encoder_buckets():
    m = T5Map(kind="t5", num_buckets=32, max_distance=128, bidirectional=True)
    first = {8: 8, 9: 12, 10: 16, 11: 23, 12: 32, 13: 46, 14: 64, 15: 91}  # bucket: first distance
    for bucket, n in first.items():
        # δ = i − j > 0: key in the past (rp = j − i < 0) → buckets 0..15; key in the future → +16
        assert rows(m, [n, n - 1]) == [bucket, bucket - 1]
        assert rows(m, [-n, -(n - 1)]) == [bucket + 16, bucket + 15]
    assert rows(m, range(8)) == list(range(8))
    assert rows(m, [-d for d in range(1, 8)]) == [16 + d for d in range(1, 8)]
    assert rows(m, [10**6, -(10**6)]) == [15, 31]


def test_t5_decoder_buckets():
    m = T5Map(kind="t5", num_buckets=32, max_distance=128, bidirectional=False)
    first = {16: 16, 17: 19, 18: 21, 19: 24, 20: 27, 21: 31, 22: 35, 23: 40, 24: 46, 25: 52, 26: 59, 27: 67, 28: 77,
             29: 87, 30: 99, 31: 113}  # fmt: skip
    for bucket, n in first.items():
        assert rows(m, [n, n - 1]) == [bucket, bucket - 1]
    assert rows(m, range(16)) == list(range(16))
    assert rows(m, [-1, -5, -1000]) == [0, 0, 0]  # future keys (masked anyway)


def test_wav2vec2_bert_and_identity():
    m = ClippedMap(kind="clipped", min=-64, max=8, offset="key_minus_query")
    # HF: idx = clamp(j − i, −64, 8) + 64
    deltas = np.arange(-100, 101)
    assert rows(m, deltas) == [min(max(-d, -64), 8) + 64 for d in deltas.tolist()]
    assert m.num_rows(1) == 73
    ident = IdentityMap(kind="identity")
    assert rows(ident, deltas, 101) == [d + 100 for d in deltas.tolist()] and ident.num_rows(101) == 201


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["t5", "log", "boundaries", "clipped"]),
    a=st.integers(2, 64),
    b=st.integers(2, 400),
    flag=st.booleans(),
    values=st.lists(st.integers(-50, 50), min_size=1, max_size=6, unique=True),
)
def test_bucketed_maps_are_in_range_ordered_and_contiguous(kind, a, b, flag, values):
    """Rows lie in [0, R) and each row is one interval of offsets (paper §3.2: consecutive, ordered buckets)."""
    if kind == "t5":
        exact = (a // 2 if flag else a) // 2
        if exact < 1 or b <= exact:
            return
        m = T5Map(kind="t5", num_buckets=a, max_distance=b, bidirectional=flag)
    elif kind == "log":
        if b - 1 <= a // 2:
            return
        m = LogMap(kind="log", position_buckets=a, max_position=b)
    elif kind == "boundaries":
        m = BoundariesMap(
            kind="boundaries", boundaries=sorted(values), offset="key_minus_query" if flag else "query_minus_key"
        )
    else:
        m = ClippedMap(kind="clipped", min=-a, max=b % 50)
    deltas = np.arange(-2000, 2001)
    r = np.asarray(m.row_ids(deltas, 2001))
    assert r.min() >= 0 and r.max() < m.num_rows(2001)
    change = np.flatnonzero(np.diff(r)) + 1
    run_rows = r[np.concatenate([[0], change])]
    assert len(set(run_rows.tolist())) == len(run_rows)  # no row is visited twice: contiguous


@pytest.mark.parametrize("radius", [10**4])
def test_far_offsets_do_not_overflow(radius):
    for m in (T5Map(kind="t5"), LogMap(kind="log", position_buckets=256, max_position=512)):
        r = np.asarray(m.row_ids(np.array([-(2**30), -radius, radius, 2**30]), 1))
        assert r[0] == r[1] and r[2] == r[3]
