"""The data check: every stage of a pipeline reads the same batches; drift, unequal batch counts and a shuffle that
drifts with the global random state are caught and named, with advice that fits the cause."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist
from fault_runs import run_hang_trainer

from lightning_pipedream.runtime.faults.launch import RankFailedError, run_local
from lightning_pipedream.strategy.reporting.consistency import (
    CHECK_EVERY,
    CHECK_EVERY_ASYNC,
    DataMismatchError,
    batch_record,
    check_records,
    is_due,
)
from lightning_pipedream.strategy.reporting.summaries import LaggedSummaries, StepSummary, SummaryChannel

pytestmark = pytest.mark.multiprocess  # starts several processes: not in the fast suite


def batch(shift: float = 0.0, n: int = 4) -> tuple:
    return torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) + shift, torch.arange(n)


def words(a: torch.Tensor, b: torch.Tensor) -> str:
    with pytest.raises(DataMismatchError) as info:
        check_records([a, b])
    return str(info.value)


def test_the_words_fit_the_cause():
    same = batch_record(batch(), 0, 0, 0, 3, 16, False)
    check_records([same, batch_record(batch(), 1, 1, 0, 3, 16, False)])  # rank and stage are not compared
    nan = (torch.full((4, 8), float("nan")), torch.arange(4))
    check_records([batch_record(nan, 0, 0, 0, 0, 16, False), batch_record(nan, 1, 1, 0, 0, 16, False)])
    assert words(batch_record(batch(), 0, 0, 0, 0, 16, False), batch_record(batch(), 1, 1, 0, 0, 15, False)) == (
        "The pipeline's ranks have unequal numbers of training batches per epoch: rank 0 (stage 0) has 16, rank 1 "
        "(stage 1) has 15 (epoch 0). Every stage of a pipeline must read the same batches in the same order (stage 0 "
        "reads the inputs, the last stage the targets): give every rank the same dataset, sampler and batch size. "
        "With use_distributed_sampler=False, shard by pipelines, not ranks.")
    # An iterable dataset (length unknown): one rank's data ends first.
    text = words(batch_record(batch(), 0, 0, 2, 9, math.inf, False), batch_record(batch(), 1, 1, 2, 9, math.inf, True))
    assert text.startswith("The pipeline's ranks have unequal numbers of training batches in epoch 2: rank 1 "
                           "(stage 1)'s data ended at batch 9 of epoch 2 while rank 0 (stage 0)'s goes on.")
    assert text.endswith("An iterable dataset must yield as many batches on every rank of a pipeline.")
    text = words(batch_record(batch(), 0, 0, 1, 0, math.inf, False), batch_record(batch(), 1, 1, 0, 10, math.inf, False))
    assert "rank 0 (stage 0) is at batch 0 of epoch 1 while rank 1 (stage 1) is at batch 10 of epoch 0" in text
    assert words(batch_record(batch(), 0, 0, 0, 5, 16, False), batch_record(batch(n=3), 1, 1, 0, 5, 16, False)
                 ).startswith("The pipeline stages received batches of different shapes at batch 5 of epoch 0: rank "
                              "0 (stage 0) 4 samples, rank 1 (stage 1) 3.")
    reshaped = (batch()[0].reshape(4, 2, 4), batch()[1])
    assert "different shapes" in words(batch_record(batch(), 0, 0, 0, 5, 16, False),
                                       batch_record(reshaped, 1, 1, 0, 5, 16, False))
    first = words(batch_record(batch(), 0, 0, 0, 0, 16, False), batch_record(batch(1), 1, 1, 0, 0, 16, False))
    assert first.startswith("The pipeline stages received different training batches at batch 0 of epoch 0: rank 0 "
                            "(stage 0) and rank 1 (stage 1) disagree.")
    assert first.endswith("seed every rank's shuffling identically.")
    # A later epoch's first batch: the order drew from the global random state (dropout on one stage consumed it).
    later = words(batch_record(batch(), 0, 0, 1, 0, 16, False), batch_record(batch(1), 1, 1, 1, 0, 16, False))
    assert later.endswith("Give the sampler a generator of its own: DataLoader(..., shuffle=True, "
                          "generator=torch.Generator().manual_seed(0)).")
    # In the middle of an epoch: randomness in the data pipeline.
    middle = words(batch_record(batch(), 0, 0, 1, 5, 16, False), batch_record(batch(1), 1, 1, 1, 5, 16, False))
    assert "The epoch began with the same batches, so they drifted apart" in middle
    assert "Draw it from a torch.Generator of its own" in middle


def test_which_steps_check():
    assert CHECK_EVERY == 1 and all(is_due(i, 16) for i in range(5))
    assert CHECK_EVERY_ASYNC == 8 and [i for i in range(20) if is_due(i, 20, CHECK_EVERY_ASYNC)] == [0, 8, 16]
    assert [i for i in range(10) if is_due(i, 16, every=4)] == [0, 4, 8]
    assert all(is_due(i, math.inf, every=4) for i in range(5))  # an iterable dataset's end comes at any step


def lagged_drift(rank: int, world: int, drift_at: int) -> None:
    """pipedream's summaries with fingerprints: rank 0's data drifts at step ``drift_at``."""
    channel = SummaryChannel(rank, world, torch.device("cpu"))
    lagged = LaggedSummaries(channel, dist.group.WORLD, source=1, receivers=[0], lag=1, is_source=rank == 1)
    for t in range(10):
        shift = 1.0 if rank == 0 and t >= drift_at else 0.0
        lagged.step(StepSummary(float(t)) if rank == 1 else None, batch_record(batch(shift), rank, rank, 0, t, 16,
                                                                                   False))


def test_the_last_stage_catches_drift_one_lag_later_and_every_rank_is_told():
    with pytest.raises(RankFailedError) as info:
        run_local(lagged_drift, 2, 5, timeout=60)
    text = str(info.value)
    stage1 = text[text.index("--- rank 1 ---"):]
    assert stage1.startswith("--- rank 1 ---\nDataMismatchError: The pipeline stages received different training "
                             "batches at batch 5 of epoch 0: rank 1 (stage 1) and rank 0 (stage 0) disagree."), stage1
    # Rank 0 learns it from the last stage's mailbox.
    assert ("PeerFailedError: Pipeline stage 1 failed with DataMismatchError: The pipeline stages received different "
            "training batches at batch 5 of epoch 0") in text.split("--- rank 1 ---")[0]


def exchange_records(rank: int, world: int) -> None:
    """Flushed schedules: the fingerprints ride with the summary (an all-gather), every rank compares."""
    channel = SummaryChannel(rank, world, torch.device("cpu"))
    for t in range(4):
        summary = StepSummary(float(t)) if rank == world - 1 else None
        assert channel.exchange(summary, batch_record(batch(), rank, rank, 0, t, 16, False)).loss == float(t)
    batches = 16 if rank == 0 else 15
    channel.exchange(StepSummary(0.0) if rank == world - 1 else None, batch_record(batch(), rank, rank, 1, 0,
                                                                                   batches, False))


def test_flushed_schedules_compare_on_every_rank():
    with pytest.raises(RankFailedError) as info:
        run_local(exchange_records, 2, timeout=60)
    text = str(info.value)
    for rank in (0, 1):
        part = text.split("--- rank ")[rank + 1]
        assert "DataMismatchError: The pipeline's ranks have unequal numbers of training batches per epoch: rank 0 " \
               "(stage 0) has 16, rank 1 (stage 1) has 15 (epoch 1)." in part, part


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_a_trainer_whose_last_stage_drifts_at_step_5_stops_by_step_5_plus_k(tmp_path):
    # pipedream checks every k = CHECK_EVERY_ASYNC steps: the drift from step 5 is seen in step 8's fingerprints,
    # which the last stage compares at step 8 + stages - 1.
    (tmp_path / "fault_time").write_text("0")
    err, code = run_hang_trainer(tmp_path, {"rank": 1, "at": 5, "how": "drift", "schedule": "pipedream"})
    assert code == 1, err[-4000:]
    checked = next(i for i in range(5, 13) if is_due(i, 16, CHECK_EVERY_ASYNC))
    words = (f"The pipeline stages received different training batches at batch {checked} of epoch 0: rank 1 (stage 1) "
             "and rank 0 (stage 0) disagree. The epoch began with the same batches, so they drifted apart")
    assert f"[rank1]: lightning_pipedream.strategy.reporting.consistency.DataMismatchError: {words}" in err, err[-4000:]
    assert f"[rank0]: lightning_pipedream.runtime.faults.errors.PeerFailedError: Pipeline stage 1 failed with " \
           f"DataMismatchError: {words}" in err, err[-4000:]
    # The last stage finished step checked + stages - 2 at most: within k steps of the drift, and the lag.
    assert int((tmp_path / "ended_rank1").read_text()) <= checked <= 5 + CHECK_EVERY_ASYNC - 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_a_trainer_with_unequal_batch_counts_says_so_on_every_rank(tmp_path):
    (tmp_path / "fault_time").write_text("0")
    err, code = run_hang_trainer(tmp_path, {"rank": 1, "how": "fewer"})
    assert code == 1, err[-4000:]
    for rank in (0, 1):
        assert (f"[rank{rank}]: lightning_pipedream.strategy.reporting.consistency.DataMismatchError: The pipeline's ranks have "
                "unequal numbers of training batches per epoch: rank 0 (stage 0) has 16, rank 1 (stage 1) has 15 "
                "(epoch 0).") in err, err[-4000:]
