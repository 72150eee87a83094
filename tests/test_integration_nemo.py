"""relgen.integrations on NeMo's Conformer attention (nemo_toolkit 3.0.0): `RelPositionMultiHeadAttention` with
NeMo's `RelPositionalEncoding`, tiny and random, patched in float32 against the same module unpatched in float64.

NeMo's package __init__s import the whole toolkit and its dependencies, while its attention file needs only
`nemo.utils`: without NeMo's ASR collection (`pip install --no-deps nemo_toolkit==3.0.0`, as CI runs) the file is
imported from the installed package with those __init__s skipped, and the masks of a limited context or chunks
come from the encoder's own `_create_masks`, compiled alone from its installed file. The tests of a whole
`ConformerEncoder` run only where the ASR collection imports (`pip install "nemo_toolkit[asr]==3.0.0"`)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import SLOW, slow_values

import relgen
import relgen.integrations
from relgen.integrations import _core, nemo_conformer
from relgen.integrations.nemo_conformer import _NOT_WINDOW, _masks, _padding
from relgen.testing import assert_as_close_as_own, check_close

ROOT = Path(__file__).resolve().parent.parent
MHA = "nemo.collections.asr.parts.submodules.multi_head_attention"
ENCODER_FILE = ("collections", "asr", "modules", "conformer_encoder.py")
ASR_DEPENDENCIES = ("omegaconf", "hydra", "lightning", "lhotse", "librosa")
D_MODEL, HEADS, T = 32, 2, 24  # head dim 16


def asr_collection_missing() -> str | None:
    """Why NeMo's ASR collection cannot be imported here, or None."""
    if importlib.util.find_spec("nemo") is None:
        return "NeMo is not installed (pip install nemo_toolkit[asr]==3.0.0)"
    missing = [name for name in ASR_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        return f"NeMo's ASR collection needs {', '.join(missing)} (pip install nemo_toolkit[asr]==3.0.0)"
    return None


def nemo_attention_file() -> types.ModuleType:
    """NeMo's multi_head_attention module, imported through NeMo's packages when its ASR collection can be, else
    alone from the installed package (its parent packages stand in, empty, for their __init__s)."""
    if MHA in sys.modules:
        return sys.modules[MHA]
    if asr_collection_missing() is None:
        return importlib.import_module(MHA)
    spec = importlib.util.find_spec("nemo")
    if spec is None:
        pytest.skip("NeMo is not installed (pip install --no-deps nemo_toolkit==3.0.0)")
    root = Path(next(iter(spec.submodule_search_locations)))
    parts = MHA.split(".")
    for depth in range(2, len(parts)):
        name = ".".join(parts[:depth])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*parts[1:depth]))]
            sys.modules[name] = package
    return importlib.import_module(MHA)


@pytest.fixture(scope="module")
def mha() -> types.ModuleType:
    return nemo_attention_file()


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Fall-back warnings come once per process and feature; each test starts without any given."""
    _core._WARNED.clear()
    yield
    _core._WARNED.clear()


def attention(mha, d_model: int = D_MODEL, heads: int = HEADS, **options) -> torch.nn.Module:
    """A random RelPositionMultiHeadAttention: NeMo initialises u and v to zero, which would hide their terms."""
    module = mha.RelPositionMultiHeadAttention(
        n_head=heads, n_feat=d_model, dropout_rate=0.0, pos_bias_u=None, pos_bias_v=None, **options
    )
    with torch.no_grad():
        module.pos_bias_u.normal_()
        module.pos_bias_v.normal_()
    return module.eval()


def copy_of(mha, module: torch.nn.Module, dtype: torch.dtype = torch.float32, **options) -> torch.nn.Module:
    """A never-patched module holding `module`'s parameters (a checkpoint's round trip)."""
    clone = mha.RelPositionMultiHeadAttention(
        n_head=module.h, n_feat=module.h * module.d_k, dropout_rate=0.0, pos_bias_u=None, pos_bias_v=None, **options
    )
    clone.load_state_dict(module.state_dict())
    return clone.to(dtype).eval()


def positions(mha, x: torch.Tensor, cache_len: int = 0) -> torch.Tensor:
    """NeMo's pos_emb for x: [1, 2L − 1, d_model], relative positions L − 1 … −(L − 1), L = T + cache_len."""
    encoding = mha.RelPositionalEncoding(d_model=x.shape[-1], dropout_rate=0.0, xscale=None)
    encoding.extend_pe(max(64, x.shape[1] + cache_len), x.device, torch.float32)
    return encoding(x, cache_len=cache_len)[1]


