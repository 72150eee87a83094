"""relgen.integrations on Hugging Face's speech conformers: Wav2Vec2-BERT (relative_key and relative),
SeamlessM4T-v2's speech encoder (relative_key) and Wav2Vec2-Conformer (relative), tiny random models built from
their config classes. The patched model in float32 is compared with the same model unpatched in float64."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import slow_values

import relgen
import relgen.integrations
from relgen.integrations import _core, hf_wav2vec2
from relgen.integrations.hf_wav2vec2 import _key_padding
from relgen.testing import check_close

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import create_bidirectional_mask  # noqa: E402
from transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2 import SeamlessM4Tv2SpeechEncoder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FRAMES = 20  # feature frames of the Wav2Vec2-BERT and SeamlessM4T-v2 inputs
SAMPLES = 90  # raw samples of the Wav2Vec2-Conformer input: 21 frames after its two stride-2 convolutions
TINY = {"hidden_size": 32, "intermediate_size": 64, "feature_projection_input_dim": 8, "conv_depthwise_kernel_size": 3}
# left/right windows shorter than the input, so that clipping is exercised
WINDOWS = {"left_max_position_embeddings": 5, "right_max_position_embeddings": 3}


def bert(kind: str | None, attn: str = "sdpa", layers: int = 1, heads: int = 2, **extra) -> torch.nn.Module:
    options = dict(
        TINY,
        **WINDOWS,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        position_embeddings_type=kind,
        max_source_positions=64,
        layerdrop=0.0,
        mask_time_prob=0.0,
        attn_implementation=attn,
    )
    config = transformers.Wav2Vec2BertConfig(**{**options, **extra})
    return transformers.Wav2Vec2BertModel(config).eval()


def seamless(attn: str = "sdpa", chunk: int = 20000) -> torch.nn.Module:
    config = transformers.SeamlessM4Tv2Config(
        **TINY,
        **WINDOWS,
        speech_encoder_layers=1,
        speech_encoder_attention_heads=2,
        speech_encoder_intermediate_size=64,
        add_adapter=False,
        speech_encoder_layerdrop=0.0,
        speech_encoder_chunk_size=chunk,
        attn_implementation=attn,
    )
    return SeamlessM4Tv2SpeechEncoder(config).eval()


def conformer(kind: str = "relative", attn: str = "sdpa") -> torch.nn.Module:
    config = transformers.Wav2Vec2ConformerConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        conv_dim=(8, 8),
        conv_stride=(2, 2),
        conv_kernel=(3, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        conv_depthwise_kernel_size=3,
        position_embeddings_type=kind,
        max_source_positions=64,
        layerdrop=0.0,
        mask_time_prob=0.0,
        attn_implementation=attn,
    )
    return transformers.Wav2Vec2ConformerModel(config).eval()


def inputs(model: torch.nn.Module, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 2 with padding: the first sequence padded on the left, the second on the right (Wav2Vec2-Conformer
    turns its raw-sample mask into frames itself, right-padded)."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, transformers.Wav2Vec2ConformerModel):
        mask = torch.ones(2, SAMPLES, dtype=torch.long)
        mask[1, 60:] = 0
        return torch.randn(2, SAMPLES, generator=generator), mask
    mask = torch.ones(2, FRAMES, dtype=torch.long)
    mask[0, :6] = 0
    mask[1, 14:] = 0
    return torch.randn(2, FRAMES, 8, generator=generator), mask


def unpatched_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A never-patched model of the same config holding `model`'s parameters (a checkpoint's round trip)."""
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    return clone


