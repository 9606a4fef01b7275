"""Sampling around the decode ring (``do_sample``, temperature, top-k, a generator seeded alike on every rank): on 2
and 3 stages (ranks as threads under the model of NCCL's rules) with 1 lane and one per stage, every rank returns
the tokens one device samples with the same seed; top_k=1 is the greedy decoding; the argument errors' wording."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipedream import generate
from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution.decode import generate_ids
from lightning_pipedream.testing.nccl_model import PointToPointModel

VOCAB, WIDTH, NEW, PAD = 24, 12, 6, 0


class Mix(nn.Module):
    """Each position adds the running mean of a projection of the positions up to it (depends on the prefix)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = torch.arange(1, x.shape[1] + 1).view(1, -1, 1)
        return x + torch.tanh(self.linear(x)).cumsum(1) / count


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), Mix(), Mix(), Mix(), nn.Linear(WIDTH, VOCAB)).eval()


def prompts() -> torch.Tensor:
    return torch.randint(1, VOCAB, (5, 4), generator=torch.Generator().manual_seed(1))


def sample(net: nn.Module, seed: int, lanes: int = 1, stage: int = 0, stages: int = 1, transport=None,
           **options) -> torch.Tensor:
    return generate_ids(net, lambda ids, mask, pos, cache, rows: net(ids), prompts(), None, max_new_tokens=NEW,
                        eos_token_id=1, pad_token_id=PAD, micro_batches=lanes, stage=stage, num_stages=stages,
                        transport=transport, blocks=net, do_sample=True,
                        generator=torch.Generator().manual_seed(seed), **options)


@pytest.mark.parametrize("stages", [2, 3])
def test_the_ring_samples_what_one_device_samples_with_the_same_seed(stages):
    net = model()
    options = {"temperature": 1.5, "top_k": 8}
    want = sample(net, 7, **options)
    assert not torch.equal(want, sample(net, 8, **options)), "another seed should sample other tokens"
    greedy = generate_ids(net, lambda ids, mask, pos, cache, rows: net(ids), prompts(), None, max_new_tokens=NEW,
                          eos_token_id=1, pad_token_id=PAD, micro_batches=1)
    assert not torch.equal(want, greedy), "sampling at temperature 1.5 should leave the argmax somewhere"
    assert torch.equal(sample(net, 7, top_k=1), greedy)  # the one likeliest token: greedy
    for lanes in (1, stages):
        def rank_main(rank: int, lanes: int = lanes):
            return sample(copy.deepcopy(net), 7, lanes, rank, stages,
                          Transport(kind="directional", reverse_group="reverse"), **options)

        for rank, got in enumerate(PointToPointModel(stages, watchdog_s=30).run(rank_main, timeout=120)):
            assert torch.equal(got, want), f"rank {rank}, {lanes} lanes"


def test_sampling_without_the_strategy_and_its_errors():
    net = model()
    ids = prompts()
    got = generate(net, ids, max_new_tokens=NEW, eos_token_id=1, pad_token_id=PAD, micro_batches=2, do_sample=True,
                   temperature=1.5, top_k=8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(got, sample(net, 7, temperature=1.5, top_k=8))
    with pytest.raises(ValueError, match=r"do_sample=True needs generator=torch.Generator\(\).manual_seed\(seed\), "
                                         "seeded alike on every rank"):
        generate(net, ids, max_new_tokens=2, pad_token_id=PAD, do_sample=True)
    with pytest.raises(ValueError, match="temperature must be a number > 0, got 0"):
        sample(net, 7, temperature=0)
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 1 or None \(every token\), got 0"):
        sample(net, 7, top_k=0)
