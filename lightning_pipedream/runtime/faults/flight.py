"""Each rank's flight recorder (its last actions and what it waits for), and the words for a hung peer."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from lightning_pipedream.runtime.faults.errors import PeerFailedError, default_store, post_error
from lightning_pipedream.runtime.faults.mailbox import ANSWERED, GONE, SILENT, mailbox
from lightning_pipedream.schedule.actions import Action, Op

log = logging.getLogger("lightning_pipedream")

DIRECTORY_ENV = "LIGHTNING_PIPEDREAM_FLIGHT_RECORDER"  # where the flight-recorder files go
NO_PROGRESS_ENV = "LIGHTNING_PIPEDREAM_NO_PROGRESS_WARNING"  # seconds a wait may last before a warning; 0: never
FROZEN_ENV = "LIGHTNING_PIPEDREAM_FROZEN_PEER"  # seconds of waiting on a frozen peer before the run is ended; 0: never
DEFAULT_DIRECTORY = "pipedream_flight_recorder"  # under the current working directory
DEFAULT_NO_PROGRESS = 60.0
DEFAULT_FROZEN = 120.0
STOP_GRACE = 10.0  # seconds a rank asked to stop has to end by itself (raising its error) before its watchdog ends it
HUNG_GRACE = 1.0  # the same for the rank the stop request names as hung: it prints why, then ends
SIZE = 512  # actions each rank keeps
HEARTBEAT = 1.0  # seconds between a rank's reports in the store
REPORT_KEY = "lightning_pipedream/report/"  # + global rank
_STORE_WAIT = 2.0  # seconds an error path waits for the store (its host may be the stopped rank)

TIMEOUT_ADVICE = (
    "To wait longer, raise the timeout: PipeDreamStrategy(timeout=timedelta(minutes=60)) under Lightning, or the "
    "timeout of the Pipeline's process group (dist.init_process_group(..., timeout=timedelta(minutes=60)))."
)


class PipelineTimeoutError(PeerFailedError):
    """A pipeline wait ran out of time: the message names the peer waited for, what it last reported, and the fix."""


def _op_words(action: Action, unit: str = "minibatch") -> str:
    """``"RECV_GRAD of minibatch 410 from stage 1"``-like words for an action."""
    text = action.op.name
    if action.microbatch is not None:
        text += f" of {unit} {action.microbatch}"
    if action.op is Op.RECV_ACT:
        text += f" from stage {action.stage - 1}"
    elif action.op is Op.RECV_GRAD:
        text += f" from stage {action.stage + 1}"
    elif action.op is Op.SEND_ACT:
        text += f" to stage {action.stage + 1}"
    elif action.op is Op.SEND_GRAD:
        text += f" to stage {action.stage - 1}"
    return text


class Current:
    """The action or wait in progress; its words are made only when asked for (an action costs ~1 us here)."""

    __slots__ = ("_what", "peers", "start", "action", "step", "unit")

    def __init__(self, what: str | None, peers: tuple[int, ...], start: float, action: Action | None = None,
                 step: int = 0, unit: str = "minibatch") -> None:
        self._what, self.peers, self.start, self.action, self.step, self.unit = what, peers, start, action, step, unit

    @property
    def what(self) -> str:
        """E.g. ``"step 3: RECV_GRAD of minibatch 3 from stage 1 (rank 1)"``."""
        if self._what is None:
            assert self.action is not None
            peer = "" if not self.peers else f" (rank {self.peers[0]})"
            self._what = f"step {self.step}: {_op_words(self.action, self.unit)}{peer}"
        return self._what


class FlightRecorder:
    """This process's last :data:`SIZE` actions as ``(action, start, end)`` and the one in progress.

    Always on: an append to a bounded deque per action. :meth:`dump` writes them as a Chrome trace
    (the format of :func:`~lightning_pipedream.schedule.timeline.to_chrome_trace`), times in seconds
    since the epoch so that the files of several ranks line up.
    """

    def __init__(self, size: int = SIZE) -> None:
        self.recent: deque[tuple[Action, float, float]] = deque(maxlen=size)
        self.current: Current | None = None
        self.rank = 0
        self.step = 0  # the training step running (set by the engine)
        self.unit = "minibatch"  # what the actions' numbers count: "minibatch" or "micro-batch"
        self._epoch = time.time() - time.perf_counter()
        self.stage: int | None = None  # this rank's stage (its first, several under interleaved), once known

    def begin(self, action: Action, peer: int | None = None) -> None:
        """``action`` starts; ``peer`` is the global rank it waits for, if any."""
        self.current = Current(None, () if peer is None else (peer,), time.perf_counter(), action, self.step,
                                self.unit)

    def end(self, action: Action, start: float, end: float) -> None:
        self.recent.append((action, start, end))
        self.current = None

    @contextmanager
    def waiting(self, what: str, peers: tuple[int, ...] = ()) -> Iterator[Current]:
        """Marks a wait outside the actions (a collective, the step's sends) for the reports and errors."""
        outer = self.current
        self.current = marker = Current(f"step {self.step}: {what}", peers, time.perf_counter(), None)
        try:
            yield marker
        finally:
            self.current = outer

    def doing(self) -> str:
        """What this rank is doing now, in words."""
        now = time.perf_counter()
        current = self.current
        if current is not None:
            return f"{current.what} (for {now - current.start:.1f} s)"
        if self.recent:
            action, _, end = self.recent[-1]
            return (f"between actions; its last, in step {self.step}: {_op_words(action, self.unit)}, "
                    f"ended {now - end:.1f} s before")
        return "nothing yet in the pipeline"

    # -- the file -------------------------------------------------------------------------------------
    def trace(self, error: str = "") -> dict:
        """The recent actions (and the unfinished one, ``args.unfinished``) as a Chrome trace."""
        from lightning_pipedream.schedule.timeline import TimedAction, to_chrome_trace

        events = [TimedAction(self.rank, a, self._epoch + s, self._epoch + e) for a, s, e in self.recent]
        current = self.current
        if current is not None and current.action is not None:
            events.append(TimedAction(self.rank, current.action, self._epoch + current.start,
                                      self._epoch + time.perf_counter()))
        trace = to_chrome_trace(events)
        if current is not None and current.action is not None:
            trace["traceEvents"][-1]["args"]["unfinished"] = True
        stage = current.action.stage if current is not None and current.action is not None else (
            self.recent[-1][0].stage if self.recent else None)
        trace["otherData"] = {"rank": self.rank, "stage": stage, "doing": self.doing(), "error": error}
        return trace

    def dump(self, error: str = "") -> Path | None:
        """Write :meth:`trace` to ``<directory>/rank<R>.json``; returns the path (None if it could not be written)."""
        directory = Path(os.environ.get(DIRECTORY_ENV) or Path.cwd() / DEFAULT_DIRECTORY)
        path = directory / f"rank{self.rank}.json"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.trace(error)))
        except OSError as err:
            log.warning("The flight recorder could not write %s (%s); set %s to a writable directory.",
                        path, err, DIRECTORY_ENV)
            return None
        return path

    def report(self) -> dict:
        return {"time": time.time(), "doing": self.doing(), "stage": self.stage}

