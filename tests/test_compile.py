"""relgen inside torch.compile: calls become two custom ops (relgen.runtime.custom_ops) that run the same kernels as an
eager call, so a compiled call must give the same bits, output and every gradient, with no graph break."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_cases import LOG_QUERY_KEY, SPECS, load, make_inputs, spec_id
from tiers import SLOW
from torch._dynamo.backends.debugging import aot_eager
from torch.utils._python_dispatch import TorchDispatchMode

import relgen

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


#: the shipped specs, DeBERTa's as its small-table form (log buckets, query and key terms; kernel_cases)
COMPILE_SPECS = [LOG_QUERY_KEY if name == "deberta_v3" else name for name in SPECS]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: a test must not pass on a graph that an earlier one left in the cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Recording:
    """A torch.compile backend that keeps the graphs Dynamo hands it, then compiles them as `backend` does."""

    def __init__(self, backend=aot_eager):
        self.backend = backend
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.backend(gm, example_inputs)

    def relgen_ops(self) -> list[str]:
        return [str(n.target) for g in self.graphs for n in g.graph.nodes if str(n.target).startswith("relgen.")]


def _leaves(inputs):
    return [inputs.q, inputs.k, inputs.v, *inputs.tables.values()]


def _run(fn, inputs, options, seed=5):
    """[outputs (out, and lse with return_lse), then the gradient of every leaf for a fixed random dO]."""
    out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, **options)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device="cpu").manual_seed(seed)
    do = torch.randn(outs[0].shape, generator=g).to(outs[0])
    grads = torch.autograd.grad(outs[0], _leaves(inputs), do)
    return [*(o.detach() for o in outs), *grads]


def assert_equal_bits(got, want, label, names=None):
    """Two runs (_run's lists) hold the same tensors bit for bit."""
    names = names or [f"tensor {i}" for i in range(len(want))]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{label}: {name}"
        assert torch.equal(a, b), f"{label}: {name} differs from the eager call (max {(a - b).abs().max()})"


def assert_same_bits(spec_name, inputs, backend=None, **options):
    """The compiled call (one graph, holding relgen's forward op) equals the eager call bit for bit."""
    fn = relgen.compile_mechanism(load(spec_name))
    recording = backend or Recording()
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), backend=recording, fullgraph=True)
    want = _run(fn, inputs, options)
    got = _run(compiled, inputs, options)
    assert len(recording.graphs) == 1, "one graph (fullgraph) per call"
    assert any(op.endswith("_forward.default") for op in recording.relgen_ops()), recording.relgen_ops()
    names = [
        "out",
        *(["lse"] if options.get("return_lse") else []),
        "dq",
        "dk",
        "dv",
        *(f"d{t}" for t in inputs.tables),
    ]
    assert_equal_bits(got, want, spec_id(spec_name), names)


@SLOW
@pytest.mark.parametrize("name", COMPILE_SPECS, ids=spec_id)
def test_compiled_call_gives_the_eager_bits(name):
    inputs = make_inputs(load(name), b=2, h=2, nq=40, nk=40, d=16, device=DEVICE, seed=3)
    assert_same_bits(name, inputs)


@SLOW
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("shaw", {"key_padding_mask": "ragged"}),
        ("txl", {"q_offset": 9, "k_offset": 2}),
        ("t5_decoder", {"return_lse": True}),
        (LOG_QUERY_KEY, {"recompute_projections": True}),
        ("t5", {"dropout_p": 0.2, "dropout_seed": 1234}),
        ("wav2vec2_bert", {"scale": 0.3}),
    ],
    ids=lambda x: spec_id(x) if isinstance(x, str) or "name" in x else "-".join(x),  # a spec, or the options' names
)
def test_compiled_call_options(name, options):
    inputs = make_inputs(load(name), b=2, h=2, nq=33, nk=33, d=16, device=DEVICE, seed=4, length=42)
    if options.get("key_padding_mask") == "ragged":
        mask = torch.ones(2, 33, dtype=torch.bool, device=DEVICE)
        mask[1, 17:] = False
        options = {**options, "key_padding_mask": mask}
    assert_same_bits(name, inputs, **options)


