"""relgen.integrations on Hugging Face DeBERTa-v2/v3: the patched model against the same model's own code in
float64 (outputs on every row, padded ones included, and every parameter's gradient), fall-backs, checkpoints."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from tiers import SLOW
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")
from transformers import DebertaV2Config, DebertaV2ForSequenceClassification, DebertaV2Model

import relgen.integrations as integrations
from relgen.integrations import _core
from relgen.testing import ZERO, assert_as_close_as_own, assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, LENGTH, VOCAB = 2, 24, 64
#: DeBERTa-v3's settings at a tiny size: 8 buckets (exact up to |δ| = 4, logarithmic beyond, as v3's 256 are)
V3 = dict(
    relative_attention=True,
    position_buckets=8,
    max_relative_positions=32,
    pos_att_type=["p2c", "c2p"],
    share_att_key=True,
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
)


def config(**changes) -> DebertaV2Config:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **V3,
    )
    settings.update(changes)
    return DebertaV2Config(**settings)


def build(cfg: DebertaV2Config, cls: type = DebertaV2Model, seed: int = 0) -> torch.nn.Module:
    """A random model whose attention scores are of order one (HF's init, std 0.02, makes every softmax almost
    uniform, which would hide a wrong relative term)."""
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attention.self" in name or "rel_embeddings" in name:
                p.normal_(0.0, 0.5 if p.dim() == 2 else 0.2)
    return model.to(DEVICE)


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a padding mask: right padding in row 0, left padding in row 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[0, LENGTH - 6 :] = 0
    mask[1, :5] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def hidden(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


def assert_matches_hf(model: torch.nn.Module, run, expect_names: list[str]) -> None:
    """`model` patched against its own float64 copy left unpatched: the output `run(model)` and every gradient of
    a random projection of it (every row counts, padded ones included)."""
    reference = copy.deepcopy(model).double()
    assert integrations.patch(model) == expect_names
    out, want = run(model), run(reference)
    assert out.dtype == torch.float32
    assert_close(out, want, torch.float32, "output")
    weight = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (out.double() * weight).sum().backward()
    (want * weight).sum().backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        assert (p.grad is None) == (expected[name] is None), name
        if expected[name] is None:
            continue
        if expected[name].abs().max() <= ZERO and name.endswith(".bias"):
            # a key bias shifts a whole row of scores, so its gradient cancels exactly: fp32 leaves a residue of
            # the size of the rounding of its weight's gradient, which sums the same terms
            scale = float(expected[name.removesuffix("bias") + "weight"].abs().max())
            assert float(p.grad.abs().max()) <= 1e-5 * scale, f"{name}: {float(p.grad.abs().max()):.3g}"
        else:
            assert_close(p.grad, expected[name], torch.float32, name)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Every test sees the one-time warnings anew (they are once per process)."""
    monkeypatch.setattr(_core, "_WARNED", set())


def layer_names(n: int) -> list[str]:
    return [f"encoder.layer.{i}.attention.self" for i in range(n)]


# ------------------------------------------------------------------------------------------------------------
# exact against HF
# ------------------------------------------------------------------------------------------------------------
def test_v3_log_buckets_match_hf():
    """Shared projections (key_proj → c2p, query_proj → p2c), both terms, log buckets, LayerNorm-ed embeddings."""
    ids, mask = inputs()
    assert_matches_hf(build(config()), lambda m: hidden(m, ids, mask), layer_names(1))


def test_separate_projections_clipped_rows_match_hf():
    """share_att_key=False (pos_key_proj), c2p only, unbucketed offsets clipped to [-8, 7] (position_buckets ≤ 0),
    no LayerNorm on the embeddings, absolute positions added, head dim 32."""
    cfg = config(
        hidden_size=64,
        share_att_key=False,
        pos_att_type=["c2p"],
        position_buckets=-1,
        max_relative_positions=8,
        norm_rel_ebd="none",
        position_biased_input=True,
    )
    ids, mask = inputs(3)
    assert_matches_hf(build(cfg, seed=4), lambda m: hidden(m, ids, mask), layer_names(1))


@SLOW
def test_p2c_only_two_layers_with_the_convolution_layer_match_hf():
    """share_att_key=False (pos_query_proj), p2c only, 4 buckets, and two layers reading one table with the
    encoder's convolution between them."""
    cfg = config(
        num_hidden_layers=2,
        share_att_key=False,
        pos_att_type=["p2c"],
        position_buckets=4,
        max_relative_positions=16,
        conv_kernel_size=3,
    )
    ids, mask = inputs(5)
    assert_matches_hf(build(cfg, seed=6), lambda m: hidden(m, ids, mask), layer_names(2))


