"""The divergence guard's rule, the drained weights it goes back to, the staleness record, and the refused options
(in one process; the guard through a Trainer is in test_exactness.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pipedream import PipeDreamStrategy
from lightning_pipedream.strategy.training.divergence import WARMUP, DivergenceGuard, DrainedWeights, Staleness


def feed(guard: DivergenceGuard, losses: list[float]):
    for loss in losses:
        found = guard.observe(loss)
        if found is not None:
            return found
    return None


def test_a_falling_or_noisy_loss_is_left_alone():
    falling = [2.0 / (1 + 0.1 * t) for t in range(200)]
    assert feed(DivergenceGuard(), falling) is None
    noisy = [1.0 + 0.5 * math.sin(t) for t in range(200)]
    assert feed(DivergenceGuard(), noisy) is None


def test_one_hard_batch_does_not_trip_the_average_but_a_lasting_rise_does():
    guard = DivergenceGuard(factor=2.0)
    assert feed(guard, [1.0] * 10 + [5.0] + [1.0] * 10) is None  # one batch at 5x: the average reaches 1.4
    found = feed(guard, [3.0] * 30)
    assert found is not None and found.smoothed > 2.0 and found.limit == pytest.approx(2.0)
    assert "above the limit 2 (divergence_factor x its lowest)" in found.words()


def test_a_loss_that_is_not_finite_trips_it_at_once_even_while_warming_up():
    found = feed(DivergenceGuard(), [1.0, float("nan")])
    assert found is not None and found.seen == 2 and math.isnan(found.limit)
    assert found.words() == "the training loss of minibatch 1 is nan"
    assert feed(DivergenceGuard(), [float("inf")]).words() == "the training loss of minibatch 0 is inf"


def test_a_blow_up_in_the_first_losses_is_caught_once_warmed_up():
    found = feed(DivergenceGuard(), [0.5, 0.5, 5000.0, 4000.0, 3000.0])
    assert found is not None and found.seen == WARMUP


def test_negative_losses_are_judged_only_by_finiteness():
    assert feed(DivergenceGuard(), [-5.0] * 10 + [-1.0] * 50) is None


def test_healthy_says_whether_drained_weights_are_worth_keeping():
    guard = DivergenceGuard()
    assert guard.healthy
    feed(guard, [1.0] * 5)
    assert guard.healthy
    guard.observe(100.0)  # the average jumps to 10.9
    assert not guard.healthy


def test_drained_weights_bring_back_the_weights_and_the_optimizer_state():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    kept = DrainedWeights()
    assert not kept.taken
    kept.take(model, [optimizer])
    want = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    kept.restore(model, [optimizer])
    for p, w, m in zip(model.parameters(), want, momentum):
        assert torch.equal(p, w) and torch.equal(optimizer.state[p]["momentum_buffer"], m)
    kept.take(model, [optimizer])  # a later drain reuses the copy's memory
    assert kept.taken


def test_staleness_gives_the_mean_and_largest_then_starts_over():
    record = Staleness()
    record.add([0, 1, 2, 2])
    record.add([2])
    assert record.take() == (1.4, 2)
    assert record.take() == (0.0, 0)


@pytest.mark.parametrize("kwargs,words", [
    ({"schedule": "1f1b", "chunks": 2, "on_divergence": "flush"},
     "on_divergence='flush' guards the asynchronous schedules (pipedream, 2bw), whose stale weights can diverge; "
     "schedule='1f1b' computes what one device would. Drop on_divergence, or use schedule='pipedream' or '2bw'."),
    ({"on_divergence": "restart"},
     "on_divergence='restart' is not a choice: use None (the default: no guard) or 'flush' (after a divergence, go "
     "back to the last drained weights and go on under 1f1b)."),
    ({"on_divergence": "flush", "divergence_factor": 1.0},
     "divergence_factor=1.0: give a number > 1, how many times its lowest value the smoothed loss may reach before "
     "on_divergence steps in."),
])
def test_what_the_guard_refuses_says_what_to_do(kwargs, words):
    with pytest.raises(ValueError) as caught:
        PipeDreamStrategy(**kwargs)
    assert str(caught.value) == words