def nemo_mask(real: torch.Tensor, queries: slice = slice(None)) -> torch.Tensor:
    """The [B, T1, T2] mask (True = masked) NeMo's encoder builds from the real frames [B, T2] with an unlimited
    context: a pair is masked if the query or the key is padding. `queries` selects the query rows (a streaming
    step's last T1 positions)."""
    allowed = real[:, None, :] & real[:, :, None]
    return ~allowed[:, queries]


def nemo_create_masks() -> types.FunctionType:
    """`ConformerEncoder._create_masks`, the encoder's own mask building, compiled alone from the installed
    conformer_encoder.py: the file's imports need NeMo's ASR collection, the method only torch and two of the
    encoder's attributes."""
    spec = importlib.util.find_spec("nemo")
    if spec is None:
        pytest.skip("NeMo is not installed (pip install --no-deps nemo_toolkit==3.0.0)")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*ENCODER_FILE)
    tree = ast.parse(path.read_text())
    classes = (node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ConformerEncoder")
    method = next(node for node in next(classes).body if getattr(node, "name", None) == "_create_masks")
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["_create_masks"]


def encoder_mask(
    style: str, context: list[int], lengths: list[int], frames: int, cache_len: int = 0, cached: list[int] = ()
) -> torch.Tensor:
    """The [B, T1, T2] mask NeMo's encoder hands its layers for `frames` frames of real `lengths` under
    att_context_style `style` and att_context_size `context`; with a streaming cache of `cache_len` frames whose
    last `cached` are filled, its rows are the chunk's, as forward_internal slices them."""
    encoder = types.SimpleNamespace(self_attention_model="rel_pos", att_context_style=style)
    offset = cache_len - torch.tensor(cached) if cache_len else None
    _, mask = nemo_create_masks()(
        encoder,
        att_context_size=context,
        padding_length=torch.tensor(lengths) + cache_len,
        max_audio_length=frames + cache_len,
        offset=offset,
        device="cpu",
    )
    return mask[:, cache_len:]


def padded(length: int = T) -> torch.Tensor:
    """Real frames of a batch of 2: the first padded on the left (a streaming cache not yet full), the second on
    the right."""
    real = torch.ones(2, length, dtype=torch.bool)
    real[0, :5] = False
    real[1, length - 9 :] = False
    return real


def relgen_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "relgen.integrations" in str(w.message)]


def compare(patched, reference, inputs, cache=None) -> list[str]:
    """Run both modules on `inputs` (x, mask, pos_emb), backpropagate one random projection of the output, and
    return the failures of the output, dx and every parameter's gradient within fp32 rounding."""
    x, mask, pos_emb = inputs
    xs = x.clone().requires_grad_()
    xr = x.double().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = patched(query=xs, key=xs, value=xs, mask=mask, pos_emb=pos_emb, cache=cache)
    assert relgen_warnings(caught) == [], "the call fell back to NeMo's own code"
    ref_cache = None if cache is None else cache.double()
    expected = reference(query=xr, key=xr, value=xr, mask=mask, pos_emb=pos_emb.double(), cache=ref_cache)
    if cache is not None:
        (out, new_cache), (expected, expected_cache) = out, expected
        assert torch.equal(new_cache.double(), expected_cache)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    (out * weights).sum().backward()
    (expected * weights.double()).sum().backward()
    results = [check_close(out, expected, torch.float32, "output"), check_close(xs.grad, xr.grad, torch.float32, "dx")]
    for (name, p), (_, r) in zip(patched.named_parameters(), reference.named_parameters(), strict=True):
        results.append(check_close(p.grad, r.grad, torch.float32, name))
    return [message for ok, message in results if not ok]


@pytest.mark.parametrize("padding", slow_values(["none", "left-and-right"], fast=["left-and-right"]))
@pytest.mark.parametrize("sdpa", slow_values([False, True], fast=[False]), ids=["eager", "sdpa"])
def test_patched_attention_matches_float64(mha, padding, sdpa):
    """Every output row (padded ones too), dx and every parameter's gradient, against NeMo's eager and SDPA
    paths in float64."""
    torch.manual_seed(0)
    module = attention(mha, use_pytorch_sdpa=sdpa)
    reference = copy_of(mha, module, torch.float64, use_pytorch_sdpa=sdpa)
    assert relgen.integrations.patch(module) == ["RelPositionMultiHeadAttention"]
    x = torch.randn(2, T, D_MODEL)
    real = padded() if padding != "none" else torch.ones(2, T, dtype=torch.bool)
    failures = compare(module, reference, (x, nemo_mask(real), positions(mha, x)))
    assert not failures, "\n".join(failures)