def test_padded_rows_are_hf_uniform_rows():
    """A padded query's output is HF's uniform softmax over all keys, not what a key mask alone would give."""
    model = build(config())
    _, mask = inputs()
    attention = model.encoder.layer[0].attention.self
    states = torch.randn(BATCH, LENGTH, 32, device=DEVICE)
    rel = model.encoder.get_rel_embedding()
    want, _ = attention(states, model.encoder.get_attention_mask(mask), rel_embeddings=rel)
    integrations.patch(model)
    out, _ = attention(states, mask, rel_embeddings=rel)
    v = attention.value_proj(states)
    padded = ~mask.bool()
    assert_close(out[padded], v.mean(dim=1, keepdim=True).expand_as(v)[padded], torch.float32, "padded rows")
    assert_close(out, want, torch.float32, "all rows")


@SLOW
def test_sequence_classification_checkpoint_round_trip(tmp_path):
    """A patched classifier trains (loss, gradients, one AdamW step); its state_dict keys are the model's own and
    the saved checkpoint loads into an unpatched model that then computes the same logits."""
    cfg = config(num_labels=3)
    model = build(cfg, DebertaV2ForSequenceClassification)
    keys = list(model.state_dict().keys())
    ids, mask = inputs()
    labels = torch.tensor([0, 2], device=DEVICE)
    assert integrations.patch(model) == [f"deberta.{name}" for name in layer_names(1)]
    assert list(model.state_dict().keys()) == keys
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    optimizer.step()
    torch.save(model.state_dict(), tmp_path / "checkpoint.pt")
    fresh = build(cfg, DebertaV2ForSequenceClassification, seed=9)
    fresh.load_state_dict(torch.load(tmp_path / "checkpoint.pt"), strict=True)
    with torch.no_grad():
        assert_close(
            model(input_ids=ids, attention_mask=mask).logits,
            fresh(input_ids=ids, attention_mask=mask).logits,
            torch.float32,
            "logits",
        )


def test_unpatch_restores_the_models_own_bits():
    ids, mask = inputs()
    never = build(config())
    model = copy.deepcopy(never)
    integrations.patch(model)
    with torch.no_grad():
        hidden(model, ids, mask)
    assert integrations.unpatch(model) == layer_names(1)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(hidden(model, ids, mask), hidden(never, ids, mask))