def relgen_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "relgen.integrations" in str(w.message)]


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Fall-back warnings come once per process and feature; each test starts without any given."""
    _core._WARNED.clear()
    yield
    _core._WARNED.clear()


CASES = {
    "wav2vec2_bert-relative_key": lambda: bert("relative_key", layers=2),
    "wav2vec2_bert-relative": lambda: bert("relative", attn="eager"),
    "seamless_m4t_v2-relative_key": lambda: seamless(),
    "wav2vec2_conformer-relative": lambda: conformer(attn="eager"),
}


@pytest.mark.parametrize("case", slow_values(CASES, fast=["seamless_m4t_v2-relative_key"]))
def test_patched_model_matches_the_model_in_float64(case):
    """Every output row (padded ones too) and every parameter's gradient, within fp32 rounding."""
    torch.manual_seed(0)
    model = CASES[case]()
    reference = unpatched_copy(model).double()
    names = relgen.integrations.patch(model)
    layers = len(model.encoder.layers)
    assert names == [f"encoder.layers.{i}.self_attn" for i in range(layers)]

    x, mask = inputs(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(x, attention_mask=mask).last_hidden_state
    assert relgen_warnings(caught) == [], "the call fell back to the model's own code"
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    expected = reference(x.double(), attention_mask=mask).last_hidden_state
    (expected * weights.double()).sum().backward()

    failures = []
    ok, message = check_close(out, expected, torch.float32, "output")
    failures += [] if ok else [message]
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is not None:
            ok, message = check_close(p.grad, r.grad, torch.float32, name)
            failures += [] if ok else [message]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("make", [lambda: bert("relative"), seamless, conformer], ids=["bert", "seamless", "conformer"])
def test_unpatch_and_checkpoints(make):
    """state_dict keys stay the model's own, a checkpoint saved while patched loads into an unpatched model, and
    unpatch restores the model's own outputs bit for bit."""
    torch.manual_seed(0)
    model = make()
    x, mask = inputs(model)
    with torch.no_grad():
        before = model(x, attention_mask=mask).last_hidden_state
    keys = list(model.state_dict())
    names = relgen.integrations.patch(model)
    assert list(model.state_dict()) == keys
    loaded = unpatched_copy(model)
    assert relgen.integrations.unpatch(model) == names
    with torch.no_grad():
        assert torch.equal(model(x, attention_mask=mask).last_hidden_state, before)
        assert torch.equal(loaded(x, attention_mask=mask).last_hidden_state, before)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_output_attentions_falls_back_once():
    """By keyword and by config (which reaches the layers only through the output hooks): the model's own
    attention weights and outputs, one warning."""
    torch.manual_seed(0)
    model = bert("relative_key", attn="eager")
    own = unpatched_copy(model)
    relgen.integrations.patch(model)
    x, mask = inputs(model)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [model(x, attention_mask=mask, output_attentions=True) for _ in range(2)]
        model.config.output_attentions = own.config.output_attentions = True
        got.append(model(x, attention_mask=mask))
        expected = own(x, attention_mask=mask)
    messages = relgen_warnings(caught)
    assert len(messages) == 1 and "output_attentions" in messages[0], messages
    for out in got:
        assert len(out.attentions) == 1
        assert torch.equal(out.attentions[0], expected.attentions[0])
        assert torch.equal(out.last_hidden_state, expected.last_hidden_state)


def test_float64_call_falls_back():
    torch.manual_seed(0)
    model = conformer()
    own = unpatched_copy(model).double()
    relgen.integrations.patch(model)
    model.double()
    x, mask = inputs(model)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"torch\.float64 inputs is not served"):
        out = model(x.double(), attention_mask=mask).last_hidden_state
    with torch.no_grad():
        assert torch.equal(out, own(x.double(), attention_mask=mask).last_hidden_state)


def test_seamless_chunk_attention_falls_back():
    """Chunks shorter than the input restrict the keys per query: not a padding mask."""
    torch.manual_seed(0)
    model = seamless(chunk=8)
    own = unpatched_copy(model)
    relgen.integrations.patch(model)
    x, mask = inputs(model)
    with torch.no_grad(), pytest.warns(UserWarning, match="not a padding mask"):
        out = model(x, attention_mask=mask).last_hidden_state
    with torch.no_grad():
        assert torch.equal(out, own(x, attention_mask=mask).last_hidden_state)


