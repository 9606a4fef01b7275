"""generate()'s refusals say what was wrong and how to fix it (one process, no Trainer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipedream import generate
from lightning_pipedream.runtime.execution.decode import even_split, find_blocks


def lm() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8))


IDS = torch.ones(3, 2, dtype=torch.long)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": 2, "micro_batches": 4, "pad_token_id": 0}, r"micro_batches must be an integer in 1..3"),
    ({"max_new_tokens": 2}, r"generate\(\) needs pad_token_id \(or eos_token_id, used as the pad\)"),
])
def test_bad_arguments_are_refused_with_the_way_out(kwargs, words):
    with pytest.raises(ValueError, match=words):
        generate(lm(), IDS, **kwargs)


def test_a_model_without_blocks_and_too_few_blocks_are_refused():
    with pytest.raises(ValueError, match="has no nn.ModuleList or nn.Sequential of two or more blocks"):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="at least one block per stage: 2 blocks for 3 stages"):
        even_split(2, 3)
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, length\), got shape \(3,\)"):
        generate(lm(), torch.ones(3, dtype=torch.long), max_new_tokens=1, pad_token_id=0)


def test_without_the_strategy_a_sequential_decodes_greedily():
    model = lm()
    got = generate(model, IDS, max_new_tokens=3, pad_token_id=0)
    ids = IDS
    for _ in range(3):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, ids)


def test_a_module_with_parameters_on_the_meta_device_is_refused_on_one_device():
    with torch.device("meta"):
        model = lm()
    with pytest.raises(ValueError, match=r"generate\(\) on one device runs the whole module, but some of its tensors "
                                         r"are on the meta device .* Generate under the PipeDreamStrategy that built"):
        generate(model, IDS, max_new_tokens=1, pad_token_id=0)
