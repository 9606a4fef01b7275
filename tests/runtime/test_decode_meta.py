"""Decoding a model built per stage on the meta device (ranks as threads under the model of NCCL's rules): each rank
holds real tensors only where the graph split of its training puts them (the rest stays on meta), decodes with the
blocks it holds, and gives exactly Hugging Face's ``generate(do_sample=False)`` tokens on 2 and 3 stages; no rank
materializes a parameter it does not hold; a split that cuts inside a block is refused, saying where to split."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from graph_models import tiny_decoder
from torch import nn

from lightning_pipedream.graph import capture, split_graph
from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution.decode import generate_ids, split_of_owners
from lightning_pipedream.testing.nccl_model import PointToPointModel

pytest.importorskip("transformers")

PAD, PROMPT, NEW = 0, 6, 5


class Wrapper(nn.Module):
    """A LightningModule's shape: the HF model under ``model``, keyword arguments passed on."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model(**kwargs)




BLOCKS = {"llama": "model.model.layers", "gpt2": "model.transformer.h"}


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 64, (5, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[4, :4] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def owners_of(kind: str, split_points: list[str]) -> dict[str, list[int]]:
    """Which stages hold each tensor (every name) when the meta-built model is split at ``split_points``: what
    PipeDreamStrategy's graph path computes (CapturedStage.owners)."""
    with torch.device("meta"):
        meta = Wrapper(type(tiny_decoder(kind))(tiny_decoder(kind).config))
    ids, _ = prompts()
    captured = capture(meta.eval(), (), {"input_ids": ids, "use_cache": False}, on_meta=True)
    split = split_graph(captured, split_points)
    return {alias: stages for name, stages in split.owners.items() for alias in captured.aliases.get(name, [name])}


def stage_of_model(whole: nn.Module, owners: dict[str, list[int]], stage: int) -> nn.Module:
    """``whole`` as stage ``stage`` holds it: real tensors where it holds them, the rest on the meta device (a tied
    parameter is one tensor: real if the stage holds it under any of its names)."""
    mine = copy.deepcopy(whole)
    held = {id(t) for n, t in itertools.chain(mine.named_parameters(remove_duplicate=False),
                                              mine.named_buffers(remove_duplicate=False))
            if stage in owners.get(n, [0])}
    for sub in mine.modules():
        for table in (sub._parameters, sub._buffers):
            for leaf, t in table.items():
                if t is not None and id(t) not in held:
                    table[leaf] = nn.Parameter(t.to("meta"), t.requires_grad) if isinstance(t, nn.Parameter) \
                        else t.to("meta")
    return mine


def real_parameter_bytes(model: nn.Module) -> dict[str, int]:
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters() if not p.is_meta}


@pytest.mark.parametrize(("kind", "points"), [
    ("llama", ["model.model.layers.2"]), ("gpt2", ["model.transformer.h.1", "model.transformer.h.3"]),
])
def test_a_model_built_per_stage_decodes_with_the_blocks_each_rank_holds(kind, points):
    whole = Wrapper(tiny_decoder(kind))
    ids, mask = prompts()
    plain = whole.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=PAD, eos_token_id=None)
    eos = int(plain[1, PROMPT + 1])  # sequence 1 ends on its second new token, the others go on
    want = whole.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                pad_token_id=PAD, eos_token_id=eos)
    assert not (want[:, PROMPT:] == PAD).all(1).any() and (want[1, PROMPT + 2:] == PAD).all()
    owners = owners_of(kind, points)
    stages = len(points) + 1
    split = split_of_owners(whole, owners, stages)
    assert split == ([2, 2] if kind == "llama" else [1, 2, 1])
    for lanes in (1, stages):
        net = PointToPointModel(stages, watchdog_s=30)

        def rank_main(rank: int):
            mine = stage_of_model(whole, owners, rank)
            before = real_parameter_bytes(mine)
            slices: list = []

            def call(i, a, pos, kw, rows):
                return mine(input_ids=i, attention_mask=a, position_ids=pos, **kw)

            out = generate_ids(mine, call, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD,
                               micro_batches=lanes, stage=rank, num_stages=stages, split=split,
                               transport=Transport(kind="directional", reverse_group="reverse"), slices=slices)
            metas = sorted(n for n, t in itertools.chain(mine.named_parameters(), mine.named_buffers()) if t.is_meta)
            return out, before, real_parameter_bytes(mine), slices[0].cache_bytes(), metas

        whole_bytes = sum(real_parameter_bytes(whole).values())
        for rank, (out, before, after, cached, metas) in enumerate(net.run(rank_main, timeout=120)):
            assert torch.equal(out, want), f"{kind}, rank {rank}, {lanes} lanes: {out} != {want}"
            assert after == before, f"rank {rank} materialized {set(after) - set(before)} while decoding"
            assert sum(after.values()) < whole_bytes * 0.8
            own = range(sum(split[:rank]), sum(split[:rank + 1]))
            assert set(cached) == set(own), f"rank {rank} caches layers {sorted(cached)}, its own are {list(own)}"
            if rank > 0 and kind == "llama":  # the rotary embedding's buffers went back to the meta device
                assert "model.model.rotary_emb.inv_freq" in metas


