"""When one rank fails, make every rank stop with that rank's error instead of "connection closed", and end them all."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_pipedream.runtime.flight import (
    STOP_GRACE,
    PipelineTimeoutError,
    hung_peers,
    is_timeout,
    peer_reports,
    post_error_soon,
    recorder,
    timeout_error,
)
from lightning_pipedream.runtime.mailbox import ANSWERED, GONE, SILENT, mailbox, process_state
from lightning_pipedream.runtime.transport import PeerFailedError, posted_error

log = logging.getLogger("lightning_pipedream")

T = TypeVar("T")


class SetupFailedError(PeerFailedError):
    """Rank 0 failed in a step of setup that it does for every rank (profiling, capture, planning); raised on the
    other ranks with rank 0's reason (see :func:`from_rank_zero`)."""


def failure_reason() -> str | None:
    """The reason a peer left in this rank's mailbox with its stop request, or else in the store, if any."""
    request = mailbox().here("stop")
    if request is not None:
        return str(request.get("message"))
    return posted_error()


def wait_for_posted_error(seconds: float = 2.0) -> str | None:
    """The failing rank posts its error before exiting, but our socket may close first: wait a little."""
    deadline = time.monotonic() + seconds
    while True:
        message = failure_reason()
        if message is not None or time.monotonic() > deadline:
            return message
        time.sleep(0.05)


def end_run(message: str, hung: tuple[int, ...] = (), here: bool = False) -> None:
    """Make sure the whole run ends: leave a stop request with ``message`` in every peer's mailbox (each rank's
    watchdog obeys it, see :meth:`FlightRecorder._obey`), end at once the local peers named in ``hung`` that cannot
    obey (stopped, or not even their mailbox answers), and at this process's exit end the local peers still there
    after the grace. ``here``: this rank's own watchdog obeys it too (it may be stuck in a wait itself)."""
    box = mailbox()
    flight = recorder()
    request = {"rank": flight.rank, "stage": flight.stage, "message": message, "hung": list(hung)}
    if here:
        box.put_here("stop", request, first=True)
    statuses: dict[int, str] = {}
    if box.is_open:
        learner = threading.Thread(target=box.learn_peers, daemon=True)  # a peer may have registered just now
        learner.start()
        learner.join(1.0)
        statuses = box.put_everywhere("stop", request, first=True)
        for rank in hung:
            if box.is_local(rank) and (statuses.get(rank) == SILENT or box.local_state(rank) == "T"):
                _kill(rank, "it is stopped or frozen")
        _end_local_peers_at_exit()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(statuses) < world - 1 or any(status != ANSWERED for status in statuses.values()):
        post_error_soon(message)  # and the store, for peers whose mailbox this rank does not know or reach


def _kill(rank: int, why: str) -> None:
    peer = mailbox().peers[rank]
    if process_state(peer.pid, peer.started) in (None, "Z"):
        return
    log.error("lightning_pipedream: rank %d ends rank %d (process %d on this machine): %s.", recorder().rank, rank,
              peer.pid, why)
    try:
        os.kill(peer.pid, signal.SIGKILL)
    except OSError:
        pass


_ending = [0.0]  # when this process asked its peers to stop (0: it did not)


def _end_local_peers_at_exit() -> None:
    if _ending[0] == 0.0:
        atexit.register(_end_local_peers)
    _ending[0] = time.monotonic()


def _end_local_peers() -> None:
    """At exit: the local peers asked to stop get the grace to end by themselves; those still there then (a thread
    holding the interpreter, a process stopped since) are ended, so that no rank outlives the run. A child process
    of its own waits for them, so that this one exits at once (its closed connections tell the peers to stop)."""
    box = mailbox()
    peers = [(box.peers[r].pid, box.peers[r].started) for r in box.peers if box.is_local(r)]
    if not any(process_state(pid, started) not in (None, "Z") for pid, started in peers):
        return
    deadline = _ending[0] + STOP_GRACE + 2.0
    if os.fork() != 0:
        return
    # The child: only system calls from here on (other threads' locks may have been held at the fork).
    try:
        os.closerange(0, 1024)  # no pipe of the parent's kept open (a caller waits for their end)
        while time.monotonic() < deadline:
            if all(process_state(pid, started) in (None, "Z") for pid, started in peers):
                break
            time.sleep(0.1)
        else:
            for pid, started in peers:
                if process_state(pid, started) not in (None, "Z"):
                    os.kill(pid, signal.SIGKILL)
    finally:
        os._exit(0)


