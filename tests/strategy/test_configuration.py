"""Configuration errors are raised where the Trainer is built, before any process starts, and say how to fix them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.plan import LayerProfile, Profile, Topology, partition


def trainer(strategy: PipeDreamStrategy, devices: int) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False,
                     enable_checkpointing=False, enable_model_summary=False)


def saved_plan(tmp_path: Path, workers: int, replicas_allowed: bool = False) -> Path:
    profile = Profile([LayerProfile(f"{i}", 1.0, 2.0, 100, 1000) for i in range(6)])
    plan = partition(profile, Topology.flat(workers, 1e12), "pipedream", straight=not replicas_allowed)
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


@pytest.mark.parametrize(("make", "devices", "message"), [
    (lambda tmp: PipeDreamStrategy(schedule="1f1b", chunks=2, stages=3), 4,
     "PipeDreamStrategy(stages=3) runs on 4 processes: the processes must be a multiple of the stages"),
    (lambda tmp: PipeDreamStrategy(replicas=[2, 1]), 4,
     "replicas [2, 1] need 3 processes but the Trainer runs 4; set devices x num_nodes to 3, or change the replicas."),
    (lambda tmp: PipeDreamStrategy(schedule="2bw", chunks=2, replicas=[2, 1]), 3,
     "Stages with unequal replica counts ([2, 1]) run with schedule='pipedream', 'gpipe' or '1f1b'"),
    (lambda tmp: PipeDreamStrategy(replicas=[2, 1], on_divergence="flush"), 3,
     "on_divergence='flush' goes over to 1f1b, which does not run unequal stage replicas (1F1B-RR, replicas=[2, 1]). "
     "Drop on_divergence, or replicate whole pipelines (stages=)."),
    (lambda tmp: PipeDreamStrategy(replicas=[2, 1], minibatches_per_batch=4), 3,
     "PipeDreamStrategy(minibatches_per_batch=4) runs on a straight pipeline (or data-parallel copies of one); stages "
     "with unequal replicas [2, 1] (1F1B-RR) already cut each batch into one minibatch per input replica. Drop "
     "minibatches_per_batch, or use equal replicas."),
    (lambda tmp: PipeDreamStrategy(schedule="1f1b", shard="full"), 2,
     "PipeDreamStrategy(shard='full') shards each stage over its copies in data-parallel pipelines, but this run has 1 "
     "pipeline(s) of 2 stages. Run devices = stages x copies with stages= (e.g. stages=2 on 4 devices), or shard=None."),
    (lambda tmp: PipeDreamStrategy(plan=saved_plan(tmp, 3)), 2,
     "has 3 stages but the Trainer runs 2 processes. Make a plan for 2 workers, or set devices/num_nodes to give 3 "
     "processes."),
])
def test_placement_errors_come_when_the_trainer_is_built(tmp_path: Path, make, devices: int, message: str) -> None:
    strategy = make(tmp_path)
    with pytest.raises(ValueError) as err:
        trainer(strategy, devices)
    assert message in str(err.value)


def test_a_missing_plan_file_is_named_when_the_strategy_is_built(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError) as err:
        PipeDreamStrategy(plan=missing)
    assert str(err.value) == (
        f"PipeDreamStrategy(plan={str(missing)!r}): no such file. Write one with `python -m lightning_pipedream plan "
        f"--profile PROFILE.json --workers N --bandwidth B --straight --save {missing}`, or drop plan= to profile the "
        "model when training starts.")


@pytest.mark.parametrize(("text", "words"), [("", "is empty"), ("{not json", "is not valid JSON"),
                                             (json.dumps({"stages": "x"}), "stages")])
def test_a_malformed_plan_file_is_named_when_the_strategy_is_built(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=words) as err:
        PipeDreamStrategy(plan=path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("options", "message"), [
    ({"minibatches_per_batch": 0}, "minibatches_per_batch=0: give an integer >= 1, the minibatches (each with its own "
     "update) that schedule='pipedream' cuts each batch into."),
    ({"schedule": "1f1b", "chunks": 4, "minibatches_per_batch": 2},
     "minibatches_per_batch=2 cuts each batch into PipeDream minibatches, each with its own update: "
     "schedule='pipedream' only. schedule='1f1b' makes one update per batch; cut the batch into micro-batches with "
     "chunks= instead, or use schedule='pipedream'."),
    ({"schedule": "auto", "minibatches_per_batch": 2},
     "minibatches_per_batch=2 cuts each batch into PipeDream minibatches, each with its own update; schedule='auto' "
     "chooses the schedule (and how a batch is cut) when training starts. Name schedule='pipedream', or drop "
     "minibatches_per_batch."),
])
def test_minibatches_per_batch_is_pipedreams_and_positive(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        PipeDreamStrategy(**options)
    assert str(err.value) == message


def test_a_good_configuration_builds_without_starting_anything(tmp_path: Path) -> None:
    built = trainer(PipeDreamStrategy(plan=saved_plan(tmp_path, 2)), 2)
    assert built.strategy.plan is not None and len(built.strategy.plan.stages) == 2
    assert built.strategy.num_stages == 2


def test_an_unknown_transport_is_refused_when_the_strategy_is_built() -> None:
    with pytest.raises(ValueError, match=r"transport='tcp' is not a transport: use 'auto' .*'gloo' \(always "
                                         r"torch.distributed\), 'shm' or 'directional' \(torch.distributed, each "
                                         r"direction of a link on a group of its own: the path NCCL takes\)"):
        PipeDreamStrategy(schedule="1f1b", transport="tcp")
    assert PipeDreamStrategy(schedule="1f1b", transport="directional").options.transport == "directional"



@pytest.mark.parametrize(("options", "message"), [
    ({"schedule": "pipedream", "shard": "full"}, "shard='full' with schedule='pipedream': weight stashing keeps several "
                                                 "versions of every weight"),
    ({"schedule": "1f1b", "shard": "auto"}, "shard='auto' lets the planner weigh whole against sharded replicas, which "
                                            "it does under schedule='auto'; schedule='1f1b' is fixed. Use "
                                            "schedule='auto' (with memory_limit=), or choose shard='full', 'grad_op' "
                                            "or None yourself."),
    ({"schedule": "auto", "shard": "half"}, "shard='half' is not a choice: use None or 'none' (replicas keep whole "
                                            "copies), 'grad_op'"),
    ({"schedule": "1f1b", "replicas": [2, 1], "shard": "full"}, "it does not combine with unequal replicas= or "
                                                                "straight=False yet (equal replicas=[d] * stages"),
    ({"schedule": "1f1b", "shard": "half"}, "shard='half' is not a sharding mode"),
    ({"schedule": "zb-v", "shard": "full"}, "shard='full' does not combine with schedule='zb-v' yet (two model chunks "
                                            "per process in a V). Use schedule='zb-h1' or 'interleaved' with shard=, "
                                            "or shard=None."),
])
def test_what_sharding_cannot_run_is_refused_when_the_strategy_is_built(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PipeDreamStrategy(**options)


def test_the_planner_weighs_sharding_under_schedule_auto_and_equal_replicas_shard() -> None:
    """shard='auto' (or a mode) goes to the planner with schedule='auto'; equal replicas are data-parallel copies,
    which the planner's choice names (replicas=[2, 2], shard='grad_op')."""
    assert PipeDreamStrategy(schedule="auto", shard="auto", memory_limit=1e9).options.shard == "auto"
    assert PipeDreamStrategy(schedule="auto", shard="full").options.shard == "full"
    chosen = PipeDreamStrategy(schedule="1f1b", chunks=2, balance=[3, 2], replicas=[2, 2], shard="grad_op").options
    assert (chosen.replicas, chosen.shard) == ((2, 2), "grad_op")