def test_a_sequential_built_per_stage_decodes_with_its_balance():
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 16))
    ids = torch.randint(0, 16, (3, 4), generator=torch.Generator().manual_seed(2))
    want = generate_ids(whole, lambda i, a, pos, kw, rows: whole(i), ids, None, max_new_tokens=4, eos_token_id=None,
                        pad_token_id=0, micro_batches=1)
    balance = [2, 3]
    owners = {f"{i}.{n}": [0 if i < 2 else 1] for i, layer in enumerate(whole) for n, _ in layer.named_parameters()}

    def rank_main(rank: int):
        mine = stage_of_model(whole, owners, rank)
        return generate_ids(mine, lambda i, a, pos, kw, rows: mine(i), ids, None, max_new_tokens=4, eos_token_id=None,
                            pad_token_id=0, micro_batches=2, stage=rank, num_stages=2, split=balance,
                            transport=Transport(kind="directional", reverse_group="reverse"))

    for rank, out in enumerate(PointToPointModel(2, watchdog_s=30).run(rank_main, timeout=60)):
        assert torch.equal(out, want), f"rank {rank}"


def test_a_split_inside_a_block_is_refused_with_block_boundaries_to_split_at():
    whole = Wrapper(tiny_decoder("llama"))
    owners = owners_of("llama", ["model.model.layers.1.mlp"])  # stage 1 begins at block 1's MLP
    with pytest.raises(ValueError, match=r"generate\(\) runs each stage's own blocks of Wrapper's model.model.layers "
                                         r"\(4 blocks\), the stages the model was split into for training, but that "
                                         r"split cuts inside block model.model.layers.1: stages \[0, 1\] each hold part "
                                         r"of it. Split the model at block boundaries, e.g. PipeDreamStrategy\("
                                         r"split_points=\['model.model.layers.1'\]\), so that each stage holds whole "
                                         r"blocks."):
        split_of_owners(whole, owners, 2)


def test_a_stage_without_a_whole_block_or_with_the_head_in_the_middle_is_refused():
    whole = Wrapper(tiny_decoder("llama"))
    layers = [n for n, _ in whole.named_parameters()]

    def owners(stage_of) -> dict[str, list[int]]:
        return {n: [stage_of(n)] for n in layers}

    def block(n: str) -> int:
        return int(n.split(".")[3]) if ".layers." in n else -1

    # 3 stages; the last holds only the final norm and the head
    with pytest.raises(ValueError, match=r"stage 2 holds no whole block \(blocks per stage: \[2, 2, 0\]\); each stage "
                                         r"needs at least one. Split the model at block boundaries, e.g. "
                                         r"PipeDreamStrategy\(split_points=\['model.model.layers.2', "
                                         r"'model.model.layers.3'\]\)"):
        split_of_owners(whole, owners(lambda n: 0 if 0 <= block(n) < 2 or "embed" in n else
                                      1 if block(n) >= 2 else 2), 3)
    # the final norm on the middle stage of 3
    with pytest.raises(ValueError, match=r"recomputes what lies outside .* on the first and last stages, but "
                                         r"model.model.norm.weight is held by stages \[1\]"):
        split_of_owners(whole, owners(lambda n: 1 if "norm.weight" in n and block(n) < 0 else
                                      0 if block(n) in (-1, 0) else 1 if block(n) in (1, 2) else 2), 3)