def _stage_words(stage: int | None) -> str:
    return "" if stage is None else f", stage {stage}"


def _unexplained(stage: int | None) -> str:
    """The words for a peer that closed its connections without leaving a reason: which ranks are gone or silent."""
    flight = recorder()
    current = flight.current
    world = len(mailbox().peers) + 1
    ranks = list(current.peers) if current is not None and current.peers else [r for r in range(world)
                                                                               if r != flight.rank]
    reports = peer_reports(ranks)
    gone = [r for r, (status, _) in reports.items() if status == GONE]
    silent = [r for r, (status, _) in reports.items() if status == SILENT]
    words = []
    for rank in gone:
        peer = mailbox().peers.get(rank)
        words.append(f"rank {rank}{_stage_words(peer.stage if peer else None)} ended without reporting an error: it "
                     "was killed (SIGKILL, the out-of-memory killer) or crashed outside Python; look at its log and "
                     "the system's (dmesg) for why")
    for rank in silent:
        peer = mailbox().peers.get(rank)
        words.append(f"rank {rank}{_stage_words(peer.stage if peer else None)} does not answer (stopped, frozen "
                     "or unreachable)")
    if not words:
        return ""
    return (f"Pipeline communication failed: {'; '.join(words)} (this rank, {flight.rank}{_stage_words(stage)}, "
            "stopped because of it)")


@contextmanager
def pipeline_failures(stage: int | None, waiting: str | None = None, peers: tuple[int, ...] = (),
                      during: str = "") -> Iterator[None]:
    """Around a rank's pipeline work: post this rank's own errors; name the peer's error when a peer failed.

    A communication error (the peer's sockets closed) becomes a :class:`PeerFailedError` that
    carries the message the failing rank posted, when it posted one, or else says which peer is gone. A timed-out
    wait becomes a :class:`PipelineTimeoutError` that names the peer waited for and what it last reported.
    ``waiting`` names a wait run inside (e.g. "the step summary's broadcast") for those words, ``peers`` the global
    ranks it waits for (none: a collective of the pipeline's ranks); ``stage`` is
    this rank's stage (None: not a stage's work, e.g. a checkpoint's gather); ``during`` goes into this rank's own
    failure's words (``" in setup"``). Every failure leaves a stop request in
    every peer's mailbox (:func:`end_run`), so that no rank outlives the run, and writes this rank's flight
    recorder (its last actions) to a file.
    """
    flight = recorder()
    flight.start_heartbeat(stage)
    where = f" (stage {stage})" if stage is not None else f" (rank {flight.rank})"
    # The except clauses run inside the mark, so that a timeout's words name this wait.
    with flight.waiting(f"{waiting}{where}", peers) if waiting is not None else nullcontext():
        try:
            yield
        except (PipelineTimeoutError, SetupFailedError):  # explained already, on every rank
            raise
        except (PeerFailedError, RuntimeError) as err:
            # DistStoreError: a store wait (a group being made) ran out, e.g. for a rank that stopped before it.
            timed_out = is_timeout(err) or isinstance(err, dist.DistStoreError)
            if not (timed_out or _is_communication_error(err)):
                end_run(_own_failure(stage, err, during))
                _record(err)
                raise
            # A peer that failed first left its reason here (this wait may have timed out because of it).
            cause = failure_reason() if timed_out else wait_for_posted_error()
            if cause is None and timed_out:
                current = flight.current
                timeout = timeout_error(err, current)
                end_run(str(timeout), hung=hung_peers(current))
                raise timeout from err
            if cause is None:
                cause = _unexplained(stage)
                if not cause:
                    _record(err)
                    raise
                end_run(cause)
                _record(err, cause)
                raise PeerFailedError(cause) from err
            _record(err, cause)
            raise PeerFailedError(f"{cause} (this rank, {flight.rank}{_stage_words(stage)}, stopped because of it)"
                                  ) from err
        except Exception as err:
            end_run(_own_failure(stage, err, during))
            _record(err)
            raise


