"""The recipes' val_bleu decoded through the pipeline's ring equals today's one-process greedy decoding, token for
token: on one device through ``lightning_pipedream.generate``, and on 2 and 3 stages (ranks as threads under the
model of NCCL's rules) with the GNMT and S2VT layers split, 1 lane and one per stage, some rows ending early. The ring
feeds each stage one word per step after a lane's first (the stage keeps its own LSTMs' states per lane); the same for
the AWD-LSTM language model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution.decode import generate_ids
from lightning_pipedream.testing.nccl_model import PointToPointModel
from recipes.models import build_model
from recipes.tasks.seq2seq import Seq2SeqTask, greedy_decode

BOS, EOS, PAD = 2, 3, 0
ITOS = ["<pad>", "<unk>", "<bos>", "<eos>"] + [f"w{i}" for i in range(7)]


def model(name: str) -> nn.Sequential:
    torch.manual_seed(0)
    sizes = {"gnmt8": {"src_vocab_size": 11, "tgt_vocab_size": 11}, "s2vt": {"feature_size": 12, "vocab_size": 11}}
    layers = build_model(name, "translation" if name == "gnmt8" else "video_captioning", hidden_size=8, dropout=0.0,
                         **sizes[name]).eval()
    with torch.no_grad():  # weights spread wide enough that rows differ, and EOS favoured: some rows end early
        for p in layers.parameters():
            p.normal_(0, 1)
        [m for m in layers[-1].modules() if isinstance(m, nn.Linear)][-1].bias[EOS] += {"gnmt8": 1.6, "s2vt": 2.0}[name]
    return layers


def sources(name: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    return (torch.randint(4, 11, (5, 6), generator=g),) if name == "gnmt8" else (torch.randn(5, 4, 12, generator=g),)


class HeldOut:
    def __init__(self, name: str) -> None:
        src = sources(name)
        target = torch.randint(4, 11, (5, 5), generator=torch.Generator().manual_seed(3))
        self.batches = [(*src, target, target)]

    def val_dataloader(self):
        return self.batches


@pytest.mark.parametrize("name", ["gnmt8", "s2vt"])
def test_pipelined_bleu_decodes_the_same_words_on_one_device(name):
    task = Seq2SeqTask(model(name), {}, ITOS)
    data = HeldOut(name)
    whole = task.held_out_metric(copy.deepcopy(task.layers), data)
    want = task.last_hypotheses
    for lanes in (1, 2):
        assert task.pipelined_held_out_metric(data, micro_batches=lanes) == whole
        assert task.last_hypotheses == want


@pytest.mark.parametrize("name", ["gnmt8", "s2vt"])
@pytest.mark.parametrize("stages", [2, 3])
def test_the_ring_decodes_the_recipes_models_as_one_process_does(name, stages):
    layers, src = model(name), sources(name)
    with torch.no_grad():
        want = greedy_decode(layers, src, BOS, EOS, max_len=8, pad=PAD)
    first_ended = want[:, 0] == EOS
    assert want.shape[1] > 3 and first_ended.any() and not first_ended.all(), want  # some rows end early, some go on
    prompt = torch.full((5, 1), BOS)
    for lanes in (1, stages):
        net = PointToPointModel(stages, watchdog_s=30)

        def rank_main(rank: int, lanes: int = lanes):
            mine = copy.deepcopy(layers)
            fed: list[int] = []

            def call(ids, mask, positions, cache, rows):
                fed.append(ids.shape[1])
                return mine((*(s[rows] for s in src), ids))

            transport = Transport(kind="directional", reverse_group="reverse")
            slices: list = []
            ids = generate_ids(mine, call, prompt, None, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD,
                               micro_batches=lanes, stage=rank, num_stages=stages, transport=transport, blocks=mine,
                               slices=slices)
            this = slices[0]
            own = {m for block in list(mine)[this.start:this.stop] for m in block.modules() if isinstance(m, nn.LSTM)}
            return ids, fed, this.uses_cache, set(this.state_bytes()), own

        for rank, (got, fed, cached, kept, own) in enumerate(net.run(rank_main, timeout=120)):
            assert torch.equal(got[:, 1:], want), f"rank {rank}, {lanes} lanes"
            assert cached and len(fed) > lanes and set(fed) == {1}, fed  # one word per step, never the prefix
            assert kept == own, f"rank {rank} keeps states of its own LSTMs only"


@pytest.mark.parametrize("stages", [2, 3])
def test_the_ring_decodes_the_language_model_carrying_its_states(stages):
    """AWD-LSTM (3 weight-dropped LSTMs): one token fed per step, each rank keeping its own LSTMs' states, the same
    tokens as recomputing the prefix on one device."""
    torch.manual_seed(0)
    layers = build_model("awd_lstm", "language_model", vocab_size=11, embedding_size=8, hidden_size=8, dropoute=0.0,
                         dropouti=0.0, dropouth=0.0, dropout=0.0, wdrop=0.0).eval()
    with torch.no_grad():
        for p in layers.parameters():
            p.normal_(0, 1)
    prompt = torch.randint(4, 11, (5, 3), generator=torch.Generator().manual_seed(4))
    words = prompt
    with torch.no_grad():
        for _ in range(6):
            words = torch.cat([words, layers(words)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert len({tuple(r) for r in words[:, 3:].tolist()}) > 1  # not one answer for every prompt
    for lanes in (1, stages):
        def rank_main(rank: int, lanes: int = lanes):
            mine = copy.deepcopy(layers)
            fed: list[int] = []

            def call(ids, mask, positions, cache, rows):
                fed.append(ids.shape[1])
                return mine(ids)

            got = generate_ids(mine, call, prompt, None, max_new_tokens=6, eos_token_id=None, pad_token_id=PAD,
                               micro_batches=lanes, stage=rank, num_stages=stages, blocks=mine,
                               transport=Transport(kind="directional", reverse_group="reverse"))
            return got, fed

        for rank, (got, fed) in enumerate(PointToPointModel(stages, watchdog_s=30).run(rank_main, timeout=120)):
            assert torch.equal(got, words), f"rank {rank}, {lanes} lanes"
            assert fed == [3] * lanes + [1] * (len(fed) - lanes), fed  # the prompt, then one token per step
