"""A call's `projections=` option (relgen.runtime.memory): stored relation products, products formed inside the tiles,
or "auto", which stores them while their memory fits the budget. Both strategies give the FP64 reference's
results; "auto" switches exactly where the documented memory crosses the budget; `relgen explain` reports that
memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kernel_cases import assert_all_close, compare, load, make_inputs
from tiers import SLOW, slow_values
from torch._dynamo.backends.debugging import aot_eager

import relgen
import relgen.distributed as rd
from relgen.cli.main import main
from relgen.config import PROJECTION_BUDGET_ENV, set_projection_budget
from relgen.plan.analyze import GROUP_SIZE
from relgen.runtime import memory
from relgen.testing import check_close, dropout_keep_mask
from relgen.tiles.configs import INTERPRETER_CONFIG

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 16
#: the kernels' group size G: the interpreter's small tiles on the CPU, 128 on a GPU (every tuned entry's too)
GROUP = INTERPRETER_CONFIG.group if DEVICE == "cpu" else GROUP_SIZE


@pytest.fixture(autouse=True)
def _default_budget(monkeypatch):
    """Every test starts from the default budget (no environment variable, no explicit setting) and leaves it so."""
    monkeypatch.delenv(PROJECTION_BUDGET_ENV, raising=False)
    set_projection_budget(None)
    yield
    set_projection_budget(None)


def ceil8(n: int) -> int:
    return -(-n // 8) * 8


def identity_memory(b: int, h: int, n: int, group: int, z_bytes: int, dz_bytes: int) -> tuple[int, int, int]:
    """(stored forward, stored backward, tiled) bytes of a dense identity-map query-term call of N = Nq = Nk, by
    docs/algorithm.md section 10: T = B·H·N token rows, W = min(C, N + G − 1) with C = 2N − 1; Z̃ holds T·⌈W⌉₈
    entries and its end columns T·2, dZ̃ T·⌈W⌉₈; the in-tile products keep only the end columns, in fp32."""
    t = b * h * n
    w = ceil8(min(2 * n - 1, n + group - 1))
    forward = t * (w + 2) * z_bytes
    return forward, forward + t * w * dz_bytes, t * 2 * 4


class Spy:
    """Counts the calls of each module's `attention` (the stored module's and its in-tile variant's)."""

    def __init__(self, monkeypatch, fn):
        self.counts = {"stored": 0, "tiled": 0}
        for strategy, module in (("stored", fn.module), ("tiled", fn._variant(fn.module, relations="in_tile"))):
            monkeypatch.setattr(module, "attention", self._counting(strategy, module.attention))

    def _counting(self, strategy, attention):
        def counted(*args, **kwargs):
            self.counts[strategy] += 1
            return attention(*args, **kwargs)

        return counted

    def ran(self) -> str:
        ran = [s for s, n in self.counts.items() if n]
        assert len(ran) == 1, self.counts
        self.counts = dict.fromkeys(self.counts, 0)
        return ran[0]