@SLOW
def test_layers_handed_one_mask_read_it_once(mha, monkeypatch):
    """An encoder's layers share its mask: the first layer reads it (a wait for the GPU), the others reuse that
    reading, each still exact; a mask changed in place, or a new one, is read again, and so is an inference-mode
    mask (no version counter to tell a change)."""
    torch.manual_seed(0)
    layers = [attention(mha) for _ in range(3)]
    references = [copy_of(mha, layer, torch.float64) for layer in layers]
    for layer in layers:
        relgen.integrations.patch(layer)
    reads = []
    real_masks = nemo_conformer._masks
    monkeypatch.setattr(nemo_conformer, "_masks", lambda *a: reads.append(1) or real_masks(*a))
    x = torch.randn(2, T, D_MODEL)
    pos_emb = positions(mha, x)
    mask = nemo_mask(padded())
    for layer, reference in zip(layers, references, strict=True):
        assert not compare(layer, reference, (x, mask, pos_emb))
    assert len(reads) == 1
    mask[1, :, 3] = True  # key 3 of the second sequence is padding now (in place)
    for layer, reference in zip(layers, references, strict=True):
        assert not compare(layer, reference, (x, mask, pos_emb))
    assert len(reads) == 2
    with torch.no_grad():
        layers[0](query=x, key=x, value=x, mask=mask.clone(), pos_emb=pos_emb)
        assert len(reads) == 3
        with torch.inference_mode():
            frozen = mask.clone()
            for _ in range(2):
                layers[0](query=x, key=x, value=x, mask=frozen, pos_emb=pos_emb)
        assert len(reads) == 5


def test_biases_kept_without_autograd_follow_in_place_updates(mha):
    """Without autograd a layer keeps u and v − u in the attention dtype across calls; an in-place update of u or v
    (an optimizer step, load_state_dict) is seen by the next call, which matches NeMo's float64 code again."""
    torch.manual_seed(0)
    module = attention(mha)
    reference = copy_of(mha, module, torch.float64)
    relgen.integrations.patch(module)
    x = torch.randn(2, T, D_MODEL)
    mask, pos_emb = nemo_mask(padded()), positions(mha, x)
    for step in range(3):
        with torch.no_grad():
            out = module(query=x, key=x, value=x, mask=mask, pos_emb=pos_emb)
            expected = reference(query=x.double(), key=x.double(), value=x.double(), mask=mask,
                                 pos_emb=pos_emb.double())  # fmt: skip
            ok, message = check_close(out, expected, torch.float32, f"output after {step} updates")
            assert ok, message
            for layer in (module, reference):  # the same step on both
                layer.pos_bias_u.add_(0.5 if step == 0 else 0.0)
                layer.pos_bias_v.mul_(2.0 if step == 1 else 1.0)


@SLOW
def test_streaming_cache_step(mha):
    """A cache-aware streaming step: the cache (partly filled in the first sequence) is prepended to the keys by
    NeMo's update_cache, the 8 queries are the last of 20 positions (q_offset = 12), and the next cache comes back
    as NeMo builds it."""
    torch.manual_seed(0)
    cache_len, chunk = 12, 8
    module = attention(mha)
    reference = copy_of(mha, module, torch.float64)
    module.cache_drop_size = reference.cache_drop_size = 2  # as the encoder's setup_streaming_params sets it
    relgen.integrations.patch(module)
    x = torch.randn(2, chunk, D_MODEL)
    cache = torch.randn(2, cache_len, D_MODEL)
    real = torch.ones(2, cache_len + chunk, dtype=torch.bool)
    real[0, :7] = False  # cache_last_channel_len = 5: the first 7 cache frames are not filled yet
    real[1, cache_len + 6 :] = False  # the second chunk has 6 real frames
    mask = nemo_mask(real, queries=slice(cache_len, None))
    failures = compare(module, reference, (x, mask, positions(mha, x, cache_len)), cache=cache)
    assert not failures, "\n".join(failures)


