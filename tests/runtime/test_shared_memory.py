"""The shared-memory transport: a ring's order, wrap-around and waits in one process, then two ranks through it."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from lightning_pipedream.runtime.communication.shared_memory import Ring, RingClosedError, Sender, supported
from lightning_pipedream.runtime.communication.transport import PeerFailedError, Transport, transport_kind
from lightning_pipedream.runtime.faults.launch import run_local
from lightning_pipedream.runtime.pipeline import Pipeline

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not supported(), reason="shared-memory rings need x86-64 Linux and /dev/shm")]


def message(size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def pair(capacity: int) -> tuple[Ring, Ring]:
    """The writer's ring and the reader's mapping of it (two mappings, as in two processes)."""
    writer = Ring.create(capacity)
    reader = Ring.open(writer.path)
    reader.unlink()
    return writer, reader


def test_messages_arrive_in_order_across_wrap_around_and_larger_than_the_ring():
    writer, reader = pair(1000)
    sizes = [1, 999, 1000, 1001, 2500, 7, 640, 3333, 64]
    sender = Sender(writer, check=lambda: None, timeout=10.0)
    works = [sender.send(message(n, i)) for i, n in enumerate(sizes)]  # never blocks, though the ring is full
    got = []
    for n in sizes:
        out = torch.empty(n, dtype=torch.uint8)
        reader.read_into(out, timeout=10)
        got.append(out)
    for work in works:
        sender.wait(work, 10.0)
    for i, (n, out) in enumerate(zip(sizes, got)):
        assert torch.equal(out, message(n, i))
    assert not os.path.exists(writer.path)  # the name is gone once the reader has the ring mapped


def test_a_send_that_does_not_fit_returns_at_once_and_completes_when_read():
    writer, reader = pair(4096)
    sender = Sender(writer, check=lambda: None, timeout=10.0)
    work = sender.send(message(100_000, 1))
    assert not work.is_completed()  # it returned before anything read it (a blocking send would hang here)
    out = torch.empty(100_000, dtype=torch.uint8)
    reader.read_into(out, timeout=10)
    sender.wait(work, 10.0)
    assert work.is_completed() and torch.equal(out, message(100_000, 1))


def test_a_sleeping_reader_wakes_for_the_message():
    writer, reader = pair(4096)
    threading.Timer(0.3, lambda: writer.write(message(10, 2))).start()
    out = torch.empty(10, dtype=torch.uint8)
    start = time.monotonic()
    reader.read_into(out, timeout=10)
    assert 0.25 < time.monotonic() - start and torch.equal(out, message(10, 2))  # it slept, then woke for it


def test_a_wait_ends_when_its_check_raises_or_its_deadline_passes():
    _, reader = pair(4096)
    out = torch.empty(10, dtype=torch.uint8)
    calls = []

    def peer_gone() -> None:
        calls.append(1)
        if len(calls) >= 3:
            raise PeerFailedError("the peer is gone")

    with pytest.raises(PeerFailedError, match="the peer is gone"):
        reader.read_into(out, check=peer_gone)
    assert len(calls) == 3
    with pytest.raises(RingClosedError, match="Timed out waiting 200ms for recv operation to complete"):
        reader.read_into(out, timeout=0.2)


def test_a_message_written_just_before_its_writer_ended_is_read_not_refused():
    # A rank that sends its last message and exits at once: the reader, woken by that message after a long sleep,
    # reads it rather than first asking whether the writer is alive (it is not). This failed a rank of run_local in
    # CI runs A, L, AA and AD ("rank 1 ended without reporting an error" while its message sat in the ring).
    writer, reader = pair(4096)
    gone = threading.Event()

    def peer_gone() -> None:
        if gone.is_set():
            raise PeerFailedError("the peer is gone")

    def write_and_end() -> None:
        gone.set()  # the writer's process has ended by the time the reader looks
        writer.write(message(10, 3))

    threading.Timer(0.08, write_and_end).start()  # after more than half the reader's poll: it looks after waking
    out = torch.empty(10, dtype=torch.uint8)
    reader.read_into(out, check=peer_gone, timeout=10)
    assert torch.equal(out, message(10, 3))
    with pytest.raises(PeerFailedError, match="the peer is gone"):  # and with nothing more to read, it gives up
        reader.read_into(out, check=peer_gone, timeout=10)


def test_a_closed_ring_ends_the_readers_wait():
    writer, reader = pair(4096)
    writer.close()
    with pytest.raises(RingClosedError, match="closed its link"):
        reader.read_into(torch.empty(1, dtype=torch.uint8), timeout=5)


def test_an_unknown_transport_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"transport='tcp' is not a transport: use 'auto' \(shared memory between "
                                         r"ranks on one machine, torch.distributed otherwise\), 'gloo'"):
        transport_kind("tcp")


def exchange(rank: int, world: int, kind: str) -> tuple[bool, list[list[float]]]:
    # Both ranks send before they receive, trees change shape, and a tree is larger than the ring.
    transport = Transport(kind=kind)
    peer = 1 - rank
    sums = []
    for i, n in enumerate([3, 3, 5000, 7, 300_000, 7]):
        tree = {"x": torch.full((n,), float(rank * 100 + i)), "y": (torch.arange(i + 1.0),)}
        transport.send(tree, peer, channel="a")
        got = transport.recv(peer, channel="a")
        sums.append([float(got["x"].sum()), float(got["y"][0].sum()), float(got["x"].numel())])
    transport.post_recv(peer, channel="b")  # posted ahead, as the executor does
    transport.send(torch.ones(4) * rank, peer, channel="b")
    sums.append([float(transport.recv(peer, channel="b").sum())])
    transport.wait_all()
    return transport.uses_shared_memory, sums


def test_two_ranks_exchange_trees_through_shared_memory_as_through_gloo(monkeypatch):
    monkeypatch.setenv("LIGHTNING_PIPEDREAM_SHM_RING_BYTES", "65536")  # the 1.2 MB tree goes in pieces
    shm = run_local(exchange, 2, "auto", timeout=60)
    gloo = run_local(exchange, 2, "gloo", timeout=60)
    assert [used for used, _ in shm] == [True, True] and [used for used, _ in gloo] == [False, False]
    assert [sums for _, sums in shm] == [sums for _, sums in gloo]
    from_rank_1 = shm[0][1]
    assert from_rank_1[4][1:] == [10.0, 300_000.0] and from_rank_1[-1] == [4.0]


def receive_from_a_peer_that_ends(rank: int, world: int) -> tuple[str, float] | None:
    transport = Transport()
    if rank == 1:
        transport.send(torch.ones(3), 0)  # the link exists; then this rank ends without another message
        transport.wait_all()
        return None
    transport.recv(1)
    start = time.monotonic()
    try:
        transport.recv(1)
    except PeerFailedError as err:
        return str(err), time.monotonic() - start
    return "no error", 0.0


def test_a_receive_from_a_rank_that_ended_fails_within_a_second():
    text, waited = run_local(receive_from_a_peer_that_ends, 2, timeout=60)[0]
    assert "Pipeline communication with rank 1 failed: its process" in text and "has ended" in text
    assert waited > 0.0 and "Timed out" not in text  # the liveness check answered, not the pipeline's timeout


def train_two_stages(rank: int, world: int, transport: str) -> tuple[bool, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    pipe = Pipeline(model, loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    schedule="gpipe", chunks=2, transport=transport)
    for x, y in two_batches():
        pipe.step(x, y)
    return pipe.transport.uses_shared_memory, [p.detach().clone() for p in pipe.module.parameters()]


def two_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(2)]


def test_a_pipeline_over_shared_memory_equals_one_over_gloo_and_one_process():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in two_batches():  # gpipe: one update per batch on the mean loss, as one process on the whole batch
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    shm = run_local(train_two_stages, 2, "auto", timeout=60)
    gloo = run_local(train_two_stages, 2, "gloo", timeout=60)
    assert [used for used, _ in shm] == [True, True] and [used for used, _ in gloo] == [False, False]
    for (_, a), (_, b) in zip(shm, gloo):
        assert all(torch.equal(p, q) for p, q in zip(a, b))  # the same bytes arrive: the same floats
    got = [p for _, params in shm for p in params]
    for p, want in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(p, want.detach(), rtol=1e-6, atol=1e-7)


def test_a_full_dev_shm_is_named_with_what_to_do(monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RingClosedError, match=r"No room for a 64 KiB shared-memory ring in /dev/shm \(No space left on "
                                              r"device\)\. Free space there .*LIGHTNING_PIPEDREAM_TRANSPORT=gloo"):
        Ring.create(64 << 10)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"lightning_pipedream-{os.getpid()}-")]
