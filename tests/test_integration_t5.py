"""relgen.integrations on Hugging Face T5 / mT5: tiny random models, patched (fp32, relgen's kernels) against the
same model unpatched in float64 (HF's own code), to fp32 rounding."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tiers import SLOW
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import relgen.integrations
from relgen.integrations import _core, hf_t5
from relgen.runtime.mechanism import Mechanism
from relgen.testing import assert_as_close_as_own, assert_close, check_close

transformers = pytest.importorskip("transformers")

SELF_ATTENTION = [f"{stack}.block.{i}.layer.0.SelfAttention" for stack in ("encoder", "decoder") for i in (0, 1)]
ONE_LAYER = {"num_layers": 1, "num_decoder_layers": 1}  # where a second layer adds interpreter time but no path


def _config(cls: type = transformers.T5Config, **overrides) -> transformers.PretrainedConfig:
    settings = dict(
        vocab_size=64,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return cls(**{**settings, **overrides})


def _model(cls: type = transformers.T5ForConditionalGeneration, seed: int = 0, **overrides) -> torch.nn.Module:
    config_cls = transformers.MT5Config if cls.__name__.startswith("MT5") else transformers.T5Config
    torch.manual_seed(seed)
    return cls(_config(config_cls, **overrides)).eval()


def _padding(lengths: list[tuple[int, int]], n: int) -> torch.Tensor:
    """[B, n] attention mask with rows padded by (left, right) tokens."""
    mask = torch.ones(len(lengths), n, dtype=torch.long)
    for row, (left, right) in enumerate(lengths):
        mask[row, :left] = 0
        mask[row, n - right :] = 0
    return mask


def _batch(n: int, m: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Encoder rows padded on the right and on the left; decoder rows padded on the left (its first queries see
    no real key) and on the right."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(2, 64, (2, n), generator=g),
        "attention_mask": _padding([(0, n // 4), (n // 5, 0)], n),
        "labels": torch.randint(2, 64, (2, m), generator=g),
        "decoder_attention_mask": _padding([(3, 0), (0, m // 5)], m),
    }


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and every parameter's gradient of a loss that touches every row, padded ones included."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    weights = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss = out.loss + 1e-2 * (out.logits * weights.to(out.logits.dtype)).sum()
    loss.backward()
    return out.logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def _assert_matches(actual: tuple, expected: tuple) -> None:
    logits, grads = actual
    ref_logits, ref_grads = expected
    assert_close(logits, ref_logits, torch.float32, "logits")
    assert grads.keys() == ref_grads.keys()
    failed = [check_close(grads[name], ref_grads[name], torch.float32, name) for name in ref_grads]
    assert all(ok for ok, _ in failed), "\n".join(message for ok, message in failed if not ok)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _pairwise(shapes: list[tuple[str, tuple[int, ...]]], n: int, m: int) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors sized by a query length and a key length at once: [.., Nq, .., Nk, ..] (also flattened) for the
    encoder (n, n), the decoder (m, m) and the cross-attention (m, n)."""
    pairs = [(n, n), (m, m), (m, n)]

    def dense(shape: tuple[int, ...]) -> bool:
        dims = list(shape)
        if any(d in (a * b for a, b in pairs) for d in dims):
            return True
        return any(dims.count(a) >= 2 if a == b else (a in dims and b in dims) for a, b in pairs)

    return [(op, shape) for op, shape in shapes if dense(shape)]


