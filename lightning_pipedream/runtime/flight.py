"""Each rank's flight recorder (its last actions), its heartbeat in the store, and the words for a hung peer."""

from __future__ import annotations

import atexit
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
from typing import Any

import torch.distributed as dist

from lightning_pipedream.runtime.transport import PeerFailedError, post_error
from lightning_pipedream.schedule.actions import Action, Op

log = logging.getLogger("lightning_pipedream")

DIRECTORY_ENV = "LIGHTNING_PIPEDREAM_FLIGHT_RECORDER"  # where the flight-recorder files go
NO_PROGRESS_ENV = "LIGHTNING_PIPEDREAM_NO_PROGRESS_WARNING"  # seconds a wait may last before a warning; 0: never
DEFAULT_DIRECTORY = "pipedream_flight_recorder"  # under the current working directory
DEFAULT_NO_PROGRESS = 300.0
SIZE = 512  # actions each rank keeps
HEARTBEAT = 1.0  # seconds between a rank's reports in the store
_REPORT_KEY = "lightning_pipedream/report/"  # + global rank
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


class _Current:
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
        self.current: _Current | None = None
        self.rank = 0
        self.step = 0  # the training step running (set by the engine)
        self.unit = "minibatch"  # what the actions' numbers count: "minibatch" or "micro-batch"
        self._epoch = time.time() - time.perf_counter()
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned: _Current | None = None

    def begin(self, action: Action, peer: int | None = None) -> None:
        """``action`` starts; ``peer`` is the global rank it waits for, if any."""
        self.current = _Current(None, () if peer is None else (peer,), time.perf_counter(), action, self.step,
                                self.unit)

    def end(self, action: Action, start: float, end: float) -> None:
        self.recent.append((action, start, end))
        self.current = None

    @contextmanager
    def waiting(self, what: str, peers: tuple[int, ...] = ()) -> Iterator[_Current]:
        """Marks a wait outside the actions (a collective, the step's sends) for the reports and errors."""
        outer = self.current
        self.current = marker = _Current(f"step {self.step}: {what}", peers, time.perf_counter(), None)
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

    # -- the heartbeat and the no-progress watchdog ----------------------------------------------------
    def start_heartbeat(self) -> None:
        """Once per process group (called by every pipeline_failures): report :meth:`doing` to the store every second,
        and warn when one wait lasts longer than the no-progress limit."""
        if not dist.is_initialized():
            return
        self.rank = dist.get_rank()
        if self._heartbeat is not None and self._heartbeat.is_alive():
            return
        if self._heartbeat is None:
            # Stop it before the interpreter (and torch's store) goes away: a thread killed inside a store call
            # at exit aborts the process ("terminate called without an active exception").
            atexit.register(self.stop_heartbeat)
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="lightning_pipedream-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread and wait a little for it to leave the store."""
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat.is_alive():
            self._heartbeat.join(timeout=3)

    def _beat(self) -> None:
        limit = no_progress_limit()
        while not self._stop.is_set():
            store = _default_store()
            if store is None:
                return
            try:
                store.set(_REPORT_KEY + str(self.rank), json.dumps({"time": time.time(), "doing": self.doing()}))
            except Exception:  # the store is gone: the run is over
                return
            current = self.current
            if (limit > 0 and current is not None and current.peers and current is not self._warned
                    and time.perf_counter() - current.start > limit):
                self._warned = current
                log.warning("%s", hang_message(current, time.perf_counter() - current.start, warning=True))
            if self._stop.wait(HEARTBEAT):
                return


_RECORDER = FlightRecorder()


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


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def post_error_soon(message: str) -> None:
    """:func:`post_error`, waiting at most a few seconds (the store's host may be the stopped rank)."""
    poster = threading.Thread(target=post_error, args=(message,), daemon=True)
    poster.start()
    poster.join(_STORE_WAIT)


def peer_reports(ranks: list[int]) -> dict[int, dict]:
    """The last report of each of ``ranks`` from the store, waiting at most a few seconds (the store's host may be
    the stopped rank); a rank missing from the result did not report or could not be read."""
    reports: dict[int, dict] = {}

    def read() -> None:
        store = _default_store()
        for rank in ranks:
            key = _REPORT_KEY + str(rank)
            try:
                if store is not None and store.check([key]):
                    reports[rank] = json.loads(store.get(key).decode())
            except Exception:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(_STORE_WAIT)
    return dict(reports)


def _report_words(rank: int, report: dict | None) -> str:
    if report is None:
        return f"rank {rank} has not reported (it may not have reached the pipeline, or the store did not answer)"
    age = time.time() - float(report["time"])
    text = f"rank {rank} last reported {age:.1f} s ago: {report['doing']}"
    if age > 3 * HEARTBEAT + 1:
        text += " - it has stopped reporting, so it is stopped, frozen or killed (not merely waiting)"
    return text


def hang_message(current: _Current | None, waited: float, warning: bool = False, error: str = "") -> str:
    """Which rank waits for whom, doing what, for how long; what the peers last reported; how to wait longer."""
    rec = _RECORDER
    head = f"rank {rec.rank}, {current.what}" if current is not None else f"rank {rec.rank}: {rec.doing()}"
    if warning:
        text = f"No progress: {head} has waited {waited:.0f} s"
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
        words = "; ".join(_report_words(r, reports.get(r)) for r in peers)
        text += " " + words[:1].upper() + words[1:] + "."
    if warning:
        text += (f" The hard timeout will end the run; this warning comes after {no_progress_limit():.0f} s "
                 f"({NO_PROGRESS_ENV}=seconds, 0 to turn it off).")
    return text


def timeout_error(err: BaseException, current: _Current | None) -> PipelineTimeoutError:
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
