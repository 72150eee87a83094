"""The package layout is the pipeline: spec → plan → codegen → tiles → runtime → check → API → CLI → integrations →
distributed (→ bench, an optional extra). No module imports a later stage (not even inside a function), the FP64
reference sees only the spec, and each stage imports on its own without loading a later one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "relgen"

#: stage of each top-level part of the package, in pipeline order
STAGES = {
    "relgen.backend": 0,
    "relgen.spec": 1,
    "relgen.plan": 2,
    "relgen.codegen": 3,
    "relgen.tiles": 4,
    "relgen.runtime": 5,
    "relgen.testing": 6,
    "relgen.check": 6,
    "relgen": 7,  # the public API (relgen/__init__.py), and the settings gathered in relgen.config
    "relgen.config": 7,
    "relgen.__main__": 8,
    "relgen.cli": 8,
    "relgen.integrations": 9,
    "relgen.distributed": 10,
    "relgen.bench": 11,
}
#: the oracle must stay independent of everything that computes the attention it judges
REFERENCE_MAY_IMPORT = {"relgen.spec", "relgen.backend"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """The entry of STAGES a module belongs to (its longest prefix)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in STAGES or ".".join(parts[:n]) == "relgen.reference":
            return ".".join(parts[:n])
    raise AssertionError(f"{module} belongs to no stage: add it to STAGES")


def _imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, names) for every import of a relgen module in `path`, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "relgen"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "relgen":
            found.append((node.lineno, node.module, tuple(a.name for a in node.names)))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_belongs_to_a_stage():
    for path in MODULES:
        _part(_module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_later_stage(path):
    importer = _part(_module_name(path))
    for line, module, names in _imports(path):
        # `from relgen import __version__` reads a constant; `from relgen import x` of a subpackage imports it
        targets = [f"relgen.{n}" for n in names if n != "__version__"] if module == "relgen" else [module]
        for target in targets:
            part = _part(target)
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if importer == "relgen.reference":
                assert part in REFERENCE_MAY_IMPORT, f"{where}: the FP64 reference may read only the spec"
            elif part == "relgen.reference":
                continue  # the oracle is independent of the pipeline, so any stage may consult it
            else:
                assert STAGES[part] <= STAGES[importer], f"{where}, a later stage than {importer}"


@pytest.mark.parametrize("stage", ["relgen.backend", "relgen.spec", "relgen.plan", "relgen.codegen", "relgen.tiles"])
def test_a_stage_imports_alone_without_later_stages(stage):
    later = [p for p, s in STAGES.items() if s > STAGES[stage] and p != "relgen"]
    code = (
        f"import sys, {stage}\n"
        f"loaded = sorted(m for m in sys.modules for p in {later!r} if m == p or m.startswith(p + '.'))\n"
        "print(loaded)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing {stage} loaded later stages: {done.stdout.strip()}"


@pytest.mark.parametrize("stage", ["relgen.runtime", "relgen.check", "relgen.cli", "relgen.integrations"])
def test_later_stages_import_alone(stage):
    done = subprocess.run(
        [sys.executable, "-c", f"import {stage}"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_the_core_does_not_import_the_benchmark_harness():
    for path in MODULES:
        if _part(_module_name(path)) == "relgen.bench":
            continue
        for line, module, names in _imports(path):
            targets = [f"relgen.{n}" for n in names] if module == "relgen" else [module]
            assert not any(t.startswith("relgen.bench") for t in targets), f"{path.relative_to(ROOT)}:{line}"


def test_generated_modules_import_only_the_runtime_surface():
    from relgen.runtime import surface

    for path in sorted((ROOT / "generated").glob("*.py")):
        imports = _imports(path)
        modules = {module for _, module, _ in imports}
        assert modules <= {"relgen.runtime", "relgen.runtime.dropout", "relgen.runtime.scales"}, (
            f"{path.name}: {sorted(modules)}"
        )
        used = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_rt":
                used.add(node.attr)
        assert used <= set(surface.__all__), f"{path.name} reads {sorted(used - set(surface.__all__))}"