@SLOW
def test_shared_biases_sum_their_gradients(mha):
    """untie_biases=False: the encoder passes one u and one v to every layer; their gradients sum over the layers."""
    torch.manual_seed(0)

    def stack(dtype: torch.dtype) -> torch.nn.ModuleList:
        generator = torch.Generator().manual_seed(3)  # the same u, v and layers for both stacks
        u, v = (torch.nn.Parameter(torch.randn(HEADS, D_MODEL // HEADS, generator=generator)) for _ in range(2))
        torch.manual_seed(4)
        layers = torch.nn.ModuleList(
            mha.RelPositionMultiHeadAttention(HEADS, D_MODEL, 0.0, pos_bias_u=u, pos_bias_v=v) for _ in range(2)
        )
        return layers.to(dtype).eval()  # Module.to converts shared parameters in place: still one u, one v

    layers, reference = stack(torch.float32), stack(torch.float64)
    assert relgen.integrations.patch(layers) == ["0", "1"]
    x = torch.randn(2, T, D_MODEL)
    mask, pos_emb = nemo_mask(padded()), positions(mha, x)

    def run(layers: torch.nn.ModuleList, x: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = x + layer(query=x, key=x, value=x, mask=mask, pos_emb=pos_emb)
        return x

    out, expected = run(layers, x, pos_emb), run(reference, x.double(), pos_emb.double())
    weights = torch.randn(out.shape)
    (out * weights).sum().backward()
    (expected * weights.double()).sum().backward()
    for name in ("pos_bias_u", "pos_bias_v"):
        assert getattr(layers[0], name) is getattr(layers[1], name)
        assert getattr(reference[0], name) is getattr(reference[1], name)
    pairs = [("output", out, expected)]
    pairs += [
        (name, getattr(layers[0], name).grad, getattr(reference[0], name).grad) for name in ("pos_bias_u", "pos_bias_v")
    ]
    for name, got, want in pairs:
        ok, message = check_close(got, want, torch.float32, name)
        assert ok, message


def test_unpatch_and_checkpoints(mha):
    """state_dict keys stay NeMo's, a checkpoint saved while patched loads into an unpatched module, and unpatch
    restores NeMo's outputs bit for bit."""
    torch.manual_seed(0)
    module = attention(mha)
    x = torch.randn(2, T, D_MODEL)
    inputs = dict(query=x, key=x, value=x, mask=nemo_mask(padded()), pos_emb=positions(mha, x))
    with torch.no_grad():
        before = module(**inputs)
    keys = list(module.state_dict())
    names = relgen.integrations.patch(module)
    assert list(module.state_dict()) == keys
    loaded = copy_of(mha, module)
    assert relgen.integrations.unpatch(module) == names
    assert "forward" not in module.__dict__
    with torch.no_grad():
        assert torch.equal(module(**inputs), before)
        assert torch.equal(loaded(**inputs), before)


LIMITED = [  # att_context_size [left, right] ("regular"; −1: unlimited), padding, NeMo's eager or SDPA path
    ([4, 2], [T - 5, T - 9], False),
    ([0, 0], [T, T], False),  # every query sees itself only
    ([6, 0], [T - 5, T - 9], True),
    ([3, -1], [T - 5, T - 9], False),
    ([-1, 2], [T, T], True),
]


@pytest.mark.parametrize(
    ("context", "lengths", "sdpa"),
    slow_values(LIMITED, slow=[LIMITED[1], LIMITED[3]]),
    ids=lambda case: str(case).replace(" ", ""),
)
def test_limited_context_matches_float64(mha, context, lengths, sdpa):
    """A limited att_context_size runs on relgen's local window, with NeMo's padding on top: outputs (padded rows
    too), dx and every parameter's gradient against NeMo's own code in float64, on the mask its encoder builds."""
    torch.manual_seed(0)
    module = attention(mha, use_pytorch_sdpa=sdpa)
    reference = copy_of(mha, module, torch.float64, use_pytorch_sdpa=sdpa)
    relgen.integrations.patch(module)
    x = torch.randn(2, T, D_MODEL)
    failures = compare(module, reference, (x, encoder_mask("regular", context, lengths, T), positions(mha, x)))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("context", [[5, 0], [4, 2]], ids=str)
def test_streaming_cache_step_with_limited_context(mha, context):
    """A streaming step of 8 queries after a cache of 12 frames (the first sequence's cache holds 5, its chunk 8
    real frames; the second's cache is full, its chunk holds 6): the window is counted from each query's position
    q_offset + i, as NeMo's mask counts it."""
    torch.manual_seed(0)
    cache_len, chunk = 12, 8
    module = attention(mha)
    reference = copy_of(mha, module, torch.float64)
    module.cache_drop_size = reference.cache_drop_size = 2
    relgen.integrations.patch(module)
    x = torch.randn(2, chunk, D_MODEL)
    cache = torch.randn(2, cache_len, D_MODEL)
    mask = encoder_mask("regular", context, [chunk, 6], chunk, cache_len=cache_len, cached=[5, cache_len])
    failures = compare(module, reference, (x, mask, positions(mha, x, cache_len)), cache=cache)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [[64, 0], [128, 32]], ids=str)
def test_limited_context_on_gpu(mha, context):
    """1000 frames at head dim 64 (the second sequence 300 shorter), fp32 kernels against NeMo in float64."""
    torch.manual_seed(0)
    frames = 1000
    module = attention(mha, d_model=128).cuda()
    reference = copy_of(mha, module, torch.float64).cuda()
    relgen.integrations.patch(module)
    x = torch.randn(2, frames, 128, device="cuda")
    mask = encoder_mask("regular", context, [frames, frames - 300], frames).cuda()
    failures = compare(module, reference, (x, mask, positions(mha, x)))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("context", [[4, 0], [5, -1]], ids=str)
def test_chunked_limited_that_is_a_window_is_served(mha, context):
    """chunked_limited with one-frame chunks (right context 0) or an unlimited right context is a local window."""
    torch.manual_seed(0)
    module = attention(mha)
    reference = copy_of(mha, module, torch.float64)
    relgen.integrations.patch(module)
    x = torch.randn(2, T, D_MODEL)
    mask = encoder_mask("chunked_limited", context, [T - 5, T], T)
    failures = compare(module, reference, (x, mask, positions(mha, x)))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("style", "context"), [("chunked_limited", [6, 2]), ("chunked_limited_with_rc", [4, 3, 1])], ids=["3", "rc"]
)
def test_chunks_fall_back_once(mha, style, context):
    """Chunks longer than one frame are a block mask, not a window: NeMo's own answer, one warning naming them."""
    torch.manual_seed(0)
    module = attention(mha)
    own = copy_of(mha, module)
    relgen.integrations.patch(module)
    x = torch.randn(2, T, D_MODEL)
    mask = encoder_mask(style, context, [T - 5, T], T)
    inputs = dict(query=x, key=x, value=x, mask=mask, pos_emb=positions(mha, x))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [module(**inputs) for _ in range(2)]
        expected = own(**inputs)
    messages = relgen_warnings(caught)
    assert len(messages) == 1 and "neither padding nor padding within a local window" in messages[0]
    assert "chunked_limited" in messages[0]
    assert all(torch.equal(out, expected) for out in got)


def test_float64_call_falls_back(mha):
    torch.manual_seed(0)
    module = attention(mha)
    own = copy_of(mha, module, torch.float64)
    relgen.integrations.patch(module)
    module.double()
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64)
    inputs = dict(query=x, key=x, value=x, mask=nemo_mask(padded()), pos_emb=positions(mha, x).double())
    with torch.no_grad(), pytest.warns(UserWarning, match=r"torch\.float64 inputs is not served"):
        out = module(**inputs)
    with torch.no_grad():
        assert torch.equal(out, own(**inputs))


def test_attention_dtype_option(mha):
    """attention_dtype=torch.float16 runs the kernels in fp16 (bf16 is not run here: Triton's interpreter gets bf16
    dot products wrong); the output stays in the module's dtype, within fp16 rounding of float64. A bad value or an
    option no adapter takes raises a ValueError naming it and leaves the model unpatched."""
    torch.manual_seed(0)
    module = attention(mha)
    reference = copy_of(mha, module, torch.float64)
    with pytest.raises(ValueError, match=r"^attention_dtype: expected None or one of"):
        relgen.integrations.patch(module, attention_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^window: not an option of the relgen integrations serving"):
        relgen.integrations.patch(module, window=4)
    assert not _core.is_patched(module)
    relgen.integrations.patch(module, attention_dtype=torch.float16)
    x = torch.randn(2, T, D_MODEL)
    mask, pos_emb = nemo_mask(padded()), positions(mha, x)
    with torch.no_grad():
        out = module(query=x, key=x, value=x, mask=mask, pos_emb=pos_emb)
        xr = x.double()
        expected = reference(query=xr, key=xr, value=xr, mask=mask, pos_emb=pos_emb.double())
    assert out.dtype == torch.float32
    ok, message = check_close(out, expected, torch.float16, "output")
    assert ok, message


@SLOW
def test_recompute_projections_option(mha):
    """recompute_projections=True: the backward recomputes the relation projections; the same gradients."""
    torch.manual_seed(0)
    module = attention(mha)
    reference = copy_of(mha, module, torch.float64)
    with pytest.raises(ValueError, match=r"^recompute_projections: expected a bool, got str"):
        relgen.integrations.patch(module, recompute_projections="yes")
    relgen.integrations.patch(module, recompute_projections=True)
    x = torch.randn(2, T, D_MODEL)
    failures = compare(module, reference, (x, nemo_mask(padded()), positions(mha, x)))
    assert not failures, "\n".join(failures)


def test_projections_option(mha):
    """projections= reaches the calls: at this length "auto" (the default) stores txl_uv's projections, so "stored"
    gives the same bits, and "tiled" (the in-tile products, b̃ read per pair) gives the same result to fp32
    rounding."""
    torch.manual_seed(0)
    x = torch.randn(2, 24, D_MODEL)
    inputs = dict(
        query=x, key=x, value=x, mask=nemo_mask(torch.ones(2, 24, dtype=torch.bool)), pos_emb=positions(mha, x)
    )
    module = attention(mha)
    with pytest.raises(ValueError, match=r"^projections: expected one of \('auto', 'stored', 'tiled'\)"):
        relgen.integrations.patch(module, projections="in_tile")
    outputs = {}
    for strategy in ("auto", "stored", "tiled"):
        patched = copy_of(mha, module)
        relgen.integrations.patch(patched, projections=strategy)
        with torch.no_grad():
            outputs[strategy] = patched(**inputs)
    assert torch.equal(outputs["auto"], outputs["stored"])
    torch.testing.assert_close(outputs["tiled"], outputs["stored"], rtol=1e-5, atol=1e-6)


def test_layers_patched_together_are_budgeted_together(mha, monkeypatch):
    """One patch() call tells each layer how many it served: their calls pass that as the mechanism's `layers`,
    with which "auto" budgets the stored projections that training keeps in all of them at once."""
    from relgen.runtime.mechanism import Mechanism

    seen = []
    original = Mechanism.__call__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("layers"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Mechanism, "__call__", spy)
    x = torch.randn(1, 12, D_MODEL)
    mask = nemo_mask(torch.ones(1, 12, dtype=torch.bool))
    inputs = dict(query=x, key=x, value=x, mask=mask, pos_emb=positions(mha, x))
    stack = torch.nn.ModuleList(attention(mha) for _ in range(3))
    alone = attention(mha)
    assert len(relgen.integrations.patch(stack)) == 3
    relgen.integrations.patch(alone)
    with torch.no_grad():
        for module in (*stack, alone):
            module(**inputs)
    assert seen == [3, 3, 3, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16])
def test_autocast_runs_the_kernels_in_fp32(mha, autocast):
    """Under autocast NeMo casts the inputs to fp32 and projects in bf16 (fp16 autocast becomes bf16); relgen's
    kernels get fp32. The patched module lies as close to the module in float64 as NeMo's own code under the same
    autocast does."""
    torch.manual_seed(0)
    module = attention(mha).cuda()
    own = copy_of(mha, module).cuda()
    reference = copy_of(mha, module, torch.float64).cuda()
    relgen.integrations.patch(module)
    x = torch.randn(2, 64, D_MODEL, device="cuda")
    real = torch.ones(2, 64, dtype=torch.bool, device="cuda")
    real[1, 40:] = False
    inputs = dict(query=x, key=x, value=x, mask=nemo_mask(real.cpu()).cuda(), pos_emb=positions(mha, x))
    with torch.no_grad():
        want = reference(**{name: t.double() if t.is_floating_point() else t for name, t in inputs.items()})
        with torch.autocast("cuda", dtype=autocast):
            out, expected = module(**inputs), own(**inputs)
    assert_as_close_as_own(out, expected, want, f"{autocast} autocast output")


def test_unsupported_configurations(mha):
    """Head dim 8 and rel_pos_local_attn (Longformer-style windows): named in one warning and left on NeMo's code;
    strict=True raises naming the option."""
    small = torch.nn.ModuleDict({"narrow": attention(mha, d_model=16)})
    with pytest.raises(ValueError, match=r"narrow \(RelPositionMultiHeadAttention\): relgen cannot serve head_dim=8"):
        relgen.integrations.patch(small, strict=True)
    assert not _core.is_patched(small["narrow"])
    local = mha.RelPositionMultiHeadAttentionLongformer(
        n_head=HEADS, n_feat=D_MODEL, dropout_rate=0.0, pos_bias_u=None, pos_bias_v=None, att_context_size=[4, 4]
    )
    model = torch.nn.ModuleDict({"local": local, "full": attention(mha)})
    with pytest.warns(UserWarning, match=r"left on the model's own code: local \(self_attention_model='rel_pos_local"):
        assert relgen.integrations.patch(model) == ["full"]
    assert not _core.is_patched(local)


def test_runs_the_shipped_txl_uv_spec():
    """specs/txl_uv.yaml documents the form the layers run."""
    shipped, used = relgen.load_spec(ROOT / "specs/txl_uv.yaml"), relgen.load_spec(nemo_conformer._TXL_UV)
    for field in ("terms", "map", "scale", "causal", "heads_share_tables"):
        assert getattr(used, field) == getattr(shipped, field), field


@SLOW
@settings(max_examples=80, deadline=None)
@given(
    batch=st.integers(1, 3),
    t1=st.integers(1, 7),
    extra=st.integers(0, 4),
    shared_batch=st.booleans(),
    data=st.data(),
)
def test_padding_masks_are_recognised(batch, t1, extra, shared_batch, data):
    """Any [B, T1, T2] bool mask: recognised as padding iff its allowed pairs are exactly (rows with a pair) ×
    (columns with a pair), checked densely here, and then its real queries and keys come back; the check in
    blocks of rows agrees with the check in one block."""
    t2 = t1 + extra
    rows = 1 if shared_batch else batch
    if data.draw(st.booleans(), label="outer form"):
        queries = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows * t1, max_size=rows * t1)))
        keys = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows * t2, max_size=rows * t2)))
        mask = ~(queries.view(rows, t1, 1) & keys.view(rows, 1, t2))
        if data.draw(st.booleans(), label="flip one pair"):
            i, j = data.draw(st.integers(0, t1 - 1)), data.draw(st.integers(0, t2 - 1))
            mask[0, i, j] = ~mask[0, i, j]
    else:
        flat = data.draw(st.lists(st.booleans(), min_size=rows * t1 * t2, max_size=rows * t1 * t2))
        mask = torch.tensor(flat).view(rows, t1, t2)
    allowed = ~mask
    real_queries, real_keys = allowed.any(dim=2), allowed.any(dim=1)
    is_padding = torch.equal(allowed, real_queries[:, :, None] & real_keys[:, None, :])

    got_queries, got_keys, feature = _padding(mask, batch, t1, t2)
    old = nemo_conformer._CHECK_BLOCK
    nemo_conformer._CHECK_BLOCK = t2  # one row per block
    try:
        assert _padding(mask, batch, t1, t2)[2] == feature
    finally:
        nemo_conformer._CHECK_BLOCK = old
    if not is_padding:
        assert feature is not None and "not a padding mask" in feature
        return
    assert feature is None
    want_queries, want_keys = real_queries.expand(batch, t1), real_keys.expand(batch, t2)
    assert torch.equal(want_queries, torch.ones_like(want_queries) if got_queries is None else got_queries)
    assert torch.equal(want_keys, torch.ones_like(want_keys) if got_keys is None else got_keys)