def test_unsupported_head_dim():
    """hidden 40 over 2 heads: head dim 20, not a multiple of 8. strict=True raises naming the option; otherwise the
    module stays on its own code, named in one warning."""
    with pytest.raises(ValueError, match=r"encoder\.layers\.0\.self_attn \(Wav2Vec2BertSelfAttention\).*head_dim=20"):
        relgen.integrations.patch(bert("relative_key", hidden_size=40), strict=True)
    model = bert("relative_key", hidden_size=40)
    with pytest.warns(UserWarning, match=r"left on the model's own code: encoder\.layers\.0\.self_attn \(head_dim=20"):
        assert relgen.integrations.patch(model) == []
    assert not _core.is_patched(model.encoder.layers[0].self_attn)


@pytest.mark.parametrize(
    "make",
    [lambda: bert("rotary"), lambda: bert(None), lambda: conformer("rotary")],
    ids=["bert-rotary", "bert-none", "conformer-rotary"],
)
def test_no_relative_term_is_not_supported(make):
    model = make()
    with pytest.raises(ValueError, match=rf"^model: {type(model).__name__} holds no attention module relgen supports"):
        relgen.integrations.patch(model)


def test_adapter_attention_is_left_alone():
    """Wav2Vec2-BERT's adapter layers attend without position embeddings."""
    model = bert("relative_key", add_adapter=True, num_adapter_layers=1, output_hidden_size=32)
    assert relgen.integrations.patch(model) == ["encoder.layers.0.self_attn"]
    assert not _core.is_patched(model.adapter.layers[0].self_attn)


def test_relative_runs_the_shipped_txl_uv_spec():
    """specs/txl_uv.yaml documents the form the relative layers run."""
    shipped, used = relgen.load_spec(ROOT / "specs/txl_uv.yaml"), relgen.load_spec(hf_wav2vec2._TXL_UV)
    for field in ("terms", "map", "scale", "causal", "heads_share_tables"):
        assert getattr(used, field) == getattr(shipped, field), field


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 9),
    attn=st.sampled_from(["sdpa", "eager"]),
    data=st.data(),
)
def test_key_padding_of_the_models_masks(batch, length, attn, data):
    """The [B, N] mask is recovered from the 4-D mask a model builds from it, whatever the padding; masks that are
    not padding are refused."""
    rows = data.draw(
        st.lists(st.lists(st.booleans(), min_size=length, max_size=length), min_size=batch, max_size=batch)
    )
    padding = torch.tensor(rows, dtype=torch.bool).reshape(batch, length)
    config = transformers.Wav2Vec2BertConfig(attn_implementation=attn)
    embeds = torch.zeros(batch, length, 4)
    mask = create_bidirectional_mask(config=config, inputs_embeds=embeds, attention_mask=padding.long())
    got, feature = _key_padding(mask, batch, length, attn)
    if padding.all():
        assert (got, feature) == (None, None)
        return
    if not padding.any(dim=1).all():
        assert got is None and feature == "a sequence with every frame padded"
        return
    assert feature is None and torch.equal(got, padding)
    if attn == "sdpa":
        assert mask.dtype == torch.bool
        # eager attention adds a boolean mask to the scores (SeamlessM4T-v2's chunk mask reaches it so)
        assert _key_padding(mask, batch, length, "eager")[1].startswith("a boolean attention mask under eager")
    else:
        assert _key_padding(mask + 0.5, batch, length, attn) == (None, "an additive float attention mask")
    if length > 1:  # one query row that differs from the others: not padding
        local = mask.clone()
        local[:, :, -1, 0] = mask[:, :, 0, 1]
        local[:, :, -1, 1] = mask[:, :, 0, 0]
        if not torch.equal(local, mask):
            assert _key_padding(local, batch, length, attn)[1].startswith("an attention mask that is not a padding")
    assert _key_padding(mask, batch, length, "flash_attention_2") == (None, "attn_implementation='flash_attention_2'")
