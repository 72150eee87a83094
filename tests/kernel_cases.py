"""Shared helpers of the kernel tests, re-exported from relgen.verify (the one implementation that
`relgen check` uses too): random inputs for a spec, and a run against the FP64 reference."""

from __future__ import annotations

from relgen.verify import Inputs, assert_all_close, compare, make_inputs

__all__ = ["SPECS", "Inputs", "assert_all_close", "compare", "make_inputs"]

SPECS = ("shaw", "txl", "deberta_v3", "t5", "wav2vec2_bert", "t5_decoder")