def band(t1: int, t2: int, left: int | None, right: int | None) -> torch.Tensor:
    """[T1, T2]: query row i, at position i + T2 − T1, sees key j when it lies within `left` before and `right`
    after it (None: unbounded)."""
    delta = (torch.arange(t1)[:, None] + t2 - t1) - torch.arange(t2)[None, :]
    return (delta <= (t2 if left is None else left)) & (delta >= -(t2 if right is None else right))


@settings(max_examples=120, deadline=None)
@given(
    batch=st.integers(1, 3),
    t1=st.integers(1, 7),
    extra=st.integers(0, 4),
    shared_batch=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 8)),
    right=st.one_of(st.none(), st.integers(0, 8)),
    data=st.data(),
)
def test_windowed_padding_masks_are_recognised(batch, t1, extra, shared_batch, left, right, data):
    """Padding within a band, maybe with one pair flipped: served iff some window reproduces the mask exactly
    (searched densely here over every window), and then the window returned does, with each bounded side
    needed; the check in blocks of rows agrees with the check in one block."""
    t2 = t1 + extra
    rows = 1 if shared_batch else batch
    queries = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows * t1, max_size=rows * t1)))
    keys = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows * t2, max_size=rows * t2)))
    allowed = queries.view(rows, t1, 1) & keys.view(rows, 1, t2) & band(t1, t2, left, right)
    if data.draw(st.booleans(), label="flip one pair"):
        i, j = data.draw(st.integers(0, t1 - 1)), data.draw(st.integers(0, t2 - 1))
        allowed[0, i, j] = ~allowed[0, i, j]
    real_queries, real_keys = allowed.any(dim=2), allowed.any(dim=1)

    def reproduces(window: tuple[int | None, int | None]) -> bool:
        return torch.equal(allowed, real_queries[:, :, None] & real_keys[:, None, :] & band(t1, t2, *window))

    sides = [None, *range(t2)]
    expressible = any(reproduces(window) for window in itertools.product(sides, sides))

    got_queries, got_keys, window, feature = _masks(~allowed, batch, t1, t2)
    old = nemo_conformer._CHECK_BLOCK
    nemo_conformer._CHECK_BLOCK = t2  # one row per block
    try:
        assert _masks(~allowed, batch, t1, t2)[2:] == (window, feature)
    finally:
        nemo_conformer._CHECK_BLOCK = old
    if not expressible:
        assert (window, feature) == (None, _NOT_WINDOW)
        return
    assert feature is None
    window = window or (None, None)
    assert reproduces(window)
    assert window[0] is None or not reproduces((None, window[1]))
    assert window[1] is None or not reproduces((window[0], None))
    want_queries, want_keys = real_queries.expand(batch, t1), real_keys.expand(batch, t2)
    assert torch.equal(want_queries, torch.ones_like(want_queries) if got_queries is None else got_queries)
    assert torch.equal(want_keys, torch.ones_like(want_keys) if got_keys is None else got_keys)


