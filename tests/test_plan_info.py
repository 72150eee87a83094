"""The generated module's PLAN (relgen.runtime.geometry.PlanInfo) is a view of the Plan: each of its fields is a
Plan field of the same name holding the Plan's value (or one of the documented derived fields), for every shipped
spec, a local window, an unproven map and the ablation variants. Expected values are worked out from the Plan here,
not taken from code generation."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import yaml

from relgen.codegen import generator as codegen
from relgen.codegen.generator import PLAN_INFO_DERIVED, PLAN_INFO_FIELDS
from relgen.plan.analyze import Plan, analyze
from relgen.runtime.geometry import PlanInfo
from relgen.runtime.mechanism import load_module
from relgen.spec.expr import parse_expression
from relgen.spec.model import load_spec

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))
#: PlanInfo's caches of the device constants and call geometries a module builds as it runs: not plan facts
BOOKKEEPING = {"constants", "calls"}
#: a map whose saturation the analyzer cannot prove beyond its canonical length (valid_up_to is set)
UNPROVEN = {
    "name": "unproven",
    "terms": ["bias"],
    "map": {"kind": "expression", "expr": "floor(Max(Min(delta, 5), -5) / 2) + 5 + delta - delta", "rows": 11},
}


def _spec(shipped: str, **changes) -> dict:
    return {**yaml.safe_load((ROOT / "specs" / f"{shipped}.yaml").read_text()), **changes}


PLANS = {
    **{name: lambda name=name: analyze(load_spec(ROOT / "specs" / f"{name}.yaml")) for name in SHIPPED},
    "txl_windowed": lambda: analyze(load_spec(_spec("txl", name="txl_local", window={"left": 2, "right": 1}))),
    "shaw_windowed": lambda: analyze(load_spec(_spec("shaw", name="shaw_local", window={"left": 5, "right": 0}))),
    "txl_reversed": lambda: analyze(
        load_spec(_spec("txl", name="txl_reversed", map={"kind": "identity", "offset": "key_minus_query"}))
    ),
    "unproven": lambda: analyze(load_spec(UNPROVEN)),
    "txl_in_tile": lambda: dataclasses.replace(analyze(load_spec(ROOT / "specs" / "txl.yaml")), relations="in_tile"),
    "deberta_by_row": lambda: dataclasses.replace(
        analyze(load_spec(ROOT / "specs" / "deberta_v3.yaml")), projections="by_row"
    ),
    "shaw_atomic": lambda: dataclasses.replace(analyze(load_spec(ROOT / "specs" / "shaw.yaml")), path="atomic"),
}


def _plan_info_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(PlanInfo)} - BOOKKEEPING


def test_every_plan_info_field_is_a_plan_field_or_a_derived_one():
    plan_fields = {f.name for f in dataclasses.fields(Plan)}
    assert len(set(PLAN_INFO_FIELDS)) == len(PLAN_INFO_FIELDS)
    assert set(PLAN_INFO_FIELDS) <= plan_fields, set(PLAN_INFO_FIELDS) - plan_fields
    assert not set(PLAN_INFO_DERIVED) & plan_fields, "a derived field must not reuse a Plan field's name"
    assert _plan_info_fields() == set(PLAN_INFO_FIELDS) | set(PLAN_INFO_DERIVED)


def _expected_fold(plan: Plan) -> tuple[tuple[int, int], ...] | None:
    """Each row's run of columns in β: (first column, count), (0, 0) for a row no column reads."""
    if plan.path == "atomic" or plan.length_dependent or plan.copy_map == tuple(range(plan.rows)):
        return None
    runs = []
    for row in range(plan.rows):
        columns = [s for s, b in enumerate(plan.copy_map) if b == row]
        if not columns:
            runs.append((0, 0))
            continue
        assert columns[-1] - columns[0] + 1 == len(columns), f"row {row}'s columns are not one run"
        runs.append((columns[0], len(columns)))
    return tuple(runs)


@pytest.mark.parametrize("case", sorted(PLANS))
def test_plan_info_holds_the_plans_values(case):
    plan = PLANS[case]()
    info = load_module(plan).PLAN
    for name in PLAN_INFO_FIELDS:
        value, want = getattr(info, name), getattr(plan, name)
        if name == "scale":  # the same expression, in normal form
            assert parse_expression(value, ("d",)) == parse_expression(want, ("d",)), (value, want)
        elif name == "copy_map" and plan.length_dependent:
            # β(s) = (R − 1)/2 ± (s + L) at every length; the Plan holds it at its own length
            sign = {"identity": 1, "reversed": -1}[value]
            base = (plan.rows - 1) // 2
            assert tuple(base + sign * (s + plan.saturation_low) for s in range(len(want))) == want
        else:
            assert value == want, (name, value, want)
            assert type(value) is type(want) or isinstance(want, str), (name, type(value), type(want))
    assert info.fold == _expected_fold(plan)
    proven = plan.saturation_proven or plan.length_dependent
    assert info.valid_up_to == (None if proven else plan.seq_len)


def test_the_cases_cover_each_derived_form():
    infos = [load_module(PLANS[case]()).PLAN for case in sorted(PLANS)]
    assert {"identity", "reversed"} <= {i.copy_map for i in infos if isinstance(i.copy_map, str)}
    assert any(i.fold is not None for i in infos) and any(i.valid_up_to is not None for i in infos)
    assert any(i.local_left is not None for i in infos) and any(i.relations == "in_tile" for i in infos)


def test_the_module_declares_exactly_those_fields_in_order():
    source = codegen.render(PLANS["shaw"]())
    call = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "_rt.PlanInfo"
    )
    assert not call.args
    assert [kw.arg for kw in call.keywords] == [*PLAN_INFO_FIELDS, *PLAN_INFO_DERIVED]
    for kw in call.keywords:  # every value is a plain literal (literal_eval refuses names, calls, operators)
        ast.literal_eval(kw.value)


@pytest.mark.parametrize(
    "value",
    [1.5, "shaw", codegen.Source('a"b'), codegen.Source("x + 1"), ("query", "key"), [1, 2], {"a": 1}, (1, 2.0)],
    ids=range(8),
)
def test_only_checked_values_become_literals(value):
    with pytest.raises(ValueError, match=r"plan\.field"):
        codegen._literal(value, "field")


def test_checked_values_become_their_literals():
    checked = (codegen.Source("query"), codegen.Source("key"))
    assert ast.literal_eval(codegen._literal(checked, "terms")) == ("query", "key")
    assert ast.literal_eval(codegen._literal((3, 1, 2), "copy_map")) == (3, 1, 2)
    for value in (None, True, False, 0, -7):
        assert ast.literal_eval(codegen._literal(value, "field")) == value
