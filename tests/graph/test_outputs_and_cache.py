"""Capture of real users' models: output objects holding a cache, the capture and profile caches, steady split points.

Each check runs in a forked child, as in test_split.py (torch.export, then a backward, must not happen in the
pytest process that later forks the multi-process tests).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from graph_models import CausalLMOutput, HFStyleLM, make
from torch import nn

from lightning_pipedream.graph import GraphCaptureError, build_stages, capture, split_graph
from lightning_pipedream.graph.capture import clear_capture_cache
from lightning_pipedream.graph.split_points import choose_split_points, profile_graph
from lightning_pipedream.runtime.faults.launch import run_local

pytestmark = pytest.mark.multiprocess  # forks a child per check: not in the fast suite


def _call(rank, world, fn, args):
    return fn(*args)


def in_child(fn, *args):
    return run_local(_call, 1, fn, args, timeout=120)[0]


def test_an_output_dataclass_with_a_cache_travels_its_tensors():
    in_child(check_output_dataclass)


def check_output_dataclass():
    model, (ids,) = make("hf")
    labels = ids.roll(1, dims=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cap = capture(model, (ids,), {"labels": labels})
    # The cache cannot cross processes: dropped, with a warning that names it and the way to silence it.
    texts = [str(w.message) for w in caught]
    assert any("HFStyleLM's output holds a KeyValueCache at `output.past_key_values`, which is not a tensor and "
               "cannot travel between pipeline stages: PipeDreamStrategy drops it (it is None in the output your "
               "step gets)." in t and "pass use_cache=False to the model" in t for t in texts), texts
    stages = build_stages(copy.deepcopy(model), split_graph(cap, ["blocks.1", "blocks.2"]))
    value = ((ids,), {"labels": labels})
    for stage in stages:
        value = stage(value)
    want = model(ids, labels=labels)
    assert isinstance(value, CausalLMOutput) and value.past_key_values is None
    torch.testing.assert_close(value.logits, want.logits, rtol=0, atol=0)
    torch.testing.assert_close(value.loss, want.loss, rtol=0, atol=0)
    # With use_cache=False nothing is dropped and nothing is said.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture(model, (ids,), {"labels": labels, "use_cache": False})
    assert not [w for w in caught if "use_cache" in str(w.message)]


def test_a_second_capture_of_the_same_structure_comes_from_the_cache():
    in_child(check_capture_cache)


def check_capture_cache():
    clear_capture_cache()
    first, (ids,) = make("hf")
    cap = capture(first, (ids,), {"use_cache": False})
    assert not cap.cached and cap.capture_s > 0
    torch.manual_seed(5)
    second = HFStyleLM()  # the same structure, other weights
    again = capture(second, (ids,), {"use_cache": False})
    assert again.cached and again.capture_s == 0.0
    # The cached graph runs on the second model's own weights.
    stages = build_stages(second, split_graph(again, ["blocks.1"]))
    torch.testing.assert_close(stages[1](stages[0](((ids,), {"use_cache": False}))).logits,
                               second(ids, use_cache=False).logits, rtol=0, atol=0)
    # Another structure, mode or call is traced again.
    assert not capture(HFStyleLM(layers=2), (ids,), {"use_cache": False}).cached
    assert not capture(second.eval(), (ids,), {"use_cache": False}).cached
    assert not capture(second, (ids[:1],), {"use_cache": False}).cached
    # A setting the forward reads from a config object is part of the structure (Hugging Face models keep theirs so).
    configured = [Scaled(SimpleNamespace(scale=scale)) for scale in (2.0, 2.0, 3.0)]
    x = torch.randn(2, 4)
    assert [capture(m, (x,)).cached for m in configured] == [False, True, False]
    # The profile comes from the cache too: the same split points without timing anything.
    second.train()
    points, _ = choose_split_points(again, second, (ids,), {"use_cache": False}, 3)
    with mock.patch("lightning_pipedream.graph.split_points.profile_graph", side_effect=AssertionError("profiled")):
        assert choose_split_points(again, second, (ids,), {"use_cache": False}, 3)[0] == points


class Scaled(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.config.scale


def test_split_points_stay_put_under_timing_noise():
    in_child(check_steady_split_points)


def check_steady_split_points():
    model, args = make("gpt")
    cap = capture(model, args)
    measured = profile_graph(cap, model, args)
    # The layers, their edges and bytes as profiled; their times written here, alike for alike layers (in proportion
    # to their bytes): measured ones are a busy machine's delays as much as the layers' own work.
    written = dataclasses.replace(measured, layers=[
        dataclasses.replace(layer, forward_s=(layer.activation_bytes + layer.parameter_bytes) * 1e-9,
                            backward_s=2 * (layer.activation_bytes + layer.parameter_bytes) * 1e-9)
        for layer in measured.layers])
    rng = random.Random(0)
    chosen = set()
    for _ in range(8):  # every layer's times 20 % off, at random: the repeated blocks still cut alike
        noisy = dataclasses.replace(written, layers=[
            dataclasses.replace(layer, forward_s=layer.forward_s * rng.uniform(0.8, 1.2),
                                backward_s=layer.backward_s * rng.uniform(0.8, 1.2)) for layer in written.layers])
        chosen.add(tuple(choose_split_points(cap, model, args, None, 2, profile=noisy)[0]))
    assert chosen == {("blocks.2",)}  # between two blocks, not inside one


@dataclass(order=True)
class Pair:
    a: torch.Tensor
    b: torch.Tensor


class ComparesOutputs(nn.Module):
    """Compares two dataclasses, whose generated __lt__ (code made from a string) reads a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if Pair(h.sum(), x.sum()) < Pair(x.sum(), h.sum()):  # the user's line the error must name
            h = h * 2
        return h


def test_a_capture_error_names_the_users_line_not_generated_code():
    in_child(check_error_line)


def check_error_line():
    with pytest.raises(GraphCaptureError) as info:
        capture(ComparesOutputs(), (torch.randn(2, 4),))
    text = str(info.value)
    assert "<string>" not in text
    assert "test_outputs_and_cache.py:" in text and "in forward: if Pair(h.sum(), x.sum()) < Pair(" in text