def test_shard_auto_keeps_whole_replicas_over_layers_that_share_a_parameter() -> None:
    """The strategy does not shard tied parameters yet: the planner is not offered sharding over them."""
    from torch import nn

    from lightning_pipedream.strategy.setup.planning import shard_choice

    shared = nn.Linear(4, 4)
    assert shard_choice("auto", nn.Sequential(shared, nn.ReLU(), shared)) is None
    assert shard_choice("auto", nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) == "auto"
    assert shard_choice("full", nn.Sequential(shared, shared)) == "full"  # asked for by name: refused at setup


@pytest.mark.parametrize("shard", ["auto", "full", "grad_op"])
def test_schedule_auto_without_fitting_runs_whole_stages_one_per_process(shard: str) -> None:
    # validate/test/predict give the planner no training step to profile: an even 1f1b split, one stage per process,
    # which has no replicas to shard (shard= is dropped rather than refused by the layout check).
    import torch

    from lightning_pipedream.strategy.setup.stage_pipeline import Ranks, choose_automatically

    class Layers(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))

    options = PipeDreamStrategy(schedule="auto", shard=shard).options
    ranks = Ranks(0, 2, 2, 1, torch.device("cpu"), "gloo", None)
    chosen, plan = choose_automatically(options, ranks, None, Layers(), False, lambda batch: batch)  # type: ignore[arg-type]
    assert (chosen.schedule, chosen.shard, chosen.memory_limit, plan) == ("1f1b", None, None, None)


