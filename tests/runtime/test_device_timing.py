"""Compute timed on the device, modelled on the CPU: a stand-in for ``torch.cuda.Event(enable_timing=True)`` (one
stream, a device clock that runs each compute action for a known time, and CUDA's rule that an event's time can be
read only once the device got past it) takes the place of CUDA's events, where the accounts make them. The executor
records a pair around each compute action and never waits for it; the accounts resolve the pairs once per interval
(one synchronization), reuse the events and resolve early past a cap; a CPU device never makes an event."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from cuda_events import StandInDevice
from thread_ranks import MemoryTransport, run_in_threads
from torch import nn

from lightning_pipedream.runtime.communication.microbatch import split
from lightning_pipedream.runtime.execution import accounts as accounts_module
from lightning_pipedream.runtime.execution.accounts import StepAccounts, cuda_event, device_events
from lightning_pipedream.runtime.execution.executor import Executor
from lightning_pipedream.runtime.stages.stage import Stage
from lightning_pipedream.schedule.actions import Op
from lightning_pipedream.schedule.builders import build_schedule


def _train(schedule_name: str, chunks: int, steps: int, device: torch.device | None, take_every: int,
           watch: dict[int, StandInDevice] | None = None) -> tuple[list[Executor], list[list], list[list]]:
    """Two ranks in threads train ``steps`` steps over a transport on ``device``; each rank's accounts are taken
    every ``take_every`` steps and at the end. Returns the executors, each rank's taken figures and the stand-in's
    synchronizations seen after each step's actions (``watch``: each rank's stand-in)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    parts = [copy.deepcopy(model[:2]), copy.deepcopy(model[2:])]
    schedule = build_schedule(schedule_name, 2, chunks)
    mailboxes: dict = {}
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    xs, ys = split(x, chunks), split(y, chunks)
    executors: list[Any] = [None, None]
    taken: list[list] = [[], []]
    syncs: list[list] = [[], []]

    def rank(r: int) -> None:
        transport = MemoryTransport(r, mailboxes, timeout=30, device=device)  # a device that is only a name
        executor = executors[r] = Executor(Stage(parts[r], r, 2), transport, rank=r)
        accounts = executor.accounts
        for step in range(steps):
            accounts.begin_step()
            executor.run(schedule.actions[r], inputs=lambda mb: xs[mb],
                         loss=lambda mb, out: nn.functional.cross_entropy(out, ys[mb]),
                         optimizer_step=lambda action: None)
            accounts.end_step()
            if watch is not None:
                syncs[r].append(watch[r].syncs)
            if (step + 1) % take_every == 0:
                taken[r].append(accounts.take())
        accounts.finish()
        taken[r].append(accounts.take())

    run_in_threads(rank)  # each rank's thread is named rank{r}: the stand-in's events are found by that name
    return executors, taken, syncs


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 4), ("zb-h1", 3)])
def test_a_cuda_transport_times_each_compute_action_on_the_device_and_synchronizes_once_per_interval(
        monkeypatch, schedule: str, chunks: int) -> None:
    actions = build_schedule(schedule, 2, chunks).actions
    computes = [sum(a.op.is_compute for a in actions[r]) for r in range(2)]  # F, B (recompute inside) and W
    steps = 4
    # A known time for every compute action of the run, different each time, and per rank.
    devices = {r: StandInDevice([0.5 + 0.25 * k + r for k in range(steps * computes[r])]) for r in range(2)}
    # CUDA's own class, where the accounts make their events on a CUDA device: each rank's thread gets its stand-in.
    monkeypatch.setattr(torch.cuda, "Event",
                        lambda enable_timing=False: devices[int(threading.current_thread().name[4:])].event(
                            enable_timing))
    executors, taken, syncs = _train(schedule, chunks, steps, torch.device("cuda", 0), take_every=2, watch=devices)
    for r in range(2):
        d, n = devices[r], computes[r]
        assert executors[r].accounts.timing and d.records == 2 * steps * n  # a pair around every compute action
        # No synchronization while the actions run: the first is the take after step 2 (seen after step 3).
        assert syncs[r] == [0, 0, 1, 1], syncs[r]
        assert d.syncs == 3  # one per take that had closed steps: steps 2 and 4, and the fit's end
        # Each take holds the steps closed by then (a step closes when the next begins): step 1; steps 2-3; step 4.
        durations = d.ran
        assert len(durations) == steps * n
        expected = [sum(durations[:n]), sum(durations[n:3 * n]), sum(durations[3 * n:])]
        assert [f.steps for f in taken[r]] == [1, 2, 1]
        assert [f.device_compute * 1e3 for f in taken[r]] == pytest.approx(expected)
        assert [f.device_actions for f in taken[r]] == [n, 2 * n, n]
        assert taken[r][1].per_step_ms()["device_compute"] == pytest.approx(expected[1] / 2)
        # The host's parts are the host's: they still add up to the step (the device figure is beside them).
        for f in taken[r]:
            parts = f.compute + f.wait + f.transfer + f.update + f.other
            assert parts == pytest.approx(f.step) and f.compute > 0
        # Events are reused: never more made than two intervals' pairs were waiting at once.
        assert d.made <= 2 * 3 * n < d.records


