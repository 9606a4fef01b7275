"""A trace on the meta device of what Hugging Face's default forward makes: the empty keys and values of the
``DynamicCache`` it builds with ``use_cache`` on (tensor constants with no values to know) are made on the stages'
device, and the stages run the real weights as the model does; what a meta trace truly cannot know is refused in
words that name its cause (a filled cache: use_cache=False; a tensor made from Python data on the inputs' device; a
tensor attribute that is not a buffer).

Each check runs in a forked child, as in test_outputs_and_cache.py (torch.export, then a backward, must not happen in
the pytest process that later forks the multi-process tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from lightning_pipedream.graph import GraphCaptureError, build_stages, capture, split_graph
from lightning_pipedream.runtime.faults.launch import run_local

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess  # forks a child per check: not in the fast suite


def _call(rank, world, fn, args):
    return fn(*args)


def in_child(fn, *args):
    return run_local(_call, 1, fn, args, timeout=120)[0]


SMALL = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "max_position_embeddings": 32}
BUILDS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_key_value_heads=1)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, num_key_value_heads=1)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
}


@pytest.mark.parametrize("family", list(BUILDS))
def test_hugging_face_s_default_forward_traced_on_meta_runs_the_real_weights_as_the_model_does(family):
    in_child(check_default_forward, family)


def check_default_forward(family: str) -> None:
    torch.manual_seed(0)
    build = BUILDS[family]
    real, ids = build(), torch.randint(0, 64, (2, 8))
    assert real.config.use_cache  # as shipped
    with torch.device("meta"):
        meta = build()
    captured = capture(meta, (), {"input_ids": ids, "labels": ids}, on_meta=True)
    # The cache's keys and values start empty on the inputs' device: constants with no values, now on the CPU.
    made = [v for kind, name in captured.state.values() if kind == "constant"
            for v in [captured.constants[name]] if v.numel() == 0]
    assert made and all(v.device == torch.device("cpu") for v in made)
    assert [kind for _, kind in captured.dropped] == ["DynamicCache"]  # not a tensor: it does not travel
    stages = build_stages(real, split_graph(captured, ["model.layers.1" if family != "gpt2" else "transformer.h.1"]))
    out = stages[1](stages[0](((), {"input_ids": ids, "labels": ids})))
    want = real(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-6, atol=1e-6)
    assert out.past_key_values is None
    out.loss.backward()  # the graph trains: every weight the loss reads gets a gradient
    assert all(p.grad is not None for stage in stages for p in stage.parameters())


class SinkCache:
    """A cache that starts with a fixed key made from Python data on the inputs' device (not empty)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.keys = [torch.tensor([[0.5] * x.size(-1)], device=x.device)]

    def update(self, key: torch.Tensor) -> torch.Tensor:
        self.keys.append(key)
        return torch.cat([self.keys[0].expand(key.size(0), -1), key], 0)


@dataclass
class Output:
    logits: torch.Tensor
    past_key_values: SinkCache | None = None


class CachedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> Output:
        h = self.lin(x)
        if not use_cache:
            return Output(h)
        cache = SinkCache(h)
        return Output(cache.update(h).sum(0, keepdim=True) + h, cache)


class MadeFromData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)


class PlainAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.ones(4)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_what_a_meta_trace_cannot_know_is_refused_naming_its_cause():
    in_child(check_refusals)


def check_refusals() -> None:
    x = torch.randn(3, 4)

    def refusal(build, **kwargs) -> str:
        with torch.device("meta"):
            module = build()
        with pytest.raises(GraphCaptureError) as info:
            capture(module, (x,), kwargs, on_meta=True)
        return str(info.value)

    assert refusal(CachedNet) == (
        "CachedNet.forward fills a SinkCache (at `output.past_key_values` in its output) with tensors "
        "['lifted_tensor_0'] whose values a trace on the meta device cannot know: a cache of past keys and values, "
        "which the forward keeps because use_cache is on. Training has no use for it: pass use_cache=False to the "
        "model's call (self.model(..., use_cache=False)) or set it in the model's config (config.use_cache = False) "
        "before building the model.")
    with torch.device("meta"):  # use_cache=False: nothing to know
        capture(CachedNet(), (x,), {"use_cache": False}, on_meta=True)
    assert refusal(MadeFromData) == (
        "MadeFromData.forward makes tensors ['lifted_tensor_0'] from Python data on the device of its inputs (such as "
        "torch.tensor([...], device=x.device)); on the meta device, where a model built in configure_model is "
        "traced, their values are lost. Make them on the CPU and move them, torch.tensor([...]).to(x.device), or "
        "register them as buffers (register_buffer, set in the module's __init__ or reset_parameters()); or build "
        "the model on a real device.")
    assert refusal(PlainAttribute) == (
        "PlainAttribute holds tensor attributes ['scale'] on the meta device that are neither parameters nor buffers, "
        "so no checkpoint or initialization gives them values and a trace on the meta device cannot know them. "
        "Register them as buffers (register_buffer, set in the module's reset_parameters()), or build the model on a "
        "real device.")
