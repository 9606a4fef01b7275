"""Split graphs trained by the standalone engine on 2 processes equal one process; tied copies stay identical."""

from __future__ import annotations

import copy

import pytest
import torch
from graph_models import batches, loss_fn, make, padded

from lightning_pipedream.graph import build_stages, capture, consolidate_state_dict, split_graph
from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.runtime.stages.ties import TiedParameters

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite

STEPS, BATCH = 3, 4
SPLIT_POINTS = {"gpt": ["blocks.2"], "resnet": ["layer2.0.conv2"]}  # resnet: cut inside a residual block


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def prepared(family: str, chunks: int):
    """The model, and its split captured on one micro-batch (every micro-batch of the test has that shape).

    Each rank captures for itself, as the strategy's ranks will: torch.export in the pytest process, followed by
    any backward there, would make autograd refuse to run in processes forked from it later."""
    model, _ = make(family)
    example = batches(family, 1, BATCH // chunks)[0][0]
    return model, split_graph(capture(model, example), SPLIT_POINTS[family])


def train_stage(rank, world, family, schedule, chunks):
    model, split = prepared(family, chunks)  # seeded: every rank builds the same model
    stage = build_stages(model, split, [rank])[0]
    ties = TiedParameters(stage, split.ties, rank)
    pipe = Pipeline([stage if r == rank else None for r in range(world)], loss_fn=loss_fn, optimizer=sgd,
                    schedule=schedule, chunks=chunks, before_update=ties.allreduce_grads)
    losses = [pipe.step((args, {}), targets) for args, targets in batches(family, STEPS, BATCH)]
    pipe.drain()
    return pipe.state_dict(), losses, ties.max_difference()


def reference(rank, world, family: str) -> tuple[dict, list[float]]:
    model = copy.deepcopy(make(family)[0])
    opt = sgd(model.parameters())
    losses = []
    for args, targets in batches(family, STEPS, BATCH):
        loss = loss_fn(model(*args), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


CHUNKS = {"gpt": 2, "resnet": 1}  # BatchNorm: one micro-batch per batch
# The schedules each family trains under; GPT-2BW's rule too, for the GPT (tied across its stages).
SCHEDULES = {"gpt": ("gpipe", "1f1b", "2bw"), "resnet": ("gpipe", "1f1b")}


def train_stages(rank, world, family, schedules, chunks):
    """``train_stage`` under each of ``schedules`` in turn, in the same processes: a fresh model and pipeline each
    time, the rank's capture of the model made once (the later ones come from capture's in-process cache)."""
    return {schedule: train_stage(rank, world, family, schedule, chunks) for schedule in schedules}


def references(rank, world, family):
    """The one-process references of ``family``: plain training, and for the GPT PipeDream-2BW's rule."""
    return reference(rank, world, family), two_bw_reference(rank, world, family) if family == "gpt" else None


@pytest.fixture(scope="module")
def trained():
    """Per family, every schedule's ranks' results (one launch of 2 processes) and its references (one launch of 1),
    made when a test first asks for the family."""
    done: dict[str, tuple[dict, tuple]] = {}

    def of(family: str) -> tuple[dict, tuple]:
        if family not in done:
            runs = run_local(train_stages, 2, family, SCHEDULES[family], CHUNKS[family], timeout=180)
            # In a forked process too: autograd in this one would break the forks of the next tests.
            done[family] = ({s: [rank[s] for rank in runs] for s in SCHEDULES[family]},
                            run_local(references, 1, family, timeout=60)[0])
        return done[family]

    return of


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("family", ["gpt", "resnet"])
def test_training_equals_one_process(trained, family, schedule):
    runs, ((want_state, want_losses), _) = trained(family)
    results = runs[schedule]
    # consolidate_state_dict refuses tied copies that are not bit-identical.
    state = consolidate_state_dict([part for part, _, _ in results], list(want_state))
    assert list(state) == list(want_state)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert results[-1][1] == pytest.approx(want_losses, rel=1e-5)
    assert [difference for _, _, difference in results] == [0.0, 0.0]
    if family == "gpt":
        assert torch.equal(results[0][0]["tok.weight"], results[1][0]["head.weight"])


def two_bw_reference(rank, world, family: str) -> dict:
    """PipeDream-2BW's rule in one process: W(t+1) = W(t) - lr * grad f_t(W(t-1)), W(-1) = W(0). A tied parameter
    is one tensor here: its gradient is the sum over its uses, which is what the pipeline's copies must each get."""
    model = copy.deepcopy(make(family)[0])
    opt = sgd(model.parameters())
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    for args, targets in batches(family, STEPS, BATCH):
        params = {k: w.clone().requires_grad_() for k, w in before.items()}
        loss = loss_fn(torch.func.functional_call(model, params, args, tie_weights=True), targets)
        grads = torch.autograd.grad(loss, [params[k] for k, _ in model.named_parameters()])
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
    return model.state_dict()


def test_two_bw_with_weights_tied_across_stages_follows_its_rule(trained):
    # The GPT's output projection (stage 1) is tied to its token embedding (stage 0): each stage keeps its copy and
    # its two weight versions; at every update the copies' gradients are summed, so the copies stay identical and
    # the model follows 2BW's rule as if the weight were one tensor.
    runs, ((synchronous, _), want) = trained("gpt")
    results = runs["2bw"]
    state = consolidate_state_dict([part for part, _, _ in results], list(want))
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert [difference for _, _, difference in results] == [0.0, 0.0]
    assert torch.equal(results[0][0]["tok.weight"], results[1][0]["head.weight"])
    assert max((want[k] - v).abs().max().item() for k, v in synchronous.items()) > 1e-4  # the rule is not sync


def token_mean(output, labels):
    """A Hugging Face model's loss: the mean over the labelled tokens (padding, -100, left out)."""
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                             ignore_index=-100)


def train_token_mean(rank, world, chunks):
    model, _ = make("hf")
    data = padded(batches("hf", STEPS, BATCH))
    example = (data[0][0][0][: BATCH // chunks],)
    split = split_graph(capture(model, example, {"use_cache": False}), ["blocks.1"])
    stage = build_stages(model, split, [rank])[0]
    ties = TiedParameters(stage, split.ties, rank)
    pipe = Pipeline([stage if r == rank else None for r in range(world)], loss_fn=token_mean, optimizer=sgd,
                    schedule="1f1b", chunks=chunks, before_update=ties.allreduce_grads,
                    mean_over=lambda labels: (labels != -100).sum())
    losses = [pipe.step((args, {"use_cache": False}), labels) for args, labels in data]
    return pipe.state_dict(), losses


def token_mean_reference(rank, world):
    model = make("hf")[0]
    opt = sgd(model.parameters())
    losses = []
    for (input_ids,), labels in padded(batches("hf", STEPS, BATCH)):
        loss = token_mean(model(input_ids, use_cache=False), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def test_a_token_mean_loss_with_mean_over_equals_one_process():
    # Padded LM batches whose micro-batches hold unequal numbers of labelled tokens; the model returns an output
    # dataclass (use_cache=False: nothing to drop) and the loss reads its logits.
    results = run_local(train_token_mean, 2, 2, timeout=90)
    want_state, want_losses = run_local(token_mean_reference, 1, timeout=60)[0]
    state = consolidate_state_dict([part for part, _ in results], list(want_state))
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert results[-1][1] == pytest.approx(want_losses, rel=1e-5)  # the step's loss is the batch's token mean
