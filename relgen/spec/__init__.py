"""Stage 1, the spec: what a user writes. A mechanism is a Pydantic model (`MechanismSpec`) loaded from YAML or a
dict by a bounded, strict loader (`load_spec`; sizes capped by `limits` before any work), with its relation map
(`maps`: identity, clipped, T5 buckets, log buckets, boundaries, or an expression in the small grammar of `expr`,
which is parsed, never evaluated as Python). Nothing here imports a later stage."""

from relgen.spec.model import MechanismSpec, SpecError, load_spec

__all__ = ["MechanismSpec", "SpecError", "load_spec"]
