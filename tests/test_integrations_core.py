"""The patching machinery of relgen.integrations: what patch and unpatch do to a module tree, strict refusals,
one-time warnings and helper adapters; on a toy family registered here and on Hugging Face DeBERTa-v2."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import relgen.integrations as integrations
from relgen.integrations import _core


class ToyAttention(nn.Module):
    """Stands in for an attention module: its own forward is a projection, the patched one doubles it."""

    def __init__(self, width: int = 3):
        super().__init__()
        self.width = width
        self.proj = nn.Linear(max(width, 1), max(width, 1))

    def forward(self, x: torch.Tensor, *, fancy: bool = False) -> torch.Tensor:
        return self.proj(x)


class ToyHelper(nn.Module):
    """Stands in for a helper (DeBERTa's encoder): patched with its family, never named."""

    def __init__(self, refuse: bool = False):
        super().__init__()
        self.refuse = refuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _prepare(module: ToyAttention) -> str:
    if module.width == 0:
        raise integrations.Unsupported("width=0")
    return "state"


def _forward(module: ToyAttention, state: str, x: torch.Tensor, *, fancy: bool = False) -> torch.Tensor:
    assert state == "state"
    if fancy:
        return integrations.fall_back(module, "fancy=True", x, fancy=fancy)
    return 2 * module.proj(x)


def _prepare_helper(module: ToyHelper) -> None:
    if module.refuse:
        raise integrations.Unsupported("refuse=True")


def _helper_forward(module: ToyHelper, state: None, x: torch.Tensor) -> torch.Tensor:
    return _core.run_original(module, x) + 1


def _is(cls: type) -> Callable[[nn.Module], bool]:
    return lambda m: type(m) is cls


if not any(a.family == "toy_test" for a in _core.adapters()):  # registration is once per process
    integrations.register(integrations.Adapter("toy_test", _is(ToyAttention), _prepare, _forward))
    integrations.register(
        integrations.Adapter("toy_test_helper", _is(ToyHelper), _prepare_helper, _helper_forward, attention=False)
    )


class Toy(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (3, 3), helper: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(ToyAttention(w) for w in widths)
        self.helper = ToyHelper() if helper else None

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, **kwargs)
        return self.helper(x) if self.helper is not None else x


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_core, "_WARNED", set())


def _relgen_warnings(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if "relgen.integrations" in str(w.message)]


X = torch.randn(2, 3)


