"""BatchShares: which piece of a batch each micro-batch is and how much its loss counts, checked by hand."""

from __future__ import annotations

import pytest
import torch

from lightning_pipedream.runtime.execution.shares import BatchShares
from lightning_pipedream.schedule.actions import Layout


def test_chunks_cut_the_batch_in_order_and_weigh_by_size() -> None:
    batch = torch.arange(10.0)
    shares = BatchShares.of(batch, chunks=3)
    assert [p.tolist() for p in shares.parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [shares.piece(m) for m in range(3)] == [0, 1, 2]
    assert [shares.weight(m) for m in range(3)] == [0.4, 0.3, 0.3]
    # the asynchronous schedules number micro-batches on across steps
    assert shares.part(4).tolist() == [4, 5, 6] and shares.weight(5) == 0.3
    assert sum(shares.weight(m) for m in range(3)) == pytest.approx(1.0)


def test_one_chunk_is_the_whole_batch_with_weight_one() -> None:
    batch = {"x": torch.ones(5, 2), "y": torch.zeros(5)}
    shares = BatchShares.of(batch, chunks=1)
    assert shares.parts == (batch,) and shares.weight(7) == 1.0 and shares.total == 5


@pytest.mark.parametrize("replicas", [(2, 1), (3, 1), (2, 2, 1)])
def test_replicated_input_stage_reads_shard_m_mod_d_and_chunk_m_div_d(replicas: tuple[int, ...]) -> None:
    layout = Layout(replicas)
    d, chunks = layout.input_replicas, 2
    batch = torch.arange(float(d * chunks * 3))  # every piece 3 samples
    shares = BatchShares.of(batch, chunks, shards=d)
    shards = batch.chunk(d)
    for m in range(d * chunks):
        shard = layout.shard_of(m)
        assert torch.equal(shares.part(m), shards[shard].chunk(chunks)[m // d])
        assert shares.weight(m) == pytest.approx(1 / (d * chunks))


def test_minibatch_updates_count_each_shard_fully() -> None:
    shares = BatchShares.of(torch.arange(6.0), chunks=1, shards=2, minibatch_updates=True)
    assert [p.tolist() for p in shares.parts] == [[0, 1, 2], [3, 4, 5]]
    assert [shares.weight(m) for m in range(2)] == [1.0, 1.0]
    assert [shares.share(m) for m in range(2)] == [0.5, 0.5]
