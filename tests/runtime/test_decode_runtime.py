"""Greedy decoding around the pipeline's ring, ranks as threads under the model of NCCL's rules: tiny Hugging Face
Llama and GPT-2 give exactly ``model.generate(do_sample=False)``'s tokens on 2 and 3 stages with ragged prompts, an
early end for some sequences and M in 1, P-1, P, P+1 lanes; each rank ran the actions of the validated ring; each
stage's cache holds its own layers only."""

from __future__ import annotations

import copy

import pytest
import torch
from graph_models import tiny_decoder
from torch import nn

from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution.decode import even_split, generate_ids
from lightning_pipedream.schedule.check import validate
from lightning_pipedream.schedule.generation import decode_ring
from lightning_pipedream.testing.nccl_model import PointToPointModel

pytest.importorskip("transformers")

PAD, PROMPT, NEW = 0, 7, 6




def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 64, (5, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of unequal lengths
    mask[2, :1] = 0
    mask[4, :5] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def hf_generate(model: nn.Module, ids, mask, eos: int) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          eos_token_id=eos)


def ring_generate(model: nn.Module, stages: int, lanes: int, ids, mask, eos: int):
    """Every rank's result, actions and cache bytes per layer."""
    net = PointToPointModel(stages, watchdog_s=30)

    def rank_main(rank: int):
        mine = copy.deepcopy(model)
        trace: list = []
        slices: list = []

        def call(i, a, pos, kw, rows):
            return mine(input_ids=i, attention_mask=a, position_ids=pos, **kw)

        transport = Transport(kind="directional", reverse_group="reverse")
        out = generate_ids(mine, call, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD,
                           micro_batches=lanes, stage=rank, num_stages=stages, transport=transport, trace=trace,
                           slices=slices)
        return out, trace, slices[0].cache_bytes()

    return net.run(rank_main, timeout=120)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("stages", [2, 3])
def test_the_ring_gives_hugging_faces_greedy_tokens(kind, stages):
    model = tiny_decoder(kind)
    ids, mask = prompts()
    plain = hf_generate(model, ids, mask, eos=63)  # 63: no sequence ends; then end some early on their 2nd token
    eos = int(plain[1, PROMPT + 1])
    want = hf_generate(model, ids, mask, eos=eos)
    assert (want[:, PROMPT:] == PAD).any(), "some sequence should end early"
    for lanes in sorted({1, stages - 1, stages, stages + 1}):
        results = ring_generate(model, stages, lanes, ids, mask, eos)
        traces = [trace for _, trace, _ in results]
        for rank, (out, _, cached) in enumerate(results):
            assert torch.equal(out, want), f"rank {rank}, {lanes} lanes: {out} != {want}"
            split = even_split(4, stages)
            own = range(sum(split[:rank]), sum(split[:rank + 1]))
            assert set(cached) == set(own), f"rank {rank} caches layers {sorted(cached)}, its own are {list(own)}"
        # what the ranks ran is the ring the validator checked, for the steps each lane made
        made = [sum(1 for a in traces[-1] if a.op.name == "FORWARD" and a.microbatch == m) for m in range(lanes)]
        ring = decode_ring(stages, lanes, made)
        validate(ring)
        assert [tuple(t) for t in traces] == list(ring.actions)


def test_one_device_decodes_the_same_without_a_transport():
    model = tiny_decoder("llama")
    ids, mask = prompts()
    want = hf_generate(model, ids, mask, eos=63)

    def call(i, a, pos, kw, rows):
        return model(input_ids=i, attention_mask=a, position_ids=pos, **kw)

    got = generate_ids(model, call, ids, mask, max_new_tokens=NEW, eos_token_id=63, pad_token_id=PAD, micro_batches=2)
    assert torch.equal(got, want)