# -- the option ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["Stored", "tile", "", None, 1, True])
def test_a_bad_value_is_a_value_error_naming_the_option(value):
    spec = load("txl")
    inputs = make_inputs(spec, b=1, h=2, nq=8, d=D, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    message = r"^projections: expected one of \('auto', 'stored', 'tiled'\)"
    with pytest.raises(ValueError, match=message):
        fn(inputs.q, inputs.k, inputs.v, **inputs.tables, projections=value)
    with pytest.raises(ValueError, match=message):
        rd.context_parallel(fn)(inputs.q, inputs.k, inputs.v, **inputs.tables, projections=value)


#: the fast tier keeps the fp32 calls of both strategies on Transformer-XL (the map whose rows grow with N)
@pytest.mark.parametrize("name", slow_values(["txl", "shaw"], slow=["shaw"]))
@pytest.mark.parametrize("strategy", ["stored", "tiled"])
@pytest.mark.parametrize(
    "dtype", slow_values([torch.float32, torch.float16], slow=[torch.float16]), ids=["fp32", "fp16"]
)
def test_both_strategies_match_the_reference(name, strategy, dtype):
    spec = load(name)
    inputs = make_inputs(spec, b=1, h=2, nq=45, nk=38, d=D, dtype=dtype, device=DEVICE, seed=4)
    assert_all_close(compare(spec, inputs, projections=strategy), f"{name} {strategy}")


@SLOW
def test_tiled_keeps_recompute_projections_and_options():
    """recompute_projections keeps its meaning (nothing is stored to recompute: the same results); a key padding
    mask and offsets reach the in-tile kernels."""
    spec = load("txl")
    inputs = make_inputs(spec, b=2, h=2, nq=20, nk=33, d=D, device=DEVICE, seed=6, length=40)
    kpm = torch.ones(2, 33, dtype=torch.bool, device=DEVICE)
    kpm[1, 25:] = False
    options = {"key_padding_mask": kpm, "q_offset": 20, "k_offset": 7}
    for recompute in (False, True):
        results = compare(spec, inputs, projections="tiled", recompute_projections=recompute, **options)
        assert_all_close(results, f"recompute_projections={recompute}")


@SLOW
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_tiled_serves_grouped_heads_layouts_and_dropout(layout):
    from test_layouts import layout_inputs

    spec = load("shaw")
    inputs = layout_inputs(spec, b=1, h=4, h_kv=2, nq=33, layout=layout, seed=4)
    assert_all_close(compare(spec, inputs, layout=layout, projections="tiled"), f"grouped heads, {layout}")
    inputs = make_inputs(spec, b=1, h=2, nq=30, d=D, device=DEVICE, seed=2)
    keep = dropout_keep_mask((1, 2, 30, 30), 0.2, 7, device=DEVICE)
    results = compare(spec, inputs, dropout_p=0.2, dropout_seed=7, keep_mask=keep, projections="tiled")
    assert_all_close(results, "dropout")


def test_a_bias_only_spec_runs_the_stored_kernels_under_tiled():
    """T5 stores no projection: "tiled" is "stored", bit for bit."""
    spec = load("t5")
    inputs = make_inputs(spec, b=1, h=2, nq=30, d=D, device=DEVICE, seed=2)
    fn = relgen.compile_mechanism(spec)
    assert fn.strategy(inputs.q, inputs.k, inputs.v, **inputs.tables, projections="tiled") == "stored"
    stored = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, projections="stored")
    tiled = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, projections="tiled")
    assert torch.equal(stored, tiled)


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("symmetric", {}, r"^projections='tiled': sym runs the atomic path"),
        ("txl", {"ablation": "atomic_gradients"}, r"^projections='tiled' with ablation 'atomic_gradients'"),
    ],
    ids=["atomic", "ablation"],
)
def test_tiled_refuses_what_the_in_tile_kernels_do_not_serve(spec, options, message):
    if spec == "symmetric":  # ±δ share rows: the atomic path
        spec = relgen.load_spec(
            {"name": "sym", "terms": ["query"], "map": {"kind": "expression", "expr": "Min(Abs(delta), 6)", "rows": 7}}
        )
    else:
        spec = load(spec)
    inputs = make_inputs(spec, b=1, h=2, nq=12, d=options.get("d", D), device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    q, k, v = inputs.q, inputs.k, inputs.v
    call = {"ablation": options["ablation"]} if "ablation" in options else {}
    with pytest.raises(NotImplementedError, match=message):
        fn(q, k, v, **inputs.tables, projections="tiled", **call)
    # "auto" stores them instead
    assert fn.strategy(q, k, v, **inputs.tables, **{n: x for n, x in call.items() if n != "ablation"}) == "stored"


def test_tiled_serves_packed_sequences():
    """A packed call under "tiled" runs the in-tile kernels and gives the stored projections' results within fp32
    rounding."""
    spec = load("txl")
    inputs = make_inputs(spec, b=1, h=2, nq=12, d=D, device=DEVICE, length=7)  # tables for max_seqlen 7
    q, k, v = (t.detach()[0].transpose(0, 1).requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    call = {"cu_seqlens": torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE), "max_seqlen": 7}
    fn = relgen.compile_mechanism(spec)
    assert fn.strategy(q, k, v, **inputs.tables, projections="tiled", **call) == "tiled"
    tiled = fn(q, k, v, **inputs.tables, projections="tiled", **call)
    stored = fn(q, k, v, **inputs.tables, projections="stored", **call)
    ok, message = check_close(tiled, stored.double(), torch.float32)
    assert ok, message


def test_the_ablation_keeps_its_refusals():
    spec = load("t5")
    inputs = make_inputs(spec, b=1, h=2, nq=9, d=D, device=DEVICE)
    with pytest.raises(NotImplementedError, match=r"^ablation no_projections: t5 has no projection to switch off"):
        relgen.compile_mechanism(spec)(inputs.q, inputs.k, inputs.v, **inputs.tables, ablation="no_projections")


def test_in_tile_refusal_states_each_condition():
    plan = relgen.compile_mechanism(load("txl")).module.PLAN
    assert memory.in_tile_refusal(plan, compiling=False) is None
    assert "torch.compile" in memory.in_tile_refusal(plan, compiling=True)
    assert "bias only" in memory.in_tile_refusal(relgen.analyze(load("t5")), compiling=False)
    # a bias term (read per pair) and any head dim are served
    assert memory.in_tile_refusal(relgen.analyze(load("txl_uv")), compiling=False) is None


# -- auto and the budget ------------------------------------------------------------------------------------------
def test_auto_switches_at_the_budget(monkeypatch):
    """fp32 txl at N = 40 (the interpreter's G = 32): stored while the documented bytes fit, tiled one byte below,
    for the backward's peak when the call is differentiated and the forward's without autograd."""
    spec = load("txl")
    n, b, h = 40, 1, 2
    inputs = make_inputs(spec, b=b, h=h, nq=n, d=D, device=DEVICE, seed=3)
    fn = relgen.compile_mechanism(spec)
    spy = Spy(monkeypatch, fn)
    forward, backward, _ = identity_memory(b, h, n, GROUP, 4, 4)
    args = (inputs.q, inputs.k, inputs.v)

    def run(budget, grad):
        set_projection_budget(budget)
        with torch.set_grad_enabled(grad):
            told = fn.strategy(*args, **inputs.tables)
            fn(*args, **inputs.tables)
        ran = spy.ran()
        assert told == ran
        return ran

    assert run(backward, grad=True) == "stored"
    assert run(backward - 1, grad=True) == "tiled"
    assert run(forward, grad=False) == "stored"
    assert run(forward - 1, grad=False) == "tiled"
    assert run(f"{backward}", grad=True) == "stored"  # text, as the environment gives it
    set_projection_budget(0)
    fn(*args, **inputs.tables, projections="stored")
    assert spy.ran() == "stored"  # a forced strategy whatever the budget


@SLOW
def test_auto_budgets_the_layers_together(monkeypatch):
    """`layers=L` (a model's layers in training, each keeping its forward's buffers until its backward): stored
    while L forwards' bytes and one backward's on top fit; below that, stored with the projections recomputed in
    the backward while one call's backward fits (the same gradients), tiled one byte below; a call without
    autograd, or one that recomputes its projections (its forward keeps none), is budgeted alone."""
    spec = load("txl")
    n, b, h, layers = 40, 1, 2, 3
    inputs = make_inputs(spec, b=b, h=h, nq=n, d=D, device=DEVICE, seed=3)
    fn = relgen.compile_mechanism(spec)
    spy = Spy(monkeypatch, fn)
    forward, backward, _ = identity_memory(b, h, n, GROUP, 4, 4)
    together = backward + (layers - 1) * forward
    args = (inputs.q, inputs.k, inputs.v)

    recomputed = []
    original = fn.module.attention

    def attention(*a, **kw):
        recomputed.append(kw.get("recompute_projections", False))
        return original(*a, **kw)

    def run(budget, grad=True, **options):
        set_projection_budget(budget)
        with torch.set_grad_enabled(grad):
            told = fn.strategy(*args, **inputs.tables, layers=layers, **options)
            out = fn(*args, **inputs.tables, layers=layers, **options)
        assert told == spy.ran()
        return told, out

    assert run(together)[0] == "stored"
    monkeypatch.setattr(fn.module, "attention", attention)
    kept = torch.autograd.grad(run(together)[1].sum(), args)
    told, out = run(together - 1)
    assert told == "stored" and recomputed == [False, True]
    for a, b in zip(torch.autograd.grad(out.sum(), args), kept, strict=True):
        assert torch.equal(a, b)
    assert run(backward - 1)[0] == "tiled"
    assert run(forward, grad=False)[0] == "stored"
    assert run(backward, recompute_projections=True)[0] == "stored"
    assert run(backward - 1, recompute_projections=True)[0] == "tiled"
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ValueError, match="layers: expected a positive int"):
            fn(*args, **inputs.tables, layers=bad)


