"""The stage's live tensor bytes over a traced window (``trace_memory=True``, strategy/reporting/live_memory.py), in
process: the window's meter, which adds what was made before it, against a meter that saw every tensor from the
model's construction on; why an asynchronous schedule's meter starts early; the figure in the logged keys, the ranks'
measured means and the end-of-fit table; the option refused without ``trace=``. The same on real 2- and 3-process
fits is in tests/strategy/test_stage_figures.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pipedream.plan.explain import Explanation, explain
from lightning_pipedream.plan.live_bytes import LiveTensorBytes
from lightning_pipedream.plan.partition import Plan, StagePlan
from lightning_pipedream.runtime.execution.accounts import StepAccounts
from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.strategy.reporting.explanation import measured_ranks
from lightning_pipedream.strategy.reporting.live_memory import WindowMemory, stage_tensors
from lightning_pipedream.strategy.reporting.stage_figures import StageFigures
from lightning_pipedream.strategy.setup.options import PipelineOptions


def _stage() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(steps: int, meter: WindowMemory, held_for: int = 0, big_at: int | None = None) -> None:
    """``steps`` training steps of :func:`_stage`'s model under ``meter``; each step's loss is backwarded ``held_for``
    steps later (an asynchronous schedule's activations in flight); at step ``big_at`` a large tensor lives briefly."""
    model, optimizer = _make[0], _make[1]
    pending: list[torch.Tensor] = []
    for step in range(steps):
        meter.begin_step(step)
        x = torch.randn(16, 8)  # made inside the step, as a received activation is
        pending.append(model(x).square().mean())
        if len(pending) > held_for:
            pending.pop(0).backward()
            if not held_for:  # (held: the gradients accumulate; an update would change what autograd saved)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if step == big_at:
            torch.ones(1 << 20).sum()
        meter.end_step()


_make: list = []


def _reference_and_window(first: int, count: int, lead: int, held_for: int, steps: int,
                          big_at: int | None = None) -> tuple[float, float]:
    """The window's peak (:class:`WindowMemory`) and the peak over the same steps of a meter that was on from the
    model's construction on (it saw every tensor made)."""
    everything = LiveTensorBytes()
    with everything:
        _make[:] = _stage()
    model, optimizer = _make
    window = WindowMemory(stage_tensors([model], lambda: [optimizer]), first, count, lead)

    reference: list[float] = []

    class Both:  # the window's meter, and the complete one on at every step (its peak read at the window's end)
        def begin_step(self, step: int) -> None:
            self.step = step
            window.begin_step(step)
            if step == first:
                everything.reset_peak()
            everything.__enter__()

        def end_step(self) -> None:
            window.end_step()
            everything.__exit__(None, None, None)
            if self.step == first + count - 1:
                reference.append(float(everything.peak))

    _train(steps, Both(), held_for, big_at)  # type: ignore[arg-type]
    return window.peak, reference[0]


def test_the_windows_peak_is_every_tensors_peak_over_its_steps() -> None:
    # A flushed schedule: steps 3 and 4 metered; the weights, the momentum buffers and the gradients made before them
    # are added when the meter starts. The complete meter gives the same peak over those steps.
    window, reference = _reference_and_window(first=3, count=2, lead=0, held_for=0, steps=7, big_at=5)
    model, optimizer = _make
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert window == reference
    assert window >= 3 * weights  # weights, gradients, momentum: at least
    assert window < 3 * weights + 16 * (8 + 32 + 32 + 4) * 4 * 4  # and the step's activations and their gradients
    # Step 5's 4 MiB tensor is after the window: not in its peak.
    assert window < 1 << 20


def test_an_asynchronous_schedules_meter_starts_early_to_see_the_activations_in_flight() -> None:
    # Each step's activations are backwarded two steps later (3 stages of pipedream, stage 0). A meter started at the
    # window (a step here) would not see the two minibatches in flight at its start: its peak falls short of the
    # complete meter's. (Over a window longer than the lead the steady state's peak would hide that.)
    early, reference = _reference_and_window(first=4, count=1, lead=2, held_for=2, steps=6)
    late, reference_again = _reference_and_window(first=4, count=1, lead=0, held_for=2, steps=6)
    assert early == reference == reference_again
    assert late < reference


def test_before_its_window_the_meter_says_nothing() -> None:
    model, optimizer = _stage()
    window = WindowMemory(stage_tensors([model], lambda: [optimizer]), 5, 2, lead=2)
    assert [window.metered(step) for step in range(9)] == [False, False, False, True, True, True, True, False, False]
    window.begin_step(3)  # the lead's first step: metered, but not the window's
    window.end_step()
    assert math.isnan(window.peak) and window.where() == "not measured"
    whole = WindowMemory(stage_tensors([model], lambda: [optimizer]), 0, None, lead=0)
    assert all(whole.metered(step) for step in (0, 1, 10_000))


def test_the_live_peak_is_logged_and_kept_for_the_explanation() -> None:
    class Takes:
        def __init__(self) -> None:
            self.logged: list[dict] = []

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            self.logged.append(metrics)

    accounts = StepAccounts()
    figures = StageFigures(accounts, rank=0, world_size=1, stage=0, replica=0, every=1, device=torch.device("cpu"),
                           replicas=False, predicted_bytes=[3.0 * 2**20])
    figures.loggers = [takes := Takes()]
    # Each interval's message (a step is complete at the next one's start): no window yet, then its peak so far.
    peaks = iter([math.nan, math.nan, 2.5 * 2**20, 3.25 * 2**20])
    figures.live_peak = lambda: next(peaks)
    for step in range(3):
        figures.begin_step()
        accounts.action(Op.FORWARD, 0.0, 0.001)
        figures.end_step(step)
    figures.finish(3)
    assert "pipeline/stage0/peak_live_mb" not in takes.logged[0]
    assert [m["pipeline/stage0/peak_live_mb"] for m in takes.logged[1:]] == [2.5, 3.25]
    assert all(m["pipeline/stage0/predicted_memory_mb"] == 3.0 for m in takes.logged)
    assert all(m["pipeline/stage0/peak_memory_mb"] > 3.25 for m in takes.logged)  # the process's resident set
    (rank,) = measured_ranks(figures.totals, None, figures.predicted_bytes)
    assert rank["peak_live_bytes"] == 3.25 * 2**20 and rank["predicted_memory_bytes"] == 3.0 * 2**20


def test_the_table_shows_predicted_against_live_memory_where_both_are_known() -> None:
    plan = Plan([StagePlan(["a"], compute_s=0.01), StagePlan(["b"], compute_s=0.01)], schedule="1f1b", chunks=2,
                time_per_minibatch=0.01)
    ranks = [{"stage": k, "steps": 4, "compute": 0.01, "wait": 0.0, "transfer": 0.001, "update": 0.001,
              "other": 0.002, "step": 0.014} for k in range(2)]
    assert "memory" not in explain(plan, ranks).table()
    ranks[0] |= {"predicted_memory_bytes": 4.89 * 2**20, "peak_live_bytes": 6.43 * 2**20}
    ranks[1] |= {"predicted_memory_bytes": 6.87 * 2**20}  # no window measured on this rank: shown as -
    e = explain(plan, ranks)
    lines = e.table().splitlines()
    assert lines[1].endswith("memory pred/live")
    assert lines[3].endswith("4.89 MiB / 6.43 MiB") and lines[4].endswith("6.87 MiB / -")
    again = Explanation.from_json(e.to_json())
    assert again.stages[0].live_peak == 6.43 * 2**20 and again.table() == e.table()
    # Replicas of a stage: the largest measured peak.
    replicated = [dict(ranks[0]), dict(ranks[0], peak_live_bytes=7 * 2**20), ranks[1]]
    assert explain(plan, replicated).stages[0].live_peak == 7 * 2**20


def test_trace_memory_without_a_trace_is_refused_in_words() -> None:
    with pytest.raises(ValueError) as refused:
        PipelineOptions(trace_memory=True)
    assert str(refused.value) == (
        "trace_memory=True measures each stage's live tensors over the traced steps: it needs trace=DIR (and "
        "trace_steps= for a window of them). Give trace=, or drop trace_memory.")