def _own_failure(stage: int | None, err: BaseException, during: str = "") -> str:
    flight = recorder()
    what = f"Pipeline stage {stage}" if stage is not None else f"Rank {flight.rank}"
    return f"{what} failed{during} with {type(err).__name__}: {err} (on rank {flight.rank})"


@contextmanager
def setup_failures() -> Iterator[None]:
    """Around a rank's part of setup (before its stage is known): as :func:`pipeline_failures` does in training,
    this rank's own error reaches every peer (``Rank 0 failed in setup with ...``), and a wait that fails because a
    peer failed raises :class:`PeerFailedError` with that peer's reason and rank, never gloo's "connection closed"."""
    if not dist.is_initialized() or dist.get_world_size() == 1:  # no peer to tell or to wait for
        yield
        return
    with pipeline_failures(None, waiting="setup", during=" in setup"):
        yield


def from_rank_zero(what: str, compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0 and its result on every rank: rank 0 broadcasts the result, or the words of the error
    ``compute`` raised (then raised on rank 0 as it was). The other ranks, waiting in that broadcast, return the
    result or raise :class:`SetupFailedError` with rank 0's reason at once, rather than a closed connection when
    rank 0 exits. ``what`` says what rank 0 does, for those words (``"profile the layers to plan the stages"``).

    Every rank of the default process group calls it at the same point; in one process it is ``compute()``.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    rank = dist.get_rank()
    failure: Exception | None = None
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload = [(True, compute())]
        except Exception as err:  # noqa: BLE001 - every rank must learn why, not only rank 0
            failure, payload = err, [(False, f"{type(err).__name__}: {err}")]
    with pipeline_failures(None, waiting=f"rank 0's work to {what}", peers=(0,)) if rank else nullcontext():
        dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    done, value = payload[0]
    if not done:
        raise SetupFailedError(f"Rank 0 could not {what}, so this rank stops too. Rank 0's error: {value} (on rank "
                               f"0; this rank is rank {rank})")
    return value


def report_failure(err: BaseException, stage: int | None) -> None:
    """For an error raised outside the pipeline's work (a callback, a checkpoint's write): tell every peer why this
    rank stops, unless a pipeline failure already did (call it from the strategy's ``on_exception``)."""
    if isinstance(err, PeerFailedError) or getattr(err, "_flight_recorded", False) or isinstance(
            err, (KeyboardInterrupt, SystemExit)):
        return
    request = mailbox().here("stop")  # the store only after a closed connection: its host may be stopped
    cause = str(request.get("message")) if request is not None else (
        wait_for_posted_error() if _is_communication_error(err) else None)
    if cause is not None:  # a peer failed first: this error follows from it; say which and why
        log.error("lightning_pipedream: rank %d stops because another rank failed first: %s", recorder().rank, cause)
        return
    end_run(_own_failure(stage, err))
    _record(err)


def _record(err: BaseException, cause: str | None = None) -> None:
    """Write the flight recorder for ``err``, once, and say where in the log."""
    if getattr(err, "_flight_recorded", False):
        return
    path = recorder().dump(cause or f"{type(err).__name__}: {err}")
    try:
        err._flight_recorded = True  # type: ignore[attr-defined]
    except AttributeError:
        pass
    if path is not None:
        log.warning("Rank %d's last pipeline actions are in %s (python -m lightning_pipedream show --trace %s).",
                    recorder().rank, path, path)


def _is_communication_error(err: BaseException) -> bool:
    text = str(err)
    # DistNetworkError: the store's host (rank 0) is gone, e.g. while a group is being made in setup.
    return (isinstance(err, (PeerFailedError, dist.DistNetworkError)) or "Connection closed" in text
            or "Connection reset" in text)