def test_auto_under_the_budget_gives_the_reference_results():
    spec = load("shaw")
    inputs = make_inputs(spec, b=1, h=2, nq=40, d=D, device=DEVICE, seed=5)
    set_projection_budget(0)
    fn = relgen.compile_mechanism(spec)
    assert fn.strategy(inputs.q, inputs.k, inputs.v, **inputs.tables) == "tiled"
    assert_all_close(compare(spec, inputs), "shaw auto under a zero budget")


def test_the_budget_from_the_environment(monkeypatch):
    spec = load("txl")
    inputs = make_inputs(spec, b=1, h=2, nq=16, d=D, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    args = (inputs.q, inputs.k, inputs.v)
    assert fn.strategy(*args, **inputs.tables) == "stored"  # the default budget (1 GiB, or a quarter of the GPU)
    monkeypatch.setenv(PROJECTION_BUDGET_ENV, "0 KiB")
    set_projection_budget(None)  # the environment is read once: read it again
    assert memory.projection_budget(DEVICE) == 0
    assert fn.strategy(*args, **inputs.tables) == "tiled"
    monkeypatch.setenv(PROJECTION_BUDGET_ENV, "lots")
    set_projection_budget(None)
    with pytest.raises(ValueError, match=rf"^{PROJECTION_BUDGET_ENV}: expected a number of bytes"):
        fn(*args, **inputs.tables)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), ("4096", 4096), (" 7 ", 7), ("20GiB", 20 << 30), ("1.5 TiB", 3 << 39), ("3MiB", 3 << 20), (5, 5)],
)
def test_budgets_parse(text, expected):
    assert memory.parse_budget(text, "budget") == expected