@SLOW
@pytest.mark.parametrize("name", ["txl", LOG_QUERY_KEY], ids=spec_id)
def test_compiled_packed_sequences(name):
    spec = load(name)
    lengths = [5, 33, 1, 20]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    base = make_inputs(spec, b=1, h=2, nq=max(lengths), d=16, device=DEVICE, seed=6)
    g = torch.Generator().manual_seed(2)
    packed = [torch.randn(sum(lengths), 2, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3)]
    inputs = type(base)(*packed, base.tables)
    assert_same_bits(name, inputs, cu_seqlens=cu, max_seqlen=max(lengths), return_lse=True)


@SLOW
def test_dynamic_lengths_share_one_graph_per_bucket():
    """Symbolic lengths (dynamic=True): the fake forward picks the tiles of the length's bucket, which guards the
    graph on that bucket; lengths of one bucket reuse it, and every call matches the eager one."""
    fn = relgen.compile_mechanism(load("shaw"))
    recording = Recording()
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), backend=recording, fullgraph=True, dynamic=True)
    graphs = []
    for n in (40, 47, 52):  # one length bucket (64)
        inputs = make_inputs(load("shaw"), b=1, h=2, nq=n, d=16, device=DEVICE, seed=n)
        assert_equal_bits(_run(compiled, inputs, {}), _run(fn, inputs, {}), f"N={n}")
        graphs.append(len(recording.graphs))
    # (the first length may take two graphs: Dynamo first traces the float default dropout_p as an input)
    assert graphs[0] >= 1 and graphs[1:] == [graphs[0]] * 2, graphs


@SLOW
def test_a_map_planned_for_a_wider_window_loads_while_tracing():
    """A map whose saturation the analyzer cannot prove (delta - delta) is planned for the analysed window; a longer
    call loads the module planned for a wider one (relgen.runtime.mechanism._load_wider), which under fullgraph
    compilation happens at trace time."""
    spec = relgen.load_spec(
        {
            "name": "sqrt_buckets",
            "terms": ["query", "bias"],
            "map": {
                "kind": "expression",
                "expr": "sign(delta)*Min(floor(sqrt(Abs(delta))), 7) + 7 + delta - delta",
                "rows": 15,
            },
        }
    )
    fn = relgen.compile_mechanism(spec)
    assert fn.module.PLAN.valid_up_to == 64
    inputs = make_inputs(spec, b=1, h=2, nq=80, d=16, device=DEVICE, seed=2)
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), backend=aot_eager, fullgraph=True)
    got = _run(compiled, inputs, {})  # first: the wider module is loaded while Dynamo traces
    assert_equal_bits(got, _run(fn, inputs, {}), "N=80")


@SLOW
@pytest.mark.parametrize(
    ("name", "option", "values"),
    [("t5", "dropout_seed", (1, 2, 3, 4)), ("txl", "q_offset", (3, 5, 9, 12))],
    ids=["per-step-seed", "kv-cache-offset"],
)
def test_an_int_that_changes_per_call_becomes_symbolic(name, option, values):
    """A per-step dropout seed, a KV cache's growing offset: Dynamo recompiles once with the int symbolic (the
    fake forward accepts a SymInt), and every call still equals the eager one."""
    spec = load(name)
    fn = relgen.compile_mechanism(spec)
    recording = Recording()
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), backend=recording, fullgraph=True)
    for value in values:
        options = {option: value, **({"dropout_p": 0.3} if option == "dropout_seed" else {})}
        nq, nk = (1, 20) if option == "q_offset" else (24, 24)
        inputs = make_inputs(spec, b=1, h=2, nq=nq, nk=nk, d=16, device=DEVICE, length=max(nq + value, nk))
        assert_equal_bits(_run(compiled, inputs, options), _run(fn, inputs, options), f"{option}={value}")
    assert len(recording.graphs) == 2