def test_a_model_with_nothing_supported_is_named():
    with pytest.raises(ValueError, match=r"Sequential holds no attention module relgen supports.*toy_test"):
        integrations.patch(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    with pytest.raises(ValueError, match=r"model: expected a torch\.nn\.Module, got str"):
        integrations.patch("model")
    # a helper is not an attention module: alone it is nothing supported
    with pytest.raises(ValueError, match="ToyHelper holds no attention module"):
        integrations.patch(ToyHelper())


def test_patch_swaps_forwards_in_place_and_unpatch_puts_them_back():
    model = Toy()
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    want = model(X)
    assert integrations.patch(model) == ["blocks.0", "blocks.1"]
    block0, block1 = model.blocks
    expected = 2 * block1.proj(2 * block0.proj(X))
    assert torch.equal(model(X), expected)
    assert dict(model.named_parameters()) == parameters and list(model.state_dict()) == keys
    assert integrations.unpatch(model) == ["blocks.0", "blocks.1"]
    assert not any("forward" in m.__dict__ or _core.is_patched(m) for m in model.modules())
    assert torch.equal(model(X), want)
    assert integrations.unpatch(model) == []


def test_patch_is_idempotent():
    model = Toy()
    first = integrations.patch(model)
    originals = [m.__dict__[_core._ORIGINAL] for m in model.blocks]
    assert integrations.patch(model) == first
    # a second patch wraps nothing again: the stored originals are still the class's own forwards
    assert [m.__dict__[_core._ORIGINAL] for m in model.blocks] == originals
    assert all(o.__func__ is ToyAttention.forward for o in originals)
    integrations.unpatch(model)
    assert not any(_core.is_patched(m) for m in model.modules())


def test_a_patched_module_can_be_patched_as_a_subtree():
    model = Toy()
    assert integrations.patch(model.blocks[1]) == ["ToyAttention"]  # the root itself: named by its class
    assert integrations.patch(model) == ["blocks.0", "blocks.1"]


def test_strict_raises_naming_the_module_and_option_and_patches_nothing():
    model = Toy(widths=(3, 0, 3))
    with pytest.raises(ValueError, match=r"blocks\.1 \(ToyAttention\): relgen cannot serve width=0"):
        integrations.patch(model, strict=True)
    assert not any(_core.is_patched(m) for m in model.modules())  # blocks.0, patched before, was undone


def test_refused_modules_stay_on_their_own_code_named_in_one_warning():
    model = Toy(widths=(3, 0, 0))
    names, messages = _relgen_warnings(lambda: integrations.patch(model))
    assert names == ["blocks.0"]
    assert len(messages) == 1 and "blocks.1 (width=0)" in messages[0] and "blocks.2 (width=0)" in messages[0]
    assert not _core.is_patched(model.blocks[1])
    # all refused: a warning, no error (the model holds supported families, in configurations relgen refuses)
    names, messages = _relgen_warnings(lambda: integrations.patch(Toy(widths=(0,))))
    assert names == [] and len(messages) == 1


def test_fall_back_runs_the_original_forward_and_warns_once_per_feature():
    model = Toy(widths=(3,))
    want = model(X, fancy=True)
    integrations.patch(model)
    seen = []
    for _ in range(3):
        got, messages = _relgen_warnings(lambda: model(X, fancy=True))
        assert torch.equal(got, want)
        seen.append(messages)
    assert [len(m) for m in seen] == [1, 0, 0] and "(toy_test): fancy=True is not served" in seen[0][0]
    _, messages = _relgen_warnings(lambda: integrations.fall_back(model.blocks[0], "another feature", X))
    assert len(messages) == 1 and "another feature" in messages[0] and "(toy_test)" in messages[0]
    with pytest.raises(RuntimeError, match="not patched"):
        integrations.fall_back(ToyAttention(), "fancy=True", X)


def test_helpers_are_patched_but_not_named_and_refuse_silently():
    model = Toy(helper=True)
    want = model(X)
    assert integrations.patch(model) == ["blocks.0", "blocks.1"]
    assert _core.is_patched(model.helper)
    block0, block1 = model.blocks
    assert torch.equal(model(X), 2 * block1.proj(2 * block0.proj(X)) + 1)
    assert integrations.unpatch(model) == ["blocks.0", "blocks.1"]
    assert not _core.is_patched(model.helper) and torch.equal(model(X), want)
    refusing = Toy(helper=True)
    refusing.helper.refuse = True
    names, messages = _relgen_warnings(lambda: integrations.patch(refusing, strict=True))
    assert names == ["blocks.0", "blocks.1"] and messages == [] and not _core.is_patched(refusing.helper)


def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own_parameters():
    model = Toy(widths=(3,))
    integrations.patch(model)
    clone = copy.deepcopy(model)
    assert _core.is_patched(clone.blocks[0])
    with torch.no_grad():
        clone.blocks[0].proj.weight.zero_()
        clone.blocks[0].proj.bias.fill_(1.0)
    assert torch.equal(clone(X), torch.full_like(X, 2.0))
    assert not torch.equal(model(X), clone(X))


def test_a_family_registers_once():
    with pytest.raises(ValueError, match="'toy_test' is already registered"):
        integrations.register(integrations.Adapter("toy_test", _is(ToyAttention), _prepare, _forward))


# ------------------------------------------------------------------------------------------------------------
# on a real library: Hugging Face DeBERTa-v2 (its attention modules named, its encoder a helper)
# ------------------------------------------------------------------------------------------------------------
def _deberta(**changes):
    transformers = pytest.importorskip("transformers")
    settings = dict(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=32,
        pos_att_type=["p2c", "c2p"],
    )
    settings.update(changes)
    torch.manual_seed(0)
    return transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(**settings)).eval()


def test_deberta_names_its_attention_modules_and_not_its_encoder():
    model = _deberta()
    keys = list(model.state_dict())
    names = [f"deberta.encoder.layer.{i}.attention.self" for i in range(2)]
    assert integrations.patch(model) == names
    assert integrations.patch(model) == names
    assert _core.is_patched(model.deberta.encoder) and list(model.state_dict()) == keys
    assert integrations.unpatch(model) == names
    assert not any(_core.is_patched(m) for m in model.modules())


def test_deberta_strict_names_the_option():
    model = _deberta(hidden_size=20)  # head dim 10
    with pytest.raises(ValueError, match=r"deberta\.encoder\.layer\.0\.attention\.self .*head_dim=10"):
        integrations.patch(model, strict=True)
    assert not any(_core.is_patched(m) for m in model.modules())
    with pytest.warns(UserWarning, match=r"layer\.1\.attention\.self \(head_dim=10"):
        assert integrations.patch(model) == []


def test_a_model_without_deberta_attention_is_refused_by_class():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    with pytest.raises(ValueError, match="BertModel holds no attention module relgen supports"):
        integrations.patch(transformers.BertModel(config))