def test_masks_of_other_shapes_fall_back():
    assert _padding(torch.zeros(2, 3, 4), 2, 3, 4)[2] == "an attention mask of type torch.float32"
    assert (
        _padding(torch.zeros(2, 1, 3, 4, dtype=torch.bool), 2, 3, 4)[2] == "an attention mask not of shape [B, T1, T2]"
    )
    assert _padding(None, 2, 3, 4) == (None, None, None)


# --- a whole ConformerEncoder: only where NeMo's ASR collection imports ----------------------------------------------


@pytest.fixture(scope="module")
def conformer_encoder():
    why = asr_collection_missing()
    if why is not None:
        pytest.skip(why)
    return importlib.import_module("nemo.collections.asr.modules.conformer_encoder").ConformerEncoder


def encoder(cls, **options) -> torch.nn.Module:
    """A tiny FastConformer: 8 features, 4× subsampling (dw_striding), d_model 32, 2 heads, 2 layers, no dropout."""
    config = dict(
        feat_in=8,
        n_layers=2,
        d_model=D_MODEL,
        n_heads=HEADS,
        subsampling="dw_striding",
        subsampling_factor=4,
        subsampling_conv_channels=16,
        ff_expansion_factor=2,
        conv_kernel_size=5,
        dropout=0.0,
        dropout_pre_encoder=0.0,
        dropout_emb=0.0,
        dropout_att=0.0,
        pos_emb_max_len=256,
    )
    model = cls(**{**config, **options})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "pos_bias" in name:
                p.normal_()
    return model.eval()


