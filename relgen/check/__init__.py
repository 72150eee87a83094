"""Stage 6, checking: `relgen check` runs a spec's kernels against the FP64 reference (relgen.reference) on random
inputs at a few lengths and reports each output and gradient by the project's criterion (relgen.testing)."""
