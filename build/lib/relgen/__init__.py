"""relgen — a compiler for relative-position attention.

    spec (YAML / Pydantic) → analyze (Plan) → codegen (Jinja over templates/) → generated module → runtime

Public API: `load_spec`, `analyze`, `compile_mechanism`, `reference`, `testing`.
"""

from relgen.analyze import Plan, analyze
from relgen.spec import MechanismSpec, SpecError, load_spec

__all__ = ["MechanismSpec", "Plan", "SpecError", "analyze", "compile_mechanism", "load_spec"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # the runtime pulls in triton; keep `import relgen` light for the CLI and the analyzer
    if name == "compile_mechanism":
        from relgen.runtime import compile_mechanism

        return compile_mechanism
    if name in ("reference", "testing", "codegen", "runtime"):
        import importlib

        return importlib.import_module(f"relgen.{name}")
    raise AttributeError(f"module 'relgen' has no attribute {name!r}")