def features(frames: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, 8, frames, generator=generator), torch.tensor([frames, frames - 37])


@pytest.mark.parametrize(
    "options",
    [{"untie_biases": True}, {"untie_biases": False}, {"att_context_size": [6, 2]}],
    ids=["untied", "shared", "limited-context"],
)
def test_encoder_matches_float64(conformer_encoder, options):
    torch.manual_seed(0)
    model = encoder(conformer_encoder, **options)
    reference = encoder(conformer_encoder, **options)
    reference.load_state_dict(model.state_dict())
    reference.double()
    names = relgen.integrations.patch(model)
    assert names == ["layers.0.self_attn", "layers.1.self_attn"]
    x, lengths = features()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, out_lengths = model(audio_signal=x, length=lengths)
    assert relgen_warnings(caught) == []
    expected, expected_lengths = reference(audio_signal=x.double(), length=lengths)
    assert torch.equal(out_lengths, expected_lengths)
    weights = torch.randn(out.shape)
    (out * weights).sum().backward()
    (expected * weights.double()).sum().backward()
    results = [check_close(out, expected, torch.float32, "output")]
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if r.grad is not None:
            results.append(check_close(p.grad, r.grad, torch.float32, name))
    failures = [message for ok, message in results if not ok]
    assert not failures, "\n".join(failures)


