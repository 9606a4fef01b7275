"""When one rank fails, make every rank stop with that rank's error instead of "connection closed", and end them all."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_pipedream.runtime.faults.ending import end_run, exit_without_final_collections
from lightning_pipedream.runtime.faults.errors import PeerFailedError, posted_error
from lightning_pipedream.runtime.faults.flight import (
    PipelineTimeoutError,
    hung_peers,
    is_timeout,
    peer_reports,
    recorder,
    timeout_error,
)
from lightning_pipedream.runtime.faults.mailbox import GONE, SILENT, mailbox
from lightning_pipedream.runtime.faults.watchdog import watchdog

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


def _stage_clause(stage: int | None) -> str:
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
        words.append(f"rank {rank}{_stage_clause(peer.stage if peer else None)} ended without reporting an error: it "
                     "was killed (SIGKILL, the out-of-memory killer) or crashed outside Python; look at its log and "
                     "the system's (dmesg) for why")
    for rank in silent:
        peer = mailbox().peers.get(rank)
        words.append(f"rank {rank}{_stage_clause(peer.stage if peer else None)} does not answer (stopped, frozen "
                     "or unreachable)")
    if not words:
        return ""
    return (f"Pipeline communication failed: {'; '.join(words)} (this rank, {flight.rank}{_stage_clause(stage)}, "
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
    watchdog().start(stage)
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
            # The peer's reason is the whole story: the closed connection or the cut-short wait that brought it here
            # follows from it, and printed first (as a chained cause) it would read as this rank's error. The
            # flight recorder keeps this rank's last actions.
            raise PeerFailedError(f"{cause} (this rank, {flight.rank}{_stage_clause(stage)}, stopped because of it)"
                                  ) from None
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
    exit_without_final_collections()
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
    """Write the flight recorder for ``err``, once, and say where in the log; the process exits promptly."""
    exit_without_final_collections()
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
