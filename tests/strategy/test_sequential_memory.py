"""The memory model's prediction for a module whose layers are one nn.Sequential (what
``pipeline/stage{k}/predicted_memory_mb`` logs beside the measured peak): from the profile the strategy keeps in
``plan.extra["profile"]``, compared with the model's terms worked out by hand; and the words where it cannot say, which
the graph path's prediction shares."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_pipedream.plan.partition import Plan, StagePlan
from lightning_pipedream.plan.profile import LayerProfile, Profile
from lightning_pipedream.strategy.setup.graph_path import predicted_memory
from lightning_pipedream.strategy.setup.options import PipelineOptions
from lightning_pipedream.strategy.setup.placement import Placement
from lightning_pipedream.strategy.setup.sequential_memory import sequential_predicted_memory

# Four layers (bytes per whole batch of 8): outputs 40000, 30000, 20000, 10000; parameters 1000 .. 4000; the batch
# itself 80000. Split 2 + 2. Unmeasured working sets: the model takes a layer's output and input as its backward's
# activation gradients, its parameters as its gradient temporaries and largest tensor.
OUTPUTS = [40_000, 30_000, 20_000, 10_000]
PARAMETERS = [1_000, 2_000, 3_000, 4_000]
INPUT = 80_000


def _plan() -> Plan:
    profile = Profile([LayerProfile(str(i), 1e-3, 2e-3, a, p) for i, (a, p) in enumerate(zip(OUTPUTS, PARAMETERS))],
                      batch_size=8, extra={"input_bytes": INPUT})
    return Plan([StagePlan(["0", "1"]), StagePlan(["2", "3"])], extra={"profile": profile.to_json()})


def _predict(schedule: str, chunks: int, optimizer: torch.optim.Optimizer | None = None, plan: Plan | None = None,
             carried: bool = False) -> list[dict] | None:
    optimizer = optimizer or torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    return sequential_predicted_memory(PipelineOptions(schedule=schedule, chunks=chunks),
                                       Placement.decide(schedule, 2, 0), plan or _plan(), None, [optimizer],
                                       torch.device("cpu"), carried)


def test_pipedream_prediction_is_the_models_terms_by_hand() -> None:
    first, last = _predict("pipedream", 1)
    # Stage 0: layers 0-1. Weights 3000, as many gradients, Adam's two buffers; PipeDream stashes one version per
    # minibatch in flight on it (2 stages - stage 0 = 2 minibatches: one stashed copy). Each minibatch keeps the batch
    # and both layers' outputs (80000 + 40000 + 30000).
    assert (first["parameters"], first["gradients"], first["optimizer_state"]) == (3000, 3000, 6000)
    assert (first["weight_versions"], first["stashed_weights"]) == (2, 3000)
    assert (first["held"], first["activations"]) == (2, 2 * 150_000)
    # The backward's working set: layer 0's output and input gradients (40000 + 80000), the largest of the stage's.
    assert first["backward_working"] == 120_000
    # At the update one minibatch is still in flight; Adam's per-tensor temporaries: 2 x the largest tensor (2000).
    assert (first["activations_at_update"], first["update_working"]) == (150_000, 4000)
    weights = 3000 + 3000 + 6000 + 3000
    assert first["predicted_peak_bytes"] == weights + max(300_000 + 120_000, 150_000 + 4000)
    # Stage 1: layers 2-3, one minibatch in flight, no stashed copy; it keeps its input (30000) and its layers'
    # outputs (20000 + 10000); working set: layer 2's output and input gradients (20000 + 30000).
    assert (last["weight_versions"], last["stashed_weights"], last["held"]) == (1, 0, 1)
    assert last["activations"] == 60_000 and last["backward_working"] == 50_000
    assert last["predicted_peak_bytes"] == 7000 * 4 + max(60_000 + 50_000, 2 * 4000)
    assert first["optimizer"] == last["optimizer"] == "adam"


def test_1f1b_prediction_is_the_models_terms_by_hand() -> None:
    # accumulate_grad_batches > 1 (gradients carried across steps): the model counts the gradients at every moment.
    first, last = _predict("1f1b", 2, carried=True)
    # Stage 0 holds 2 micro-batches (stages - stage) of half the batch each: 2 x 150000 / 2; no stashed weights.
    assert (first["held"], first["activations"], first["stashed_weights"]) == (2, 150_000, 0)
    # The working set per micro-batch (120000 / 2) and, with 2 micro-batches per update, the layer's gradients
    # computed before they are added into .grad (its parameters, 2000).
    assert first["backward_working"] == 60_000 + 2000
    assert first["predicted_peak_bytes"] == 3000 * 4 + 150_000 + 62_000
    assert (last["held"], last["activations"], last["backward_working"]) == (1, 30_000, 25_000 + 4000)
    assert last["predicted_peak_bytes"] == 7000 * 4 + 30_000 + 29_000
    # Without accumulation a step starts without gradients (the update set them to None): the same micro-batches in
    # flight, the gradients counted from the first backward on.
    fresh = _predict("1f1b", 2)
    assert [(m["held"], m["activations"]) for m in fresh] == [(2, 150_000), (1, 30_000)]
    assert all("activations_with_gradients" in m for m in fresh)


def test_the_planners_prediction_is_taken_as_it_is() -> None:
    plan = _plan()
    plan.extra["memory"] = [{"stage": 0, "predicted_peak_bytes": 123}, {"stage": 1, "predicted_peak_bytes": 456}]
    assert _predict("1f1b", 2, plan=plan) == plan.extra["memory"]


def test_no_prediction_said_in_words(caplog) -> None:
    caplog.set_level(logging.INFO, logger="lightning_pipedream.strategy")
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))])
    assert _predict("1f1b", 2, optimizer=lbfgs) is None
    assert "no memory prediction for the stages (The memory model does not know how much state LBFGS keeps" \
        in caplog.text
    caplog.clear()
    assert _predict("1f1b", 2, plan=Plan([StagePlan(["0", "1"]), StagePlan(["2", "3"])])) is None
    assert "no profile of the layers, so no activation sizes" in caplog.text
    assert "predicted_memory_mb is not logged" in caplog.text


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "2bw"])
def test_other_schedules_are_predicted(schedule: str) -> None:
    memory = _predict(schedule, 2)
    assert memory is not None and len(memory) == 2 and all(m["predicted_peak_bytes"] > 0 for m in memory)


class _TwoOptimizers(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())]


@pytest.mark.parametrize(("shard", "words"), [
    ("full", "(shard='full': the traced graph's stages are not sharded)"),
    (None, "(2 optimizers; the model counts the state of one)"),
])
def test_the_graph_paths_refusals_are_said_in_the_same_words_before_its_memory_profile(caplog, shard, words) -> None:
    caplog.set_level(logging.INFO, logger="lightning_pipedream.strategy")
    # No capture and no estimate: the refusals come before the (costly) memory profile would read them.
    memory = predicted_memory(PipelineOptions(schedule="1f1b", chunks=2, shard=shard), Placement.decide("1f1b", 2, 0),
                              _TwoOptimizers(), None, None, [1, 1], 2, torch.device("cpu"))
    assert memory is None
    assert f"PipeDreamStrategy: no memory prediction for the stages {words}; pipeline/stage{{k}}/predicted_memory_mb " \
        "is not logged." in caplog.text


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_on_a_gpu_the_prediction_counts_that_gpus_cublas_workspace(monkeypatch, capability) -> None:
    # Both paths' predictions come through predicted_stages: on CUDA it reads the device's compute capability (the
    # graph path once passed none, so every GPU was counted as a Hopper). No GPU here: the capability is stood in.
    from lightning_pipedream.plan.memory import cublas_workspace_bytes, predict_memory, stage_bytes
    from lightning_pipedream.strategy.setup.memory_prediction import predicted_stages

    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    sizes = stage_bytes(Profile.from_json(_plan().extra["profile"]), [2, 2], device="cuda")
    got = predicted_stages(sizes, PipelineOptions(schedule="1f1b", chunks=2), 2, "adam", None,
                           torch.device("cuda", 0), False)
    assert asked == [torch.device("cuda", 0)]
    want = predict_memory(sizes, "1f1b", 2, optimizer="adam", device="cuda", cuda_capability=capability)
    assert [m["predicted_peak_bytes"] for m in got] == [m.predicted_peak_bytes for m in want]
    other = predict_memory(sizes, "1f1b", 2, optimizer="adam", device="cuda",
                           cuda_capability=(8, 0) if capability == (9, 0) else (9, 0))
    assert cublas_workspace_bytes((8, 0)) != cublas_workspace_bytes((9, 0))
    assert [m.predicted_peak_bytes for m in other] != [m["predicted_peak_bytes"] for m in got]