def test_encoder_chunked_limited_falls_back(conformer_encoder):
    torch.manual_seed(0)
    options = {"att_context_style": "chunked_limited", "att_context_size": [6, 2]}  # chunks of 3 frames
    model = encoder(conformer_encoder, **options)
    own = encoder(conformer_encoder, **options)
    own.load_state_dict(model.state_dict())
    relgen.integrations.patch(model)
    x, lengths = features()
    with torch.no_grad(), pytest.warns(UserWarning, match="chunked_limited"):
        out = model(audio_signal=x, length=lengths)[0]
    with torch.no_grad():
        assert torch.equal(out, own(audio_signal=x, length=lengths)[0])


def test_encoder_streaming_step(conformer_encoder):
    """cache_last_channel with an unlimited context: NeMo's cache of 10000 frames is mostly unfilled padding."""
    torch.manual_seed(0)
    model = encoder(conformer_encoder)
    reference = encoder(conformer_encoder)
    reference.load_state_dict(model.state_dict())
    reference.double()
    model.setup_streaming_params(max_context=40)
    reference.setup_streaming_params(max_context=40)
    relgen.integrations.patch(model)
    channel, time, channel_len = model.get_initial_cache_state(batch_size=2)
    channel = torch.randn(channel.shape, generator=torch.Generator().manual_seed(2))
    channel_len = torch.tensor([7, 0])  # frames filled: the last 7 of the first sequence's cache, none of the second
    x, lengths = features(48)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(
            audio_signal=x,
            length=lengths,
            cache_last_channel=channel,
            cache_last_time=time,
            cache_last_channel_len=channel_len,
        )
        expected = reference(
            audio_signal=x.double(),
            length=lengths,
            cache_last_channel=channel.double(),
            cache_last_time=time.double(),
            cache_last_channel_len=channel_len,
        )
    assert relgen_warnings(caught) == []
    for name, a, e in zip(("output", "length", "channel", "time", "channel_len"), got, expected, strict=True):
        if a.is_floating_point():
            ok, message = check_close(a, e, torch.float32, name)
            assert ok, message
        else:
            assert torch.equal(a, e), name