@SLOW
def test_a_tensor_seed_updated_in_place_keeps_one_graph():
    """A seed tensor changed in place per step is one graph input (no recompilation, nothing for a CUDA graph to
    replay wrong); each step draws what an eager call with that int draws, the backward too although the seed
    moved on before it."""
    spec = load("t5")
    fn = relgen.compile_mechanism(spec)
    recording = Recording()
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), backend=recording, fullgraph=True)
    inputs = make_inputs(spec, b=1, h=2, nq=24, d=16, device=DEVICE)
    seed = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for value in (1, 2, 3):
        seed.fill_(value)
        out = compiled(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.3, dropout_seed=seed)
        seed.fill_(100 + value)
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
        got = [out.detach(), *torch.autograd.grad(out, _leaves(inputs), do)]
        assert_equal_bits(got, _run(fn, inputs, {"dropout_p": 0.3, "dropout_seed": value}), f"seed {value}")
    assert len(recording.graphs) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"q_offset": -1}, "q_offset: expected a non-negative int"),
        ({"aq": "wrong rows"}, r"aq: expected shape \[2, 513, 16\]"),
        ({"dropout_p": 0.1}, "dropout_seed: required with dropout_p > 0 under torch.compile"),
        ({"cu_seqlens": "packed"}, "max_seqlen: required with cu_seqlens under torch.compile"),
    ],
    ids=["offset", "table", "dropout-seed", "max-seqlen"],
)
def test_bad_calls_under_compile_name_the_argument(options, message):
    spec = load("shaw")
    inputs = make_inputs(spec, b=1, h=2, nq=24, d=16, device=DEVICE)
    q, k, v, aq = inputs.q, inputs.k, inputs.v, inputs.tables["aq"]
    if options.get("aq") == "wrong rows":
        options = {**options, "aq": torch.randn(2, 500, 16, device=DEVICE)}
    if options.get("cu_seqlens") == "packed":
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        options = {**options, "cu_seqlens": torch.tensor([0, 10, 24], dtype=torch.int32, device=DEVICE)}
    options = {"aq": aq, **options}
    fn = relgen.compile_mechanism(spec)
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), backend=aot_eager, fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(q, k, v, **options)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_do_not_go_through_the_custom_ops():
    """The dispatcher's cost per op is host time a short eager call cannot spare: eager calls keep the
    autograd.Function."""
    spec = load("shaw")
    inputs = make_inputs(spec, b=1, h=2, nq=24, d=16, device=DEVICE)
    fn = relgen.compile_mechanism(spec)
    with _Ops() as ops:
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables)
        out.sum().backward()
    assert ops.names and not [n for n in ops.names if n.startswith("relgen.")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("name", ["shaw", "txl", "deberta_v3", "t5"])
def test_inductor_and_cuda_graphs_give_the_eager_bits(name, mode):
    """Inductor (fp16, N = 1000), and its CUDA graphs (mode='reduce-overhead': the calls are captured once, then
    replayed with no host work): three steps (warm-up, capture, replay) each equal the eager call bit for bit, and
    no graph is left out of the CUDA graphs."""
    from torch._dynamo.utils import counters

    fn = relgen.compile_mechanism(load(name))
    inputs = make_inputs(load(name), b=2, h=4, nq=1000, d=64, dtype=torch.float16, device="cuda", seed=8)
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), mode=mode, fullgraph=True)
    want = _run(fn, inputs, {})
    counters.clear()
    for step in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        assert_equal_bits(_run(compiled, inputs, {}), want, f"{name} {mode} step {step}")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["shaw", "t5"])