@pytest.mark.parametrize("text", ["1.5", "-1", "GiB", "20GB", "1e9", "", "0x10", "\u0663", -1, True, 2.0, None])
def test_bad_budgets_are_value_errors_naming_the_setting(text):
    with pytest.raises(ValueError, match=r"^budget: expected"):
        set_projection_budget(text) if text is not None else memory.parse_budget(text, "budget")


def test_auto_never_picks_the_in_tile_variant_under_torch_compile():
    """The in-tile variant does not trace: "auto" stores under torch.compile whatever the budget, and "tiled" is a
    NotImplementedError."""
    torch._dynamo.reset()
    spec = load("txl")
    inputs = make_inputs(spec, b=1, h=2, nq=24, d=D, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    set_projection_budget(0)
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), backend=aot_eager, fullgraph=True)
    got = compiled(inputs.q, inputs.k, inputs.v, **inputs.tables)
    assert torch.equal(got, fn(inputs.q, inputs.k, inputs.v, **inputs.tables, projections="stored"))
    with pytest.raises(Exception, match=r"projections='tiled': not supported under torch.compile"):
        compiled(inputs.q, inputs.k, inputs.v, **inputs.tables, projections="tiled")
    torch._dynamo.reset()


@pytest.mark.parametrize("strategy", ["tiled", "auto"])
def test_a_sharded_call_takes_the_option(monkeypatch, strategy):
    """zigzag on a ring of one: two chunks, so the pairs' passes run; "tiled" (and "auto" under a zero budget) runs
    the in-tile variant's, and the result is the unsharded reference's."""
    spec = load("txl")
    inputs = make_inputs(spec, b=1, h=2, nq=24, d=D, device=DEVICE, seed=8)
    fn = relgen.compile_mechanism(spec)
    variant = fn._variant(fn.module, relations="in_tile")
    passes = []
    forward_pass = variant._forward_pass
    monkeypatch.setattr(variant, "_forward_pass", lambda *a, **kw: passes.append(1) or forward_pass(*a, **kw))
    set_projection_budget(0)
    got = rd.context_parallel(fn, sharding="zigzag")(
        inputs.q, inputs.k, inputs.v, **inputs.tables, projections=strategy
    )
    assert passes, "the in-tile variant's passes ran"
    want = relgen.reference.attention(spec, inputs.q, inputs.k, inputs.v, **inputs.tables)
    ok, message = check_close(got, want, torch.float32, "out")
    assert ok, message