@contextmanager
def _relgen_warnings() -> Iterator[list[str]]:
    """The messages of relgen.integrations' warnings raised inside the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
    messages.extend(str(w.message) for w in caught if "relgen.integrations" in str(w.message))


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    # warn_once is once per process: each test sees its own first warning
    monkeypatch.setattr(_core, "_WARNED", set())


# ---------------------------------------------------------------------------------------------------------- training


N, M = 24, 20  # encoder and decoder lengths: no model dimension equals either (d 16, d_model 32, d_ff 64, ...)


@pytest.fixture(scope="module")
def step() -> dict:
    """One patched training step (recorded op by op) and the same step of the unpatched model in float64."""
    model = _model()
    reference = copy.deepcopy(model).double()
    names = relgen.integrations.patch(model)
    batch = _batch(N, M)
    with _relgen_warnings() as messages, _Shapes() as recorded:
        patched = _step(model, batch)
    with _Shapes() as reference_recorded:
        expected = _step(reference, batch)
    return {
        "names": names,
        "patched": patched,
        "expected": expected,
        "warnings": messages,
        "shapes": recorded.shapes,
        "reference_shapes": reference_recorded.shapes,
        "model": model,
    }


@SLOW
def test_patch_names_the_self_attention_modules(step: dict) -> None:
    assert step["names"] == SELF_ATTENTION
    model = step["model"]
    assert model.encoder.config._attn_implementation == "relgen_t5"
    assert model.decoder.config._attn_implementation == "relgen_t5"
    assert model.config._attn_implementation == "sdpa"  # the top-level config is not the stacks'


@SLOW
def test_outputs_and_gradients_match_hf(step: dict) -> None:
    """Logits on every row (padded ones and decoder rows without a key included) and every parameter's gradient,
    the shared bias tables' too, within fp32 rounding of HF in float64; no call fell back."""
    assert step["warnings"] == []
    _assert_matches(step["patched"], step["expected"])


@SLOW
def test_nothing_pairwise_is_built(step: dict) -> None:
    """No tensor of the patched forward and backward is sized by a query and a key length, while HF's own step
    builds several (its bias, masks and scores), so the probe sees them."""
    assert _pairwise(step["shapes"], N, M) == []
    assert len(_pairwise(step["reference_shapes"], N, M)) > 10
    assert any("threshold_backward" in op for op, _ in step["shapes"])  # the backward was recorded too (ReLU's)


def _copies(shapes: list[tuple[str, tuple[int, ...]]], n: int, m: int) -> list[tuple[str, tuple[int, ...]]]:
    """The copies (clone: .contiguous() and copying reshapes; _to_copy: casts; cat, stack, copy_) of a tensor shaped
    like a layer's q, k, v or O ([B, H, L, d], [B, L, H, d] or [B, L, H·d], L the encoder or decoder length)."""
    b, h, d = 2, 2, 16
    qkv = {shape for length in (n, m) for shape in ((b, h, length, d), (b, length, h, d), (b, length, h * d))}
    copies = ("aten.clone", "aten._to_copy", "aten.cat", "aten.stack", "aten.copy_")
    return [(op, shape) for op, shape in shapes if op.startswith(copies) and shape in qkv]