_RECORDER = FlightRecorder()


def _after_fork_in_child() -> None:
    # A forked child (run_local, multiprocessing) is another rank: nothing of the parent's recorder is its.
    global _RECORDER
    _RECORDER = FlightRecorder()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def recorder() -> FlightRecorder:
    """This process's flight recorder."""
    return _RECORDER


def no_progress_limit() -> float:
    """Seconds a pipeline wait may last before the watchdog warns (``LIGHTNING_PIPEDREAM_NO_PROGRESS_WARNING``)."""
    try:
        return float(os.environ.get(NO_PROGRESS_ENV, DEFAULT_NO_PROGRESS))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %s.", NO_PROGRESS_ENV, os.environ[NO_PROGRESS_ENV],
                    DEFAULT_NO_PROGRESS)
        return DEFAULT_NO_PROGRESS


def frozen_limit() -> float:
    """Seconds a wait on a stopped or frozen peer lasts before the watchdog ends the run
    (``LIGHTNING_PIPEDREAM_FROZEN_PEER``; 0: only the timeout ends it)."""
    try:
        return float(os.environ.get(FROZEN_ENV, DEFAULT_FROZEN))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %s.", FROZEN_ENV, os.environ[FROZEN_ENV], DEFAULT_FROZEN)
        return DEFAULT_FROZEN


def post_error_soon(message: str) -> None:
    """:func:`post_error`, waiting at most a few seconds (the store's host may be the stopped rank)."""
    poster = threading.Thread(target=post_error, args=(message,), daemon=True)
    poster.start()
    poster.join(_STORE_WAIT)


def peer_reports(ranks: list[int]) -> dict[int, tuple[str, dict | None]]:
    """What each of ``ranks`` last reported, asked of its mailbox, with what the mailbox did (``ANSWERED``,
    ``SILENT``: stopped or frozen, ``GONE``: ended); for a rank whose mailbox did not answer, its last report in the
    process group's store. Waits at most a few seconds (the store's host may be the stopped rank)."""
    box = mailbox()
    asked: dict[int, tuple[str, dict | None]] = {}

    def ask(rank: int) -> None:
        asked[rank] = box.ask(rank, "report")

    askers = [threading.Thread(target=ask, args=(r,), daemon=True) for r in ranks if r in box.peers]
    for t in askers:
        t.start()
    for t in askers:
        t.join(1.5)
    missing = [r for r in ranks if asked.get(r, (SILENT, None))[0] != ANSWERED]
    stored: dict[int, dict] = {}

    def read() -> None:
        store = default_store()
        for rank in missing:
            key = REPORT_KEY + str(rank)
            try:
                if store is not None and store.check([key]):
                    stored[rank] = json.loads(store.get(key).decode())
            except Exception:
                return

    if missing:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(_STORE_WAIT)
    out: dict[int, tuple[str, dict | None]] = {}
    for rank in ranks:
        status, report = asked.get(rank, (SILENT, None))
        out[rank] = (status, report if status == ANSWERED else stored.get(rank))
    return out