def test_a_ring_of_one_takes_the_option():
    spec = load("txl")
    inputs = make_inputs(spec, b=1, h=2, nq=24, d=D, device=DEVICE, seed=8)
    fn = relgen.compile_mechanism(spec)
    want = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, projections="tiled")
    got = rd.context_parallel(fn)(inputs.q, inputs.k, inputs.v, **inputs.tables, projections="tiled")
    assert torch.equal(got, want)
    set_projection_budget(0)
    got = rd.context_parallel(fn)(inputs.q, inputs.k, inputs.v, **inputs.tables)
    assert torch.equal(got, want)


# -- relgen explain -------------------------------------------------------------------------------------------------
def explain(capsys, *argv):
    code = main(["explain", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_reports_each_strategys_memory_and_the_choice(capsys):
    """txl at N = 300, B = 2, H = 3, d = 32, fp16 (Z̃ and dZ̃ in fp16), on a GPU's group G = 128, a budget between
    the stored forward and backward: stored alone, tiled with a backward."""
    forward, backward, tiled = identity_memory(2, 3, 300, 128, 2, 2)
    argv = ("--seq-len", 300, "--batch", 2, "--heads", 3, "--head-dim", 32, "--dtype", "fp16", "--budget", forward)
    code, out, err = explain(capsys, ROOT / "specs/txl.yaml", *argv)
    assert (code, err) == (0, "")
    lines = {line.split()[0]: line for line in out.splitlines()[-4:]}
    assert f"budget {forward} bytes" in lines["relation"] and "B = 2, H = 3, d = 32, fp16" in lines["relation"]
    assert f"forward {forward} bytes" in lines["stored"] and f"backward {backward} bytes" in lines["stored"]
    assert f"forward {tiled} bytes" in lines["tiled"] and f"backward {tiled} bytes" in lines["tiled"]
    assert "stored (forward alone), tiled (forward and backward)" in lines["auto"]
    code, out, _ = explain(capsys, ROOT / "specs/txl.yaml", *argv, "--json")
    report = json.loads(out)["projection_memory"]
    assert report["stored"] == {"forward": forward, "backward": backward}
    assert report["tiled"] == {"forward": tiled, "backward": tiled}
    assert report["runs"] == {"forward": "stored", "backward": "tiled"}


def test_explain_says_why_tiled_does_not_run(capsys, tmp_path):
    spec = tmp_path / "sym.yaml"  # ±δ share rows: the atomic path
    spec.write_text("name: sym\nterms: [query]\nmap: {kind: expression, expr: 'Min(Abs(delta), 6)', rows: 7}\n")
    code, out, _ = explain(capsys, spec, "--seq-len", 64, "--budget", 0)
    assert code == 0 and "not run: sym runs the atomic path" in out and "stored (forward alone), stored" in out
    code, out, _ = explain(capsys, ROOT / "specs/t5.yaml", "--seq-len", 64)
    assert code == 0 and "'tiled' runs the stored kernels" in out


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--head-dim", "12", "--head-dim: expected a multiple of 8"),
        ("--budget", "1.5", "--budget: expected a number of bytes"),
        ("--batch", "0", "argument --batch: expected an integer from 1"),
        ("--heads", "x", "argument --heads: expected an integer from 1"),
        ("--dtype", "fp8", "argument --dtype: invalid choice"),
    ],
)
def test_explain_bad_values_are_one_line_and_exit_2(capsys, option, value, words):
    code, out, err = explain(capsys, ROOT / "specs/txl.yaml", option, value)
    assert (code, out) == (2, "")
    assert err.startswith("relgen: error: ") and words in err and err.count("\n") == 1