@SLOW
def test_q_k_v_are_not_copied() -> None:
    """No q, k, v or O of a patched layer, nor a gradient of one, is copied in a training step without a cache
    (use_cache=False; with one, HF's DynamicCache concatenates each decoder layer's k, v onto it in [B, H, L, d]
    order and its backward copies their gradients back, patched or not). HF's own step copies its attention output
    (.contiguous() after the transpose), so the probe can see copies. Padded keys everywhere, no decoder row
    without a key (the correction of such rows sends its gradients in [B, H, L, d] order)."""
    model = _model(**ONE_LAYER)
    reference = copy.deepcopy(model)
    relgen.integrations.patch(model)
    batch = {**_batch(N, M), "decoder_attention_mask": _padding([(0, 3), (0, M // 5)], M), "use_cache": False}
    with _relgen_warnings() as messages, _Shapes() as recorded:
        _step(model, batch)
    with _Shapes() as reference_recorded:
        _step(reference, batch)
    assert messages == []
    assert _copies(recorded.shapes, N, M) == []
    assert _copies(reference_recorded.shapes, N, M)


# ----------------------------------------------------------------------------------------------- short calls: SDPA


@contextmanager
def _kernel_calls() -> Iterator[list[bool]]:
    """The `causal` flag of every call of a relgen mechanism inside the block (True: a decoder's)."""
    calls: list[bool] = []
    original = Mechanism.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.plan.causal)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(Mechanism, "__call__", counted)
        yield calls


@contextmanager
def _sdpa_masks() -> Iterator[list[torch.Tensor]]:
    """The attn_mask of every torch SDPA call inside the block."""
    masks: list[torch.Tensor] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
        yield masks


def _fused_kernels_take(masks: list[torch.Tensor]) -> bool:
    """Whether every mask has unit stride along the keys, without which torch's fused SDPA kernels refuse it on a
    GPU and SDPA runs its math path (several launches a call)."""
    return all(mask is None or mask.stride(-1) == 1 for mask in masks)


@SLOW
def test_short_decoder_runs_sdpa_over_its_bias_rows_and_matches_hf() -> None:
    """A decoder of at most ROW_QUERIES queries is served by SDPA over the bias rows: logits and every gradient
    (the shared table's included) as HF's in float64, padded decoder rows and rows without a key included, and no
    kernel call in the decoder; the encoder's calls stay on the kernels."""
    model = _model()
    reference = copy.deepcopy(model).double()
    relgen.integrations.patch(model)
    batch = _batch(N, hf_t5.ROW_QUERIES)
    with _relgen_warnings() as messages, _kernel_calls() as calls, _sdpa_masks() as masks:
        patched = _step(model, batch)
    assert messages == []
    assert calls == [False, False]  # the encoder's two layers
    assert len(masks) == 4 and _fused_kernels_take(masks)  # two layers' self- and cross-attention
    _assert_matches(patched, _step(reference, batch))


@SLOW
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_short_decoder_under_gradient_checkpointing_matches_hf(reentrant: bool) -> None:
    """Under gradient checkpointing a layer's forward runs again in the backward: the bias rows its first run formed
    must not stand in for the second's (a reentrant checkpoint runs the first without gradients), and the table's
    gradient still sums over the layers."""
    model = _model().train()
    reference = copy.deepcopy(model).double()
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    relgen.integrations.patch(model)
    batch = {**_batch(N, 8), "use_cache": False}
    with _relgen_warnings() as messages:
        patched = _step(model, batch)
    assert messages == []
    _assert_matches(patched, _step(reference, batch))


@settings(max_examples=40, deadline=None)
@given(
    buckets=st.integers(2, 64),
    max_distance=st.integers(2, 300),
    bidirectional=st.booleans(),
    causal=st.booleans(),
    offset=st.integers(0, 400),
)
def test_bias_rows_read_hfs_buckets(buckets: int, max_distance: int, bidirectional: bool, causal: bool, offset: int):
    """φ(δ) as the SDPA path reads it (Mechanism.offset_rows) equals HF's _relative_position_bucket(j − i) at every
    offset a call at this query offset reaches (causal plans: where causality lets a key through)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    exact = (buckets // 2 if bidirectional else buckets) // 2
    assume(exact >= 1 and max_distance > exact)
    mechanism = hf_t5._State(None, buckets, max_distance, bidirectional).mechanism(causal)
    delta = (torch.arange(offset, offset + 3)[:, None] - torch.arange(offset + 3)).flatten()
    delta = torch.cat([delta, torch.tensor([0, 1, max_distance, 4 * max_distance, 1 << 20])])
    delta = delta[delta >= 0] if causal else torch.cat([delta, -delta])
    expected = T5Attention._relative_position_bucket(-delta, bidirectional, buckets, max_distance)
    assert torch.equal(mechanism.offset_rows(delta), expected)


# -------------------------------------------------------------------------------------------------------- generation


@SLOW
@pytest.mark.parametrize("decode", ["rows", "kernels"])
@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic", "static"])
def test_generate_matches_hf(cache: str | None, decode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generate() with the dynamic and the static cache: HF's tokens, and each step's logits to fp32
    rounding (positions come from the cache; the static cache's unfilled keys stay masked). Each decode step on
    SDPA over its bias rows (the default), and on the kernels (ROW_QUERIES = 0)."""
    if decode == "kernels":
        monkeypatch.setattr(hf_t5, "ROW_QUERIES", 0)
    model = _model(initializer_factor=4.0)  # a larger init, so that greedy tokens vary from step to step
    reference = copy.deepcopy(model)
    relgen.integrations.patch(model)
    batch = _batch(8, 1)
    options = dict(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        suppress_tokens=[0, 1],
        cache_implementation=cache,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with _relgen_warnings() as messages, _kernel_calls() as calls, _sdpa_masks() as masks:
        out = model.generate(**options)
    expected = reference.generate(**options)
    assert messages == []
    assert calls.count(True) == (0 if decode == "rows" else 6 * 2)  # 6 steps, 2 decoder layers
    # rows: the 8-token encoder's two layers too, then each step's self- and cross-attention in two layers
    assert len(masks) == (2 + 6 * 4 if decode == "rows" else 6 * 2) and _fused_kernels_take(masks)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(set(expected.sequences[:, 1:].flatten().tolist())) > 2
    for i, (actual, want) in enumerate(zip(out.logits, expected.logits, strict=True)):
        assert_close(actual, want, torch.float32, f"step {i} logits")


# ------------------------------------------------------------------------------------------- unpatch and checkpoints


@SLOW
def test_unpatch_restores_bitwise_outputs() -> None:
    """A patched call leaves nothing behind, a deep copy of a patched model runs patched on its own, and unpatching
    gives the never-patched model's bits back."""
    model = _model(**ONE_LAYER)
    untouched = copy.deepcopy(model)
    keys = list(model.state_dict())
    batch = _batch(6, 4)
    names = relgen.integrations.patch(model)
    assert names == ["encoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.0.SelfAttention"]
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)
    with torch.no_grad():
        patched = model(**batch).logits
        assert torch.equal(twin(**batch).logits, patched)
    assert relgen.integrations.unpatch(model) == names
    assert model.encoder.config._attn_implementation == untouched.encoder.config._attn_implementation
    assert model.decoder.config._attn_implementation == untouched.decoder.config._attn_implementation
    assert twin.decoder.config._attn_implementation == "relgen_t5"
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, untouched(**batch).logits)
    assert relgen.integrations.unpatch(twin) == names
    assert twin.decoder.config._attn_implementation == untouched.decoder.config._attn_implementation


def test_unpatch_restores_an_encoder_models_own_config() -> None:
    """T5EncoderModel's stack shares the model's config: patching switches it, unpatching switches it back."""
    model = _model(transformers.T5EncoderModel)
    assert relgen.integrations.patch(model) == [
        "encoder.block.0.layer.0.SelfAttention",
        "encoder.block.1.layer.0.SelfAttention",
    ]
    assert model.config._attn_implementation == "relgen_t5"
    relgen.integrations.unpatch(model)
    assert model.config._attn_implementation == "sdpa"


def test_checkpoint_saved_after_patching_loads_unpatched(tmp_path) -> None:
    model = _model()
    untouched = copy.deepcopy(model)
    relgen.integrations.patch(model)
    model.save_pretrained(tmp_path)
    assert "relgen" not in (tmp_path / "config.json").read_text()
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert loaded.state_dict().keys() == untouched.state_dict().keys()
    for name, tensor in untouched.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    batch = _batch(8, 5)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, untouched(**batch).logits)


# --------------------------------------------------------------------------------------------------------- fall-back


def _fallback_cases() -> list:
    def attentions(model, batch):
        out = model(**batch, output_attentions=True)
        return (out.logits, *out.encoder_attentions, *out.decoder_attentions, *out.cross_attentions)

    def head_mask(model, batch):  # HF 5.17's T5 takes head masks as keywords and ignores them
        return (model(**batch, head_mask=torch.zeros(2, 2)).logits,)

    def float64(model, batch):
        return (model.double()(**batch).logits,)

    def mask_4d(model, batch):
        encoder = model.get_encoder()
        padding = batch["attention_mask"].bool()
        additive = torch.zeros(2, 1, 8, 8).masked_fill(~padding[:, None, None, :], torch.finfo(torch.float32).min)
        return (encoder(input_ids=batch["input_ids"], attention_mask=additive).last_hidden_state,)

    return [
        pytest.param(attentions, "output_attentions", {"attn_implementation": "eager"}, id="output_attentions"),
        pytest.param(head_mask, "head_mask", {}, id="head_mask"),
        pytest.param(float64, "float64 inputs", {}, id="float64"),
        pytest.param(mask_4d, "a 4-D attention mask", {}, id="4d_mask"),
    ]


@pytest.mark.parametrize(("run", "feature", "overrides"), _fallback_cases())
def test_fall_back_warns_once_and_gives_hfs_answer(run, feature: str, overrides: dict, fresh_warnings) -> None:
    model = _model(**overrides)
    untouched = copy.deepcopy(model)
    relgen.integrations.patch(model)
    batch = _batch(8, 5)
    with torch.no_grad():
        expected = run(untouched, batch)
        with _relgen_warnings() as first:
            actual = run(model, batch)
        with _relgen_warnings() as second:
            run(model, batch)
    assert len(first) == 1 and feature in first[0], first
    assert second == []
    assert len(actual) == len(expected) > 0
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


@SLOW
def test_eager_rows_without_a_key_fall_back_only_with_gradients(fresh_warnings) -> None:
    """Under HF's eager attention a keyless row's softmax also sends a gradient to the bias table: with gradients
    such calls run the model's own code (exactly HF's gradients); without, they stay on relgen."""
    model = _model(attn_implementation="eager", **ONE_LAYER)
    reference = copy.deepcopy(model).double()
    relgen.integrations.patch(model)
    batch = _batch(8, 6)
    with torch.no_grad(), _relgen_warnings() as inference:
        logits = model(**batch).logits
    assert inference == []
    with _relgen_warnings() as training:
        patched = _step(model, batch)
    assert len(training) == 1 and "without a key under attn_implementation='eager'" in training[0]
    expected = _step(reference, batch)
    assert_close(logits, expected[0], torch.float32, "no_grad logits")
    _assert_matches(patched, expected)


def test_unsupported_head_dim_is_refused(fresh_warnings) -> None:
    with pytest.raises(ValueError, match="head_dim=8"):
        relgen.integrations.patch(_model(d_kv=8), strict=True)
    model = _model(d_kv=8)
    with pytest.warns(UserWarning, match="left on the model's own code.*head_dim=8"):
        assert relgen.integrations.patch(model) == []
    assert model.encoder.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------------------------------------------- mT5


def test_mt5_matches_hf() -> None:
    model = _model(transformers.MT5ForConditionalGeneration, **ONE_LAYER)
    reference = copy.deepcopy(model).double()
    assert relgen.integrations.patch(model) == [
        "encoder.block.0.layer.0.SelfAttention",
        "decoder.block.0.layer.0.SelfAttention",
    ]
    batch = _batch(8, 5)
    with torch.no_grad():
        assert_close(model(**batch).logits, reference(**batch).logits, torch.float32, "logits")


# --------------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("m", [M, hf_t5.ROW_QUERIES], ids=["kernels", "rows"])
def test_autocast_bf16_is_as_close_as_hfs_own(m: int) -> None:
    """Under autocast the projections are bf16 while the bias table stays fp32: relgen's logits lie as close to
    the float64 model as HF's own autocast run does, the decoder on the kernels and on SDPA over its bias rows."""
    model = _model().cuda()
    untouched = copy.deepcopy(model)
    reference = copy.deepcopy(model).double()
    relgen.integrations.patch(model)
    batch = {name: t.cuda() for name, t in _batch(N, m).items()}
    with torch.no_grad():
        expected = reference(**batch).logits
        with torch.autocast("cuda", dtype=torch.bfloat16):
            patched = model(**batch).logits.double()
            own = untouched(**batch).logits.double()
    assert_as_close_as_own(patched, own, expected, "bf16 autocast logits", factor=2.0)