def test_eager_calls_replay_from_a_captured_cuda_graph(name):
    """torch.cuda.graph around eager calls (forward and backward): a replay computes what an eager call computes on
    the inputs the static tensors hold at replay time; dropout without a seed is refused during capture."""
    spec = load(name)
    fn = relgen.compile_mechanism(spec)
    inputs = make_inputs(spec, b=2, h=4, nq=1000, d=64, dtype=torch.float16, device="cuda", seed=8)
    leaves = _leaves(inputs)
    do = torch.randn_like(inputs.q)

    def step():
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables)
        return [out, *torch.autograd.grad(out, leaves, do)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernels, builds the plan's device constants)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (8, 9):  # the captured inputs, then new values in the same tensors
        fresh = make_inputs(spec, b=2, h=4, nq=1000, d=64, dtype=torch.float16, device="cuda", seed=seed)
        with torch.no_grad():
            for t, new in zip(leaves, _leaves(fresh), strict=True):
                t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert_equal_bits(captured, step(), f"{name} inputs of seed {seed}")
    with pytest.raises(NotImplementedError, match="dropout_seed: required"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["deberta_v3", "t5"])
def test_a_first_call_under_cuda_graphs_builds_its_constants_outside_the_graphs_pool(name):
    """The plan's device constants (the copy map β, the fold runs) are built by the first call that needs them and
    kept. When that call is torch.compile's CUDA-graph warm-up, they must not come from the graph's private pool:
    cudagraph trees reject a tensor there that outlives the outputs (seen under torch.compile on the H200)."""
    spec = load(name)
    fn = relgen.compile_mechanism(spec)
    fn.module.PLAN.constants.clear()  # as in a fresh process
    inputs = make_inputs(spec, b=2, h=4, nq=1000, d=64, dtype=torch.float16, device="cuda", seed=8)
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), mode="reduce-overhead", fullgraph=True)
    steps = []
    for _ in range(3):  # warm-up (builds the constants), capture, replay
        torch.compiler.cudagraph_mark_step_begin()
        steps.append([t.clone() for t in _run(compiled, inputs, {})])  # the next replay overwrites the outputs
    assert fn.module.PLAN.constants, "the spec keeps device constants (else this test shows nothing)"
    want = _run(fn, inputs, {})
    for step, got in enumerate(steps):
        assert_equal_bits(got, want, f"{name} step {step}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["deberta_v3", "t5"])
def test_dropout_in_compiled_cuda_graphs_reads_its_seed_tensor(name):
    """Dropout replayed from torch.compile's CUDA graphs (mode='reduce-overhead', no graph skipped): a seed tensor
    updated in place between steps draws each step's own mask, bit for bit what an eager call with that int seed
    draws."""
    from torch._dynamo.utils import counters

    spec = load(name)
    fn = relgen.compile_mechanism(spec)
    fn.module.PLAN.constants.clear()  # the first call is the compiled one (see the test below)
    inputs = make_inputs(spec, b=2, h=4, nq=1000, d=64, dtype=torch.float16, device="cuda", seed=8)
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    compiled = torch.compile(lambda *a, **kw: fn(*a, **kw), mode="reduce-overhead", fullgraph=True)
    counters.clear()
    for value in (11, 12, 13, 14):  # warm-up, capture, replays
        seed.fill_(value)
        torch.compiler.cudagraph_mark_step_begin()
        got = _run(compiled, inputs, {"dropout_p": 0.1, "dropout_seed": seed})
        assert_equal_bits(got, _run(fn, inputs, {"dropout_p": 0.1, "dropout_seed": value}), f"step {value}")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["deberta_v3", "t5"])
def test_dropout_in_a_captured_cuda_graph_reads_its_seed_tensor(name):
    """torch.cuda.graph around eager dropout calls (forward and every gradient): each replay draws the mask of the
    seed its tensor holds at replay time, bit for bit what an eager call with that int seed draws."""
    spec = load(name)
    fn = relgen.compile_mechanism(spec)
    inputs = make_inputs(spec, b=2, h=4, nq=1000, d=64, dtype=torch.float16, device="cuda", seed=8)
    leaves = _leaves(inputs)
    seed = torch.full((1,), 20, dtype=torch.int64, device="cuda")
    do = torch.randn_like(inputs.q)

    def step(dropout_seed):
        out = fn(inputs.q, inputs.k, inputs.v, **inputs.tables, dropout_p=0.1, dropout_seed=dropout_seed)
        return [out, *torch.autograd.grad(out, leaves, do)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(seed)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(seed)
    for value in (21, 22):
        seed.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert_equal_bits(captured, step(value), f"captured, seed {value}")