def test_every_option_reaches_its_field_by_name_and_is_documented_once(tmp_path: Path) -> None:
    # PipelineOptions is built from PipeDreamStrategy's arguments by name: each field has an argument of that name
    # (plan=, trace= for plan_path, trace_dir), with the same default, documented in the strategy's docstring.
    import dataclasses
    import inspect

    from lightning_pipedream.strategy.setup.options import ARGUMENT_OF, PipelineOptions

    parameters = inspect.signature(PipeDreamStrategy.__init__).parameters
    doc = PipeDreamStrategy.__doc__ or ""
    for field in dataclasses.fields(PipelineOptions):
        name = ARGUMENT_OF.get(field.name, field.name)
        assert name in parameters, f"PipelineOptions.{field.name} has no argument {name}="
        assert parameters[name].default == field.default, name
        entry = rf"^\s+(\w+, )*{name}(, \w+)*: "  # its own entry, or one entry naming several options
        assert re.search(entry, doc, flags=re.M), f"{name}= is not documented in PipeDreamStrategy"
    # Values far from their defaults arrive in the right fields, lists as tuples.
    strategy = PipeDreamStrategy(schedule="1f1b", chunks=4, balance=[3, 2], split_points=None, bandwidth=[1e9, 1e8],
                                 trace=str(tmp_path), check_finite=True, recompute=[True, False],
                                 divergence_factor=3.0, transport="gloo", pretrained_prefix="model.")
    options = strategy.options
    assert (options.schedule, options.chunks, options.balance, options.bandwidth, options.trace_dir) == (
        "1f1b", 4, (3, 2), (1e9, 1e8), str(tmp_path))
    assert (options.check_finite, options.recompute, options.divergence_factor, options.transport,
            options.pretrained_prefix) == (True, (True, False), 3.0, "gloo", "model.")


def test_a_balance_for_another_number_of_processes_after_a_torchrun_restart_says_to_plan_anew(monkeypatch):
    """Under torchrun, a restart may bring fewer (or more) processes: a fixed balance= then cannot hold, and the
    words say why and that an unset balance resumes on the new layout."""
    from torch import nn

    from lightning_pipedream.strategy.setup.options import PipelineOptions
    from lightning_pipedream.strategy.setup.planning import LayerPlanner

    planner = LayerPlanner(PipelineOptions(schedule="1f1b", balance=(4, 3)), None, None, None, True, None)
    layers = nn.Sequential(*[nn.Linear(2, 2) for _ in range(7)])
    assert planner.balance(layers, 2, None)[0] == [4, 3]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(ValueError, match=re.escape(
            "balance=[4, 3] lists 2 stages, but this start of the run has 1 process for the pipeline: torchrun "
            "started it on another number of processes (a restart with --nnodes MIN:MAX after nodes were lost or "
            "added, or the job started again with another --nproc-per-node). Checkpoints resume on any layout: "
            "leave balance= unset (and stages=, plan=) so that each start plans its own stages, or give a balance "
            "of 1 stage.")):
        planner.balance(layers, 1, None)