@SLOW
def test_deep_copy_of_a_patched_model_runs_its_own_parameters():
    ids, mask = inputs()
    model = build(config())
    integrations.patch(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.encoder.layer[0].attention.self.value_proj.weight.mul_(2)
        assert not torch.equal(hidden(clone, ids, mask), hidden(model, ids, mask))
    assert _core.is_patched(clone.encoder.layer[0].attention.self) and _core.is_patched(clone.encoder)


@SLOW
def test_a_patched_model_compiles_whole():
    """torch.compile(fullgraph=True) traces the patched encoder and attention (relgen's custom ops inside, whose
    backward tests/test_compile.py covers) and gives the eager patched model's bits."""
    ids, mask = (t[:, :16] for t in inputs())
    model = build(config())
    integrations.patch(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(hidden(compiled, ids, mask), hidden(model, ids, mask))


class _Shapes(TorchDispatchMode):
    """Records every tensor an operator returns whose shape holds the sequence length twice (N×N)."""

    def __init__(self, length: int):
        super().__init__()
        self.length, self.square, self.ops = length, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and list(t.shape).count(self.length) >= 2:
                self.square.append(f"{func}: {list(t.shape)}")
        return out


@SLOW
def test_nothing_n_by_n_is_built():
    """Neither the encoder (mask, relative positions) nor the attention builds an N×N tensor, forward or backward;
    the model's own code does (so the probe can see one)."""
    ids, mask = inputs()
    model = build(config())
    with _Shapes(LENGTH) as probe, torch.no_grad():
        hidden(model, ids, mask)
    assert probe.square
    integrations.patch(model)
    with _Shapes(LENGTH) as probe:
        hidden(model, ids, mask).sum().backward()
    assert probe.ops > 100 and probe.square == []


class _Outputs(TorchDispatchMode):
    """Records (operator, shape) of every tensor an operator returns, forward and backward, except Triton's
    interpreter's own traffic: it moves each argument's storage as bytes (uint8 copies) and views it back (set_)."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and name != "set_" and t.dtype != torch.uint8:
                self.outputs.append((name, tuple(t.shape)))
        return out


#: operators that copy a tensor (Tensor.contiguous and reshape copy through clone, casts through _to_copy)
COPIES = {"clone", "copy_", "_to_copy", "cat", "stack", "index_select"}


@SLOW
def test_memory_is_linear_in_n_and_q_k_v_are_not_copied():
    """Past the length where the log buckets saturate (|δ| ≥ 16 here), no tensor of the patched forward and backward
    holds B·H·N² elements (the relation projections are [B·H·N, C], C bounded by the map), and no q, k, v or O of
    a layer, nor a gradient of one, is copied: the Linear outputs reach the kernels as [B, H, N, d] views of
    [B, N, H, d], and the gradients leave in that order (the padded rows' too). HF's own code does both, so the
    probe can see them."""
    batch, n, heads, head_dim = 2, 64, 2, 16
    ids = torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones(batch, n, dtype=torch.long, device=DEVICE)
    mask[0, n - 9 :] = 0  # padded queries: their rows and gradients take their own path
    qkv = {(batch, n, heads, head_dim), (batch, heads, n, head_dim), (batch, n, heads * head_dim)}
    qkv.add((batch * heads, n, head_dim))  # HF's [B·H, N, d]

    def probe(model: torch.nn.Module) -> tuple[list, list]:
        with _Outputs() as recorded:
            hidden(model, ids, mask).sum().backward()
        large = [(op, shape) for op, shape in recorded.outputs if math.prod(shape) >= batch * heads * n * n]
        copies = [(op, shape) for op, shape in recorded.outputs if op in COPIES and shape in qkv]
        return large, copies

    model = build(config(position_buckets=8, max_relative_positions=16))
    own_large, own_copies = probe(model)
    assert own_large and own_copies
    integrations.patch(model)
    assert probe(model) == ([], [])


# ------------------------------------------------------------------------------------------------------------
# training options
# ------------------------------------------------------------------------------------------------------------
@SLOW
def test_attention_dropout_runs_in_the_kernels_and_under_gradient_checkpointing():
    """In training, attention dropout is relgen's own (in-kernel) stream, its seed drawn from torch's generator: a
    step is reproducible from torch's seed, gradient checkpointing's recomputation draws the same mask (the same
    output and gradients), the output differs from eval mode's, and with p = 0 it is eval mode's again."""
    ids, mask = (t[:, :16] for t in inputs())  # shorter: the interpreter draws dropout slowly
    model = build(config(attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.0))
    integrations.patch(model)
    with torch.no_grad():
        expected = hidden(model, ids, mask)
    model.train()
    steps = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch.manual_seed(1)
        out = hidden(model, ids, mask)
        out.sum().backward()
        steps.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad()
    model.gradient_checkpointing_disable()
    (plain, plain_grads), (recomputed, recomputed_grads) = steps
    assert torch.equal(plain, recomputed) and plain_grads.keys() == recomputed_grads.keys()
    assert all(torch.equal(plain_grads[n], recomputed_grads[n]) for n in plain_grads)
    assert torch.isfinite(plain).all() and not torch.allclose(plain, expected)
    model.encoder.layer[0].attention.self.dropout.p = 0.0
    with torch.no_grad():
        assert_close(hidden(model, ids, mask), expected, torch.float32, "train mode, p = 0")


@SLOW
@pytest.mark.skipif(DEVICE == "cuda", reason="CPU autocast (the GPU test below covers CUDA autocast)")
def test_float16_autocast_on_the_cpu():
    """Under autocast the tables (projections of the fp32 embeddings) reach the kernels in q's dtype."""
    ids, mask = inputs()
    model = build(config())
    reference = copy.deepcopy(model).double()
    integrations.patch(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        out = hidden(model, ids, mask)
    with torch.no_grad():
        assert_close(out, hidden(reference, ids, mask), torch.float16, "fp16 autocast")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_on_the_gpu_is_as_close_as_hfs_own(dtype):
    """Under autocast every layer of the model rounds in `dtype`, not only attention: the patched model's output and
    gradients lie as close to the float64 model as HF's own run under the same autocast does."""
    ids, mask = inputs()
    model = build(config(num_hidden_layers=2, hidden_size=128, num_attention_heads=2))
    untouched = copy.deepcopy(model)
    reference = copy.deepcopy(model).double()
    integrations.patch(model)
    with torch.autocast("cuda", dtype=dtype):
        out, own = hidden(model, ids, mask), hidden(untouched, ids, mask)
    want = hidden(reference, ids, mask)
    assert_as_close_as_own(out, own, want, f"{dtype} autocast output")
    # a random projection: the plain sum of LayerNorm-ed rows would give gradients that cancel to rounding noise
    weight = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for result in (out, own, want):
        (result.double() * weight).sum().backward()
    # every parameter in the same order, one flat vector per model (a parameter without a gradient counts as zeros)
    grads = [
        torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten().double() for p in run.parameters()])
        for run in (model, untouched, reference)
    ]
    # the fused backward rounds in another order than eager's (HF's own error is not a bound on it op by op): under
    # fp16 autocast on the CPU its gradients drift 1.7x as far as HF's own, its outputs 1.1x; twice is the limit
    assert_as_close_as_own(*grads, f"{dtype} autocast gradients", factor=2.0)


# ------------------------------------------------------------------------------------------------------------
# fall-backs: the model's own code, one warning per feature
# ------------------------------------------------------------------------------------------------------------
def _patched_pair(**changes):
    never = build(config(**changes))
    model = copy.deepcopy(never)
    integrations.patch(model)
    return never, model


def _warnings_of(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if "relgen.integrations" in str(w.message)]


def test_output_attentions_falls_back_once(fresh_warnings):
    never, model = _patched_pair()
    ids, mask = inputs()
    with torch.no_grad():
        want = never(input_ids=ids, attention_mask=mask, output_attentions=True)
        for round_ in range(2):
            got, messages = _warnings_of(lambda: model(input_ids=ids, attention_mask=mask, output_attentions=True))
            assert len(messages) == (1 - round_) and all("output_attentions" in m for m in messages)
            assert torch.equal(got.last_hidden_state, want.last_hidden_state)
            assert all(torch.equal(a, b) for a, b in zip(got.attentions, want.attentions, strict=True))


def test_float64_falls_back(fresh_warnings):
    never, model = _patched_pair()
    never, model = never.double(), model.double()
    ids, mask = inputs()
    with torch.no_grad():
        got, messages = _warnings_of(lambda: hidden(model, ids, mask))
        assert len(messages) == 1 and "float64" in messages[0]
        assert torch.equal(got, hidden(never, ids, mask))


def test_encoder_arguments_that_fall_back(fresh_warnings):
    """A 3-D mask and an explicit relative_pos handed to the encoder run HF's code (named once each)."""
    never, model = _patched_pair()
    _, mask = inputs()
    states = torch.randn(BATCH, LENGTH, 32, device=DEVICE)
    square = mask[:, None, :] * mask[:, :, None]
    relative = torch.randint(-8, 8, (1, LENGTH, LENGTH), device=DEVICE)
    with torch.no_grad():
        for kwargs, feature in (({"attention_mask": square}, "N×N"), ({"relative_pos": relative}, "relative_pos")):
            kwargs.setdefault("attention_mask", mask)
            got, messages = _warnings_of(lambda kw=kwargs: model.encoder(states, **kw).last_hidden_state)
            assert len(messages) == 1 and feature in messages[0], messages
            assert torch.equal(got, never.encoder(states, **kwargs).last_hidden_state)


def test_query_states_and_an_unpatched_encoder_fall_back(fresh_warnings):
    never, model = _patched_pair()
    ids, mask = inputs()
    attention, own = model.encoder.layer[0].attention.self, never.encoder.layer[0].attention.self
    states, queries = (torch.randn(BATCH, LENGTH, 32, device=DEVICE) for _ in range(2))
    square = never.encoder.get_attention_mask(mask)
    rel = never.encoder.get_rel_embedding()
    with torch.no_grad():
        got, messages = _warnings_of(lambda: attention(states, square, query_states=queries, rel_embeddings=rel)[0])
        assert len(messages) == 1 and "query_states" in messages[0]
        assert torch.equal(got, own(states, square, query_states=queries, rel_embeddings=rel)[0])
        # a layer patched on its own receives HF's N×N mask from the encoder that was not patched with it
        layer_only = copy.deepcopy(never)
        assert integrations.patch(layer_only.encoder.layer[0]) == ["attention.self"]
        got, messages = _warnings_of(lambda: hidden(layer_only, ids, mask))
        assert len(messages) == 1 and "N×N attention_mask" in messages[0]
        assert torch.equal(got, hidden(never, ids, mask))


# ------------------------------------------------------------------------------------------------------------
# configurations relgen refuses
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({"hidden_size": 16}, "head_dim=8"),
        ({"relative_attention": False}, "relative_attention=False"),
        ({"pos_att_type": ["p2p"]}, "pos_att_type"),
        ({"position_buckets": 8, "max_relative_positions": 4}, "position_buckets=8"),
    ],
)
def test_unsupported_configurations(changes, option):
    never = build(config(**changes))
    model = copy.deepcopy(never)
    with pytest.raises(ValueError, match=f"encoder.layer.0.attention.self.*{option}"):
        integrations.patch(model, strict=True)
    assert not any(_core.is_patched(m) for m in model.modules())  # the encoder, patched before, is restored
    with pytest.warns(UserWarning, match=option):
        assert integrations.patch(model) == []
    ids, mask = inputs()
    with torch.no_grad():
        assert torch.equal(hidden(model, ids, mask), hidden(never, ids, mask))