def test_a_cpu_device_never_makes_an_event(monkeypatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an event was made on a CPU device")

    monkeypatch.setattr(torch.cuda, "Event", refuse)
    monkeypatch.setattr(accounts_module, "cuda_event", refuse)
    for device in (torch.device("cpu"), None):  # a CPU transport, and one that names no device
        executors, taken, _ = _train("1f1b", 2, 3, device, take_every=1)
        for executor, figures in zip(executors, taken):
            assert not executor.accounts.timing and executor.accounts.events is None
            assert all(f.device_actions == 0 and f.device_compute == 0.0 for f in figures)
            assert "device_compute" not in figures[1].per_step_ms() and figures[1].compute > 0


def test_the_default_events_are_cuda_s_with_timing_and_only_for_a_cuda_device(monkeypatch) -> None:
    made: list[dict] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: made.append(kwargs) or "event")
    assert device_events(torch.device("cuda", 1)) is cuda_event and device_events(torch.device("cuda")) is cuda_event
    assert device_events(torch.device("cpu")) is None and device_events(None) is None
    assert made == []  # choosing makes nothing
    assert cuda_event() == "event" and made == [{"enable_timing": True}]


def _pairs(accounts: StepAccounts, count: int) -> None:
    for _ in range(count):
        mark = accounts.device_begin()
        accounts.device_end(mark)
        accounts.action(Op.FORWARD, 0.0, 0.001)


def test_the_pool_reuses_events_across_intervals() -> None:
    device = StandInDevice([1.0 + k for k in range(40)])
    accounts = StepAccounts(events=device.timing_event)
    for _ in range(5):  # 5 intervals of one step of 4 compute actions, each taken
        accounts.begin_step()
        _pairs(accounts, 4)
        accounts.end_step()
        accounts.take()
    accounts.finish()
    last = accounts.take()
    # Step k's pairs wait until the take after the step that closes it: two steps' pairs at most, 16 events.
    assert device.records == 40 and device.made == 16
    assert device.syncs == 5  # the first take had no closed step: nothing to wait for
    assert accounts.total.device_actions == 20
    assert accounts.total.device_compute * 1e3 == pytest.approx(sum(device.ran)) and last.steps == 1


def test_more_pairs_than_the_cap_are_resolved_early_once_each_time_and_kept_for_their_step() -> None:
    device = StandInDevice([0.1 * (k + 1) for k in range(12)])
    accounts = StepAccounts(events=device.timing_event, device_cap=5)
    accounts.begin_step()
    _pairs(accounts, 5)
    assert device.syncs == 0  # at the cap: nothing waits yet
    _pairs(accounts, 1)
    assert device.syncs == 1  # past it: every waiting pair resolved, with one synchronization
    _pairs(accounts, 6)
    assert device.syncs == 2 and device.made == 12  # the second six pairs reused the first six's events
    accounts.end_step()
    accounts.begin_step()  # closes the step
    figures = accounts.take()
    assert device.syncs == 2  # nothing was left waiting
    assert figures.steps == 1 and figures.device_actions == 12
    assert figures.device_compute * 1e3 == pytest.approx(sum(device.ran))
    assert accounts.take().device_actions == 0  # the open step has no pairs
