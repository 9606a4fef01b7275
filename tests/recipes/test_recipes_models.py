"""The recipe models keep the pipeline contract (one flat nn.Sequential, one-argument layers, no shared
parameters, no in-place ops) and have the paper architectures' structure."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch import nn

from recipes.models import MODELS, build_model  # noqa: E402
from recipes.models.awd_lstm import WeightDropLSTM  # noqa: E402
from recipes.models.gnmt import BahdanauAttention, DecoderLSTM, EncoderLSTM  # noqa: E402

SMALL = {
    "digits_cnn": ({"width": 4}, torch.randn(3, 1, 8, 8)),
    "vgg16": ({"num_classes": 10, "in_channels": 1, "image_size": 8}, torch.randn(2, 1, 8, 8)),
    "resnet50": ({"num_classes": 10, "in_channels": 3, "image_size": 32}, torch.randn(2, 3, 32, 32)),
    "alexnet": ({"num_classes": 10, "in_channels": 3, "image_size": 32}, torch.randn(2, 3, 32, 32)),
    "gnmt8": ({"src_vocab_size": 11, "tgt_vocab_size": 13, "hidden_size": 8}, (torch.randint(1, 11, (2, 5)), torch.randint(1, 13, (2, 4)))),
    "gnmt16": ({"src_vocab_size": 11, "tgt_vocab_size": 13, "hidden_size": 8, "num_layers": 8}, (torch.randint(1, 11, (2, 5)), torch.randint(1, 13, (2, 4)))),
    "awd_lstm": ({"vocab_size": 20, "embedding_size": 6, "hidden_size": 8}, torch.randint(0, 20, (2, 7))),
    "s2vt": ({"feature_size": 12, "vocab_size": 13, "hidden_size": 8}, (torch.randn(2, 6, 12), torch.randint(1, 13, (2, 4)))),
}
OUTPUT = {"digits_cnn": (3, 10), "vgg16": (2, 10), "resnet50": (2, 10), "alexnet": (2, 10), "gnmt8": (2, 4, 13),
          "gnmt16": (2, 4, 13), "awd_lstm": (2, 7, 20), "s2vt": (2, 4, 13)}


@cache
def small(name: str) -> nn.Sequential:
    torch.manual_seed(0)
    return build_model(name, MODELS[name][0], **SMALL[name][0])


@pytest.mark.parametrize("name", list(MODELS))
def test_model_is_a_partitionable_sequence(name: str) -> None:
    model, x = small(name), SMALL[name][1]
    assert isinstance(model, nn.Sequential) and len(model) >= 5
    owners: dict[int, int] = {}
    for index, layer in enumerate(model):
        for p in layer.parameters():
            assert owners.setdefault(id(p), index) == index, f"layers {owners[id(p)]} and {index} share a parameter"
        assert not any(getattr(m, "inplace", False) for m in layer.modules()), f"layer {index} works in place"
    model.train()
    out = x
    for layer in model:  # layer by layer, as the pipeline runs it: one argument in, one value out
        out = layer(out)
    assert tuple(out.shape) == OUTPUT[name]
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_gnmt_depths_and_residuals() -> None:
    for name, per_side in (("gnmt8", 4), ("gnmt16", 8)):
        model = build_model(name, "translation", src_vocab_size=5, tgt_vocab_size=5, hidden_size=4,
                            num_layers=per_side)
        encoders = [m for m in model if isinstance(m, EncoderLSTM)]
        decoders = [m for m in model if isinstance(m, DecoderLSTM)]
        assert len(encoders) == per_side and len(decoders) == per_side - 1  # + the attention decoder layer
        assert encoders[0].lstm.bidirectional and [e.residual for e in encoders[2:]] == [True] * (per_side - 2)
        assert [d.residual for d in decoders] == [False] + [True] * (per_side - 2)


def test_gnmt_attention_ignores_source_padding() -> None:
    torch.manual_seed(0)
    attention = BahdanauAttention(4)
    query, keys = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    other_keys = keys.clone()
    other_keys[0, 3:] = 100.0  # what sits under the padding must not matter
    assert torch.allclose(attention(query, keys, mask)[0], attention(query, other_keys, mask)[0])
    assert not torch.allclose(attention(query, keys, mask)[1], attention(query, keys, torch.ones_like(mask))[0])


def test_awd_lstm_drops_hidden_weights_only_in_training() -> None:
    torch.manual_seed(0)
    layer = WeightDropLSTM(4, 6, wdrop=0.5, dropout=0.0)
    x = torch.randn(2, 5, 4)
    layer.train()
    assert not torch.allclose(layer(x), layer(x))  # a fresh DropConnect mask each forward
    layer.eval()
    assert torch.allclose(layer(x), layer.lstm(x)[0])
    raw = layer.lstm.weight_hh_l0.detach().clone()
    layer.train()
    layer(x).sum().backward()
    assert layer.lstm.weight_hh_l0.grad is not None and torch.equal(layer.lstm.weight_hh_l0, raw)


def test_image_models_adapt_to_small_inputs() -> None:
    # VGG-16 has 5 max-pools; on 8 px only 3 fit (8 -> 4 -> 2 -> 1)
    assert sum(isinstance(layer, nn.MaxPool2d) for layer in small("vgg16")) == 3
    assert small("vgg16")[0].in_channels == 1
    # ResNet-50 and AlexNet below 64 px: a 3x3/1 stem and no early max-pool
    resnet, alexnet = small("resnet50"), small("alexnet")
    assert resnet[0].kernel_size == (3, 3) and resnet[0].stride == (1, 1) and isinstance(resnet[3], nn.Identity)
    assert alexnet[0].kernel_size == (3, 3) and sum(isinstance(layer, nn.MaxPool2d) for layer in alexnet) == 3


def test_unknown_model_and_model_of_another_task_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gnmt4'; choose one of: .*gnmt8"):
        build_model("gnmt4", "translation")
    with pytest.raises(ValueError, match=r"'s2vt' is a video_captioning model, but task=image; .*digits_cnn, vgg16"):
        build_model("s2vt", "image")