def stage_words(stage: int | None) -> str:
    return "" if stage is None else f" (stage {stage})"


def _peer_stage(rank: int, report: dict | None) -> int | None:
    if report is not None and report.get("stage") is not None:
        return report["stage"]
    peer = mailbox().peers.get(rank)
    return peer.stage if peer is not None else None


def _report_words(rank: int, status: str, report: dict | None) -> str:
    who = f"rank {rank}{stage_words(_peer_stage(rank, report))}"
    if status == GONE:
        return f"{who} has ended (nothing listens at its mailbox)"
    if report is None:
        return f"{who} has not reported (it may not have reached the pipeline, or the store did not answer)"
    age = time.time() - float(report["time"])
    text = f"{who} last reported {age:.1f} s ago: {report['doing']}"
    if status == ANSWERED:
        text += " - it answers, so it is running (busy, or waiting itself)"
    elif age > 3 * HEARTBEAT + 1:
        text += " - it has stopped reporting, so it is stopped, frozen or killed (not merely waiting)"
    return text


def hang_message(current: Current | None, waited: float, warning: bool = False, error: str = "",
                 frozen: list[int] | None = None) -> str:
    """Which rank waits for whom, doing what, for how long; what the peers last reported; how to wait longer.
    ``frozen``: the peers found stopped or frozen, for which the run ends before its timeout."""
    rec = _RECORDER
    head = f"rank {rec.rank}, {current.what}" if current is not None else f"rank {rec.rank}: {rec.doing()}"
    if warning:
        text = f"No progress: {head} has waited {waited:.0f} s"
    elif frozen:
        text = f"Pipeline stopped: {head} has waited {waited:.0f} s"
    else:
        text = f"Pipeline timeout: {head} got no answer within {waited:.1f} s"
        if error:
            found = re.search(r"Timed out waiting[^)\]\n]*", error)  # gloo's own words
            text += f" ({found.group(0) if found else error.strip().splitlines()[0][:200]})"
    if current is not None and current.peers:
        peers = list(current.peers)
        text += "."
    else:
        world = dist.get_world_size() if dist.is_initialized() else 1
        peers = [r for r in range(world) if r != rec.rank]
        text += ", in a collective of the pipeline's ranks."
    if peers:
        reports = peer_reports(peers)
        words = "; ".join(_report_words(r, *reports[r]) for r in peers)
        text += " " + words[:1].upper() + words[1:] + "."
    if warning:
        text += (f" The watchdog ends the run if that rank is stopped or frozen after {frozen_limit():.0f} s "
                 f"({FROZEN_ENV}=seconds), the hard timeout otherwise; this warning comes after "
                 f"{no_progress_limit():.0f} s ({NO_PROGRESS_ENV}=seconds, 0 to turn it off).")
    elif frozen:
        text += (f" Rank{'s' if len(frozen) > 1 else ''} {', '.join(map(str, frozen))} "
                 f"{'are' if len(frozen) > 1 else 'is'} stopped (SIGSTOP, a debugger) or frozen (not even its "
                 f"mailbox answers), so the run is ended now rather than at the timeout ({FROZEN_ENV}=seconds, "
                 "0 to wait for the timeout).")
    return text


def hung_peers(current: Current | None, reports: dict[int, tuple[str, dict | None]] | None = None) -> tuple[int, ...]:
    """The peers a timed-out wait blames: those it waited for, or in a collective those that do not answer."""
    if current is not None and current.peers:
        return tuple(current.peers)
    if reports is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        reports = peer_reports([r for r in range(world) if r != _RECORDER.rank])
    return tuple(r for r, (status, _) in reports.items() if status != ANSWERED)


def timeout_error(err: BaseException, current: Current | None) -> PipelineTimeoutError:
    """A :class:`PipelineTimeoutError` for the timed-out wait ``current``; the flight recorder is written and named
    in it."""
    rec = _RECORDER
    waited = time.perf_counter() - current.start if current is not None else float("nan")
    message = hang_message(current, waited, error=str(err))
    path = rec.dump(message)
    if path is not None:
        message += (f" This rank's last {len(rec.recent)} actions are in {path} "
                    f"(python -m lightning_pipedream show --trace {path}).")
    message += " " + TIMEOUT_ADVICE
    return PipelineTimeoutError(message)


def is_timeout(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) is a communication timeout."""
    while err is not None:
        if "timed out" in str(err).lower():
            return True
        err = err.__cause__  # type: ignore[assignment]
    return False
