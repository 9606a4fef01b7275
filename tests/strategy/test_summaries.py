"""LaggedSummaries in one process: step t's summary reaches every rank at step t + lag, numbers-only after the first,
pickled again when its layout changes; point-to-point messages go through an in-memory stand-in for gloo."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from lightning_pipedream.strategy.reporting import summaries as summaries_module
from lightning_pipedream.strategy.reporting.summaries import LaggedSummaries, LoggedValue, StepSummary, SummaryChannel


class Wire:
    """Messages from the source (rank 2 of a 3-rank group) to each receiver, in order, as gloo delivers them."""

    def __init__(self) -> None:
        self.queues: dict[int, deque[torch.Tensor]] = {}
        self.sent = 0

    def isend(self, tensor, group=None, group_dst=None):
        self.queues.setdefault(group_dst, deque()).append(tensor.clone())
        self.sent += 1
        return Done()

    def irecv(self, tensor, group=None, group_src=None, me=None):
        wire = self

        class Posted:
            def wait(self) -> None:  # the message arrived by the time it is needed (the test steps in order)
                tensor.copy_(wire.queues[me].popleft())

        return Posted()

    def recv(self, tensor, group=None, group_src=None, me=None):
        tensor.copy_(self.queues[me].popleft())


class Done:
    def wait(self) -> None:
        pass


def lagged(me: int) -> LaggedSummaries:
    channel = SummaryChannel(stage_index=me, num_stages=3, device=torch.device("cpu"))
    return LaggedSummaries(channel, group=None, source=2, receivers=[0, 1], lag=2, is_source=me == 2)


def summary(step: int, extra: dict | None = None, name: str = "acc") -> StepSummary:
    return StepSummary(loss=float(step), extra=extra or {}, logs=[LoggedValue(name, step / 10, {"prog_bar": True})])


def test_every_rank_takes_step_t_at_step_t_plus_lag_with_the_same_values(monkeypatch) -> None:
    wire = Wire()
    ranks = {me: lagged(me) for me in range(3)}
    current = {"me": 0}
    monkeypatch.setattr(summaries_module.dist, "isend", wire.isend)
    monkeypatch.setattr(summaries_module.dist, "irecv",
                        lambda t, group=None, group_src=None: wire.irecv(t, group, group_src, me=current["me"]))
    monkeypatch.setattr(summaries_module.dist, "recv",
                        lambda t, group=None, group_src=None: wire.recv(t, group, group_src, me=current["me"]))
    sent = [summary(0), summary(1), summary(2, extra={"k": 1}), summary(3, name="other"), summary(4), summary(5)]
    taken: dict[int, list[StepSummary]] = {me: [] for me in range(3)}
    for step, each in enumerate(sent):
        for me in (2, 0, 1):  # the last stage finishes its step first: it sends, the others take later
            current["me"] = me
            out = ranks[me].step(each if me == 2 else None)
            assert len(out) == (1 if step >= 2 else 0), "a summary is used lag=2 steps after its own"
            taken[me] += out
    for me in (2, 0, 1):
        current["me"] = me
        taken[me] += ranks[me].take_all()  # a drain delivers the rest
    for me in range(3):
        assert [s.loss for s in taken[me]] == [0, 1, 2, 3, 4, 5]
        assert [s.extra for s in taken[me]] == [{}, {}, {"k": 1}, {}, {}, {}]
        assert [[(log.name, log.value, log.options) for log in s.logs] for s in taken[me]] == [
            [("acc" if i != 3 else "other", i / 10, {"prog_bar": True})] for i in range(6)]
    # a header per receiver and step; a pickled payload where the layout is new (steps 0, 2, 3, 4)
    assert wire.sent == 2 * (6 + 4)


def test_forget_drops_what_is_pending(monkeypatch) -> None:
    wire = Wire()
    monkeypatch.setattr(summaries_module.dist, "isend", wire.isend)
    source = lagged(2)
    source.step(summary(0))
    source.forget()
    assert source.take_all() == []


@pytest.mark.parametrize("lag", [0, 1])
def test_no_lag_gives_each_summary_at_once(monkeypatch, lag: int) -> None:
    wire = Wire()
    monkeypatch.setattr(summaries_module.dist, "isend", wire.isend)
    channel = SummaryChannel(stage_index=1, num_stages=2, device=torch.device("cpu"))
    source = LaggedSummaries(channel, group=None, source=1, receivers=[0], lag=lag, is_source=True)
    out = [s.loss for step in range(3) for s in source.step(summary(step))]
    assert out == [0.0, 1.0, 2.0][: 3 - lag]
