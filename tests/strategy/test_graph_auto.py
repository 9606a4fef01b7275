"""schedule="auto" on the graph path, in one process: the planner's choice among what traced stages run (equal
replicas, no shards), and one straight pipeline where data-parallel pipelines would split tied weights. The Trainer
run that chooses and trains 2 pipelines of 2 stages is in test_meta_models.py."""

from __future__ import annotations

import pytest
import torch
from meta_trainer import MetaLM, TokenBatches

from lightning_pipedream.strategy.setup.graph_path import (
    auto_plan_graph,
    graph_auto_profile,
    plan_graph,
    refuse_ties_with_replicas,
)
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.placement import Placement


@pytest.mark.parametrize(("world", "layout"), [(4, {"stages": 2}), (3, {"replicas": [2, 1]})])
def test_weights_tied_across_stages_are_refused_beside_any_replicas(world, layout):
    """Data-parallel pipelines and unequal replicas (1F1B-RR) alike; one straight pipeline runs them."""
    refuse_ties_with_replicas({"model.embed.weight": [0, 1]}, Placement.decide("1f1b", world))  # straight: runs
    refuse_ties_with_replicas({}, Placement.decide("1f1b", world, **layout))  # no ties: runs
    with pytest.raises(ValueError) as err:
        refuse_ties_with_replicas({"model.embed.weight": [0, 1]}, Placement.decide("1f1b", world, **layout))
    assert str(err.value) == (
        "Parameters ['model.embed.weight'] are used on several stages (tied weights), which PipeDreamStrategy does not "
        "combine with data-parallel pipelines or replicated stages yet. Run one pipeline (stages = processes, no "
        "replicas=), or split points that keep each tied parameter's users in one stage.")


@pytest.mark.parametrize("shard", ["full", "grad_op"])
def test_sharded_replicas_are_refused_on_the_graph_path_with_the_way_out(shard):
    with pytest.raises(ValueError) as err:  # refused on every rank before rank 0 traces anything
        auto_plan_graph(PipelineOptions(schedule="auto", shard=shard), None, MetaLM("unused"), lambda b: b, 4, 1,
                        "sgd", torch.device("cpu"))
    assert str(err.value) == (
        f"PipeDreamStrategy(schedule='auto', shard={shard!r}): the traced graph's stages are not sharded yet, so MetaLM "
        "(not one nn.Sequential) cannot run sharded replicas. Drop shard= (or shard='auto': whole replicas), or put the "
        "layers in one nn.Sequential.")


def test_weights_tied_across_the_fastest_plan_s_stages_give_one_straight_pipeline(tmp_path):
    """The Llama of test_meta_models.py's auto run (there: zb-v on 2 stages x 2 pipelines) with its embedding tied to
    its head: zb-v's V puts both on rank 0 but in two model chunks, which data-parallel pipelines of a traced graph
    refuse, so the plan is one pipeline of 4 stages, and the log says why."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                             tie_word_embeddings=True).save_pretrained(tmp_path)
    module = MetaLM(str(tmp_path))
    with torch.device("meta"):
        module.configure_model()
    batch = next(iter(TokenBatches(128, 1, 4, 8)))
    captured, profile, on_meta = graph_auto_profile(module, batch, torch.device("cpu"), 4)
    assert on_meta
    options = PipelineOptions(schedule="auto", exact=True, memory_limit=400_000, bandwidth=1e11)
    arguments, chosen, described = plan_graph(options, module, captured, profile, 4, 1, "sgd", torch.device("cpu"))
    assert "stages" not in arguments and len(arguments["split_points"]) == 3  # 4 stages, one per process
    assert chosen.chosen.replicas == (1, 1, 1, 1)
    assert described.endswith(
        "one straight pipeline of 4 stages: the fastest plan, zb-v, 2 stages (2-2) x 2 chunks, 4 micro-batches, has "
        "parameters ['model.model.embed_tokens.weight'] on several stages (tied weights), which data-parallel "
        "pipelines of a traced graph do not take yet")
