"""The lagged step summaries and the data check's fingerprints under a model of NCCL's point-to-point rules: the two
travel in opposite directions, so they take a group each way (as the pipeline does); on one group they deadlock."""

from __future__ import annotations

import pytest
import torch

from lightning_pipedream.strategy.reporting.consistency import RECORD_SLOTS
from lightning_pipedream.strategy.reporting.summaries import LaggedSummaries, LoggedValue, StepSummary, SummaryChannel
from lightning_pipedream.testing.nccl_model import DeadlockError, PointToPointModel

RANKS, LAG, STEPS = 3, 2, 7


def summary(step: int) -> StepSummary:
    logs = [LoggedValue("train_loss", 1.0 / (step + 1), {"prog_bar": True})]
    if step == 4:  # a value logged from this step on: the layout changes, the summary travels pickled again
        logs.append(LoggedValue("grad_norm", float(step), {}))
    return StepSummary(loss=float(step), logs=logs if step < 4 else logs + [LoggedValue("extra", 2.0, {})])


def run_channel(both_directions: bool) -> list[list[tuple[float, list[str]]]]:
    model = PointToPointModel(RANKS, watchdog_s=30)

    def rank_main(rank: int) -> list[tuple[float, list[str]]]:
        group = torch.distributed.new_group(list(range(RANKS)))  # every rank makes the groups, in the same order
        reverse = torch.distributed.new_group(list(range(RANKS)))
        channel = SummaryChannel(rank, RANKS, torch.device("cpu"))
        lagged = LaggedSummaries(channel, group, source=RANKS - 1, receivers=list(range(RANKS - 1)), lag=LAG,
                                 is_source=rank == RANKS - 1, reverse_group=reverse if both_directions else None)
        taken = []
        for step in range(STEPS):
            record = torch.zeros(RECORD_SLOTS, dtype=torch.float64)  # every rank's fingerprint of the same batch
            record[0], record[2] = rank, step
            for got in lagged.step(summary(step) if rank == RANKS - 1 else None, record):
                taken.append((got.loss, [log.name for log in got.logs]))
        taken += [(got.loss, [log.name for log in got.logs]) for got in lagged.take_all()]
        return taken

    return model.run(rank_main, timeout=60)


def test_summaries_and_fingerprints_on_a_group_each_way_arrive_everywhere():
    taken = run_channel(both_directions=True)
    want = [(float(t), [log.name for log in summary(t).logs]) for t in range(STEPS)]
    assert taken == [want] * RANKS


def test_summaries_and_fingerprints_on_one_group_deadlock_under_nccl_rules():
    with pytest.raises(DeadlockError, match="deadlock under NCCL's point-to-point rules"):
        run_channel(both_directions=False)
