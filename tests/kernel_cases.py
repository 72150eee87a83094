"""Shared helpers of the kernel tests: random inputs for a spec and a run against the FP64 reference (re-exported
from relgen.check.verify, the one implementation that `relgen check` uses too), and random specs of every map kind."""

from __future__ import annotations

from pathlib import Path

from hypothesis import strategies as st

import relgen
from relgen.check.verify import Inputs, assert_all_close, compare, make_inputs

__all__ = [
    "LOG_QUERY_KEY",
    "MAP_KINDS",
    "QUERY_KEY",
    "SPECS",
    "Inputs",
    "assert_all_close",
    "compare",
    "load",
    "make_inputs",
    "random_specs",
    "spec_id",
]

SPEC_DIR = Path(__file__).resolve().parent.parent / "specs"
SPECS = ("shaw", "txl", "deberta_v3", "t5", "wav2vec2_bert", "t5_decoder", "txl_uv")
MAP_KINDS = ("identity", "clipped", "t5", "log", "boundaries", "expression")
#: query and key terms (Z̃^Q and Z̃^K) on a small clipped map: both passes' relation gradients, quick in the interpreter
QUERY_KEY = {"name": "qk_clipped", "terms": ["query", "key"], "map": {"kind": "clipped", "min": -8, "max": 6}}
#: DeBERTa's mechanism (log buckets, query and key terms, τ = 1/sqrt(3d)) with 8 buckets instead of 256: at the
#: tests' lengths its offsets reach the log buckets, their copies and saturation, where deberta_v3.yaml's 512 rows
#: are a clipped map wider than the sequence (and several times slower in the interpreter)
LOG_QUERY_KEY = {
    "name": "log_qk",
    "terms": ["query", "key"],
    "map": {"kind": "log", "position_buckets": 8, "max_position": 32},
    "scale": "1/sqrt(3*d)",
}


def load(name: str | dict) -> relgen.MechanismSpec:
    """A shipped spec by its name (specs/<name>.yaml), or a spec given as a dict (QUERY_KEY, LOG_QUERY_KEY, ...)."""
    return relgen.load_spec(name if isinstance(name, dict) else SPEC_DIR / f"{name}.yaml")


def spec_id(name: str | dict) -> str:
    """A test id for `load`'s argument: the name, or the dict's "name"."""
    return name if isinstance(name, str) else name["name"]


@st.composite
def random_specs(draw, kinds: tuple[str, ...] = MAP_KINDS):
    """A random spec: map of one of `kinds` with random parameters, random terms, causality, layout, scale."""
    kind = draw(st.sampled_from(kinds))
    offset = draw(st.sampled_from(["query_minus_key", "key_minus_query"]))
    if kind == "identity":
        m = {"kind": "identity", "offset": offset}
    elif kind == "clipped":
        m = {"kind": "clipped", "min": draw(st.integers(-40, 0)), "max": draw(st.integers(0, 40)), "offset": offset}
    elif kind == "t5":
        m = {
            "kind": "t5",
            "num_buckets": draw(st.sampled_from([8, 16, 32])),
            "max_distance": draw(st.sampled_from([20, 40, 128])),
            "bidirectional": draw(st.booleans()),
        }
    elif kind == "log":
        buckets = draw(st.sampled_from([8, 16, 32]))
        m = {"kind": "log", "position_buckets": buckets, "max_position": draw(st.integers(buckets // 2 + 2, 64))}
    elif kind == "boundaries":
        cuts = sorted(draw(st.sets(st.integers(-50, 50), min_size=1, max_size=6)))
        m = {"kind": "boundaries", "boundaries": cuts, "offset": offset}
    else:
        cap = draw(st.integers(1, 20))
        expr, rows = draw(
            st.sampled_from(
                [
                    (f"Min(Abs(delta), {cap})", cap + 1),  # ±δ share rows: the atomic path
                    (f"Max(Min(delta, {cap}), -{cap}) + {cap}", 2 * cap + 1),
                    (f"floor(Max(Min(delta, {cap}), -{cap}) / 2) + {cap}", 2 * cap + 1),
                ]
            )
        )
        m = {"kind": "expression", "expr": expr, "rows": rows, "offset": offset}
    terms = draw(st.sets(st.sampled_from(["query", "key", "bias"]), min_size=1))
    return relgen.load_spec(
        {
            "name": "random",
            "terms": sorted(terms),
            "map": m,
            "causal": draw(st.booleans()),
            "heads_share_tables": draw(st.booleans()),
            "scale": draw(st.sampled_from([None, 0.3, "1/sqrt(2*d)"])),
        }
    )
