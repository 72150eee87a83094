"""No text of a spec or a plan becomes code: the generated module holds canonical values only.

Plans are built directly (dataclasses.replace), bypassing the spec's validation, with hostile text in each field
code generation reads: rendering either refuses with a ValueError or gives a module with the syntax tree of the
benign one. The `scale` exploit that once ran a shell command is replayed through every path that renders.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import SLOW

from relgen.cli.main import main
from relgen.codegen import generator as codegen
from relgen.plan.analyze import Plan, analyze
from relgen.spec.model import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "demo", "terms": ["bias"], "map": {"kind": "clipped", "min": -4, "max": 4}}

# text that would end a string literal, a comment or a docstring, or smuggle a statement in
HOSTILE = [
    '1 #" if __import__("os").system("true") else "1',
    'demo"\nimport os\n#',
    "demo'''\"\"\"; __import__('os')",
    "demo\\",
    "demo\\n__import__('os')",
    "demo\u2028__import__('os')",
    "demo\x85__import__('os')",
    "demo\x00",
    "demo\r\n__import__('os')",
    "demo\n",
    "#",
    '"',
    "",
    "{{ plan }}",
    "\U0001d41d\u0435mo",  # look-alike letters
    "a" * 65,
    "__import__('os').system('true')",
]
TEXT_FIELDS = ["spec_name", "spec_hash", "map_kind", "scale", "path", "relations", "projections"]
OTHER_FIELDS = {
    "terms": [("bias", "__import__('os')"), "bias", ("bias\n",), ("query", "query"), ()],
    "causal": ["False", 0, None],
    "heads_share_tables": ["True", 1],
    "length_dependent": ["False"],
    "saturation_proven": ["True"],
    "rows": ["9", 9.0, True, 0],
    "seq_len": ["16", -1],
    "saturation_low": ["-4", -4.0],
    "saturation_high": ["4\n", None],
    "copy_map": ["(0, 1)", [0, 1, 2, 3, 4, 5, 6, 7, 8], (0, 1), ("0",) * 9, (0,) * 8 + (9,)],
}


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    specs = {
        "demo": BASE,
        "shaw": ROOT / "specs/shaw.yaml",
        "txl": ROOT / "specs/txl.yaml",
        "pair": {**BASE, "name": "pair", "terms": ["query", "key", "bias"], "causal": True},
    }
    return {name: analyze(load_spec(spec)) for name, spec in specs.items()}


def _shape(source: str) -> tuple[Counter, set[str], Counter]:
    """What a module does, without its literal values: its node types, the names it uses, the calls it makes."""
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    names = {n.id for n in nodes if isinstance(n, ast.Name)} | {n.attr for n in nodes if isinstance(n, ast.Attribute)}
    calls = Counter(ast.unparse(n.func) for n in nodes if isinstance(n, ast.Call))
    return Counter(type(n).__name__ for n in nodes), names, calls


def _render_or_refuse(plan: Plan, **changes) -> str | None:
    try:
        return codegen.render(replace(plan, **changes))
    except ValueError:
        return None


def _assert_inert(benign: Plan, value: object, **changes) -> None:
    source = _render_or_refuse(benign, **changes)
    if source is None:
        return
    assert _shape(source) == _shape(codegen.render(benign)), changes
    # text that could end a literal or a comment is not in the module (shorter strings may occur by chance)
    if isinstance(value, str) and len(value) >= 4 and any(c in value for c in "#\"'\\\n\r\x00"):
        assert value not in source, changes


# -- hostile plans ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
@pytest.mark.parametrize("field", TEXT_FIELDS)
def test_hostile_text_fields_are_refused_or_inert(plans, field, value):
    for plan in (plans["demo"], plans["pair"]):
        _assert_inert(plan, value, **{field: value})


def test_every_hostile_text_is_refused_where_code_would_hold_it(plans):
    # the fields rendered as identifiers, hashes and choices admit none of these strings
    for field in ("spec_name", "spec_hash", "map_kind", "path", "relations", "projections"):
        for value in HOSTILE:
            with pytest.raises(ValueError, match=rf"plan\.{field}"):
                codegen.render(replace(plans["demo"], **{field: value}))


@pytest.mark.parametrize("field", sorted(OTHER_FIELDS))
def test_hostile_values_of_other_fields_are_refused(plans, field):
    for value in OTHER_FIELDS[field]:
        with pytest.raises(ValueError, match=rf"plan\.{field}"):
            codegen.render(replace(plans["demo"], **{field: value}))


def test_a_str_subclass_cannot_swap_its_text(plans):
    class Sneaky(str):
        def __str__(self) -> str:
            return "demo\n__import__('os')"

    with pytest.raises(ValueError, match=r"plan\.spec_name"):
        codegen.render(replace(plans["demo"], spec_name=Sneaky("demo")))


def test_a_hostile_version_is_refused(plans, monkeypatch):
    monkeypatch.setattr(codegen, "__version__", "0.1\nimport os")
    with pytest.raises(ValueError, match="version"):
        codegen.render(plans["demo"])


@SLOW
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from(TEXT_FIELDS),
    value=st.one_of(
        st.text(max_size=40),
        st.from_regex(r"[a-z][a-z0-9_]{0,70}", fullmatch=True),
        st.from_regex(r"[0-9a-f]{15,17}", fullmatch=True),
        st.builds(lambda a, b: f"{a} #{b}", st.sampled_from(["1", "d", "1/sqrt(d)"]), st.text(max_size=20)),
    ),
)
def test_any_text_is_refused_or_inert(plans, field, value):
    _assert_inert(plans["demo"], value, **{field: value})


def test_the_scale_is_emitted_in_normal_form(plans):
    source = codegen.render(replace(plans["demo"], scale=" (1)/sqrt( 3*d )\t"))
    assert '    scale="1 / sqrt(3 * d)",\n' in source
    # the runtime reads it back as the same τ
    module = ast.parse(source)
    literal = next(
        kw.value.value
        for node in ast.walk(module)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "_rt.PlanInfo"
        for kw in node.keywords
        if kw.arg == "scale"
    )
    assert literal == "1 / sqrt(3 * d)"


# -- specs: their free text never reaches the module -------------------------------------------------------------

DESCRIPTIONS = [
    'a "quoted" word',
    "two\nlines\n# and a comment",
    '"""; __import__("os"); """',
    "'''",
    "a # hash",
    "back\\slash\\",
    "line\u2028separator",
    "next\x85line",
    "nul\x00byte",
    "\x1b[31mred",
]


@pytest.mark.parametrize("description", DESCRIPTIONS, ids=range(len(DESCRIPTIONS)))
def test_spec_descriptions_do_not_reach_the_module(description):
    benign = analyze(load_spec(BASE))
    hostile = analyze(load_spec({**BASE, "description": description}))
    source = codegen.render(hostile)
    assert source == codegen.render(benign).replace(benign.spec_hash, hostile.spec_hash)
    assert description not in source


@pytest.mark.parametrize("name", [n for n in HOSTILE if n != "a" * 65], ids=range(len(HOSTILE) - 1))
def test_hostile_spec_names_are_refused(name):
    with pytest.raises((SpecError, ValueError)):
        codegen.render(analyze(load_spec({**BASE, "name": name})))


def test_an_overlong_spec_name_is_refused_before_any_file(tmp_path, capsys):
    spec = tmp_path / "long.yaml"
    spec.write_text(f"name: {'a' * 300}\nterms: [bias]\nmap: {{kind: clipped, min: -4, max: 4}}\n")
    assert main(["build", str(spec), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"relgen: error: {spec}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# -- the template environment -------------------------------------------------------------------------------------


def _render_text(text: str, **values) -> str:
    return str(codegen.template(text, "probe.j2").render(**values))


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("{{ x }}", {"x": "raw text"}),
        ("{{ x }}", {"x": 1.5}),
        ("{{ x }}", {"x": (1, 2)}),
        ("{{ x ~ '' }}", {"x": codegen.Source("made here")}),  # concatenation drops the mark
        ("{{ x | upper }}", {"x": codegen.Source("made here")}),
        ("{% macro m(v) %}{{ v }}{% endmacro %}{{ m(x) }}", {"x": "raw text"}),
    ],
)
def test_the_environment_refuses_unmarked_values(text, values):
    with pytest.raises(ValueError, match="may only render"):
        _render_text(text, **values)


def test_the_environment_renders_marked_values_and_its_own_strings():
    source = codegen.Source('"made here"')
    text = "{% macro m(v) %}<{{ v }}>{% endmacro %}{{ x }} {{ 3 }} {{ True }} {{ None }} {{ 'own' }} {{ m(x) }}"
    assert _render_text(text, x=source) == '"made here" 3 True None own <"made here">'
    assert _render_text("[{{ 'a' if flag }}]", flag=False) == "[]"
    with pytest.raises(jinja2.UndefinedError):
        _render_text("{{ missing }}")


# -- the exploit that once ran a shell command from `scale` ---------------------------------------------------------


def test_the_scale_exploit_never_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    exploit = f'1 #" if __import__("os").system("touch {marker}") else "1'
    spec_path = tmp_path / "evil.yaml"
    spec_path.write_text("name: evil\nterms: [bias]\nmap: {kind: clipped, min: -4, max: 4}\n" + f"scale: '{exploit}'\n")
    from relgen.runtime import mechanism as runtime

    # a plan that carries it (however it was made) renders to a module that does not run it
    plan = replace(analyze(load_spec(BASE)), scale=exploit)
    with contextlib.suppress(ValueError):
        runtime.load_module(plan)
    assert not marker.exists()

    # the spec: refused when loaded, or compiled, checked, built and imported without running it
    try:
        load_spec(spec_path)
    except SpecError:
        loaded = False
    else:
        loaded = True
        fn = runtime.compile_mechanism(spec_path)
        assert fn.plan.scale == exploit  # the exploit did reach code generation
    assert not marker.exists()
    assert main(["check", str(spec_path), "--seq-len", "1"]) == (0 if loaded else 2)
    assert not marker.exists()
    out = tmp_path / "out"
    assert main(["build", str(spec_path), "-o", str(out)]) == (0 if loaded else 2)
    assert not marker.exists()
    for built in out.glob("*.py"):
        module_spec = importlib.util.spec_from_file_location("relgen_built_evil", built)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules["relgen_built_evil"] = module
        try:
            module_spec.loader.exec_module(module)
        finally:
            del sys.modules["relgen_built_evil"]
        assert module.PLAN.scale == "1"
    assert not marker.exists()
    capsys.readouterr()
