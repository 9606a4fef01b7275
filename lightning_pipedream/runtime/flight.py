"""Each rank's flight recorder (its last actions), its heartbeat and watchdog, and the words for a hung peer."""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_pipedream.runtime.mailbox import ANSWERED, GONE, SILENT, mailbox
from lightning_pipedream.runtime.transport import PeerFailedError, post_error
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
        self.stage: int | None = None  # this rank's stage (its first, several under interleaved), once known
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned: _Current | None = None
        self._frozen_checked: _Current | None = None
        self._stop_seen: float | None = None  # when this rank's watchdog found a stop request in its mailbox

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

    # -- the heartbeat and the watchdog ----------------------------------------------------------------
    def start_heartbeat(self, stage: int | None = None) -> None:
        """Once per process group (called by every pipeline_failures): open this rank's mailbox, report :meth:`doing`
        there and to the store every second, warn when one wait lasts longer than the no-progress limit, end the
        run when the peer waited for is frozen, and obey a stop request a peer leaves (see :meth:`_watch`)."""
        if stage is not None:
            self.stage = stage
        box = mailbox()
        if self._heartbeat is not None and box.is_open and self._heartbeat.is_alive():
            return  # running (the call at every step costs this much)
        if not dist.is_initialized():
            return
        self.rank = dist.get_rank()
        if dist.get_world_size() == 1:  # no peer to report to, wait for or stop
            return
        store = _default_store()
        if store is not None and not (box.is_open and self._heartbeat is not None and self._heartbeat.is_alive()):
            try:
                box.open(self.rank, dist.get_world_size(), store, self.stage)
            except OSError as err:  # no port to listen on: failures travel through the store only
                log.warning("lightning_pipedream: rank %d could not open its mailbox (%s).", self.rank, err)
        if self._heartbeat is not None and self._heartbeat.is_alive():
            return
        if self._heartbeat is None:
            # Stop it before the interpreter (and torch's store) goes away: a thread killed inside a store call
            # at exit aborts the process ("terminate called without an active exception").
            atexit.register(self.stop_heartbeat)
        self._stop = stop = threading.Event()  # its own: threads of an earlier run still asleep end on theirs
        # A new run in this process (after a teardown stopped the threads): an earlier run's stop request is done.
        with box.lock:
            box.values.pop("stop", None)
        self._stop_seen = None
        self._heartbeat = threading.Thread(target=self._beat, args=(stop,), name="lightning_pipedream-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        threading.Thread(target=self._watch, args=(stop,), name="lightning_pipedream-watchdog", daemon=True).start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat and watchdog threads and wait a little for the heartbeat to leave the store."""
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat.is_alive():
            self._heartbeat.join(timeout=3)

    def report(self) -> dict:
        return {"time": time.time(), "doing": self.doing(), "stage": self.stage}

    def _beat(self, stop: threading.Event) -> None:
        """The report in the process group's store, for peers whose mailbox request finds this rank stopped (a
        store call may block while the store's host is stopped: the watchdog is another thread)."""
        while not stop.is_set():
            store = _default_store()
            if store is None:
                return
            if mailbox().here("stop") is None:  # else the run is ending, and its store may be gone
                try:
                    store.set(_REPORT_KEY + str(self.rank), json.dumps(self.report()))
                except Exception:  # the store is gone: the run is over
                    return
            if stop.wait(HEARTBEAT):
                return

    def _watch(self, stop: threading.Event) -> None:
        """Every second: the report in the mailbox, the peers' addresses, a stop request, the no-progress warning
        and the frozen-peer check."""
        box = mailbox()
        limit, frozen = no_progress_limit(), frozen_limit()
        while not stop.is_set():
            box.put_here("report", self.report())
            box.learn_peers()
            request = box.here("stop")
            if request is not None:
                self._obey(request)
            current = self.current
            waited = time.perf_counter() - current.start if current is not None else 0.0
            if (limit > 0 and current is not None and current.peers and current is not self._warned
                    and waited > limit):
                self._warned = current
                log.warning("%s", hang_message(current, waited, warning=True))
            if frozen > 0 and current is not None and current.peers and waited > frozen and (
                    current is not self._frozen_checked):
                self._check_frozen(current, waited)
            if stop.wait(HEARTBEAT):
                return

    def _check_frozen(self, current: _Current, waited: float) -> None:
        """The peer this rank waits for is stopped (SIGSTOP, a debugger) or its whole process is frozen: end the run
        now rather than at the timeout."""
        from lightning_pipedream.runtime.failures import end_run

        box = mailbox()
        # Only peers whose mailbox this rank knows (never itself: a wait left marked by an error in a long-lived
        # process, a test's in-memory transport, is no frozen peer).
        known = [peer for peer in current.peers if peer in box.peers and peer != self.rank]
        frozen = [peer for peer in known if (box.local_state(peer) == "T" if box.is_local(peer)
                                             else box.ask(peer, "report", 2.0)[0] == SILENT)]
        if not frozen:
            return
        self._frozen_checked = current
        message = hang_message(current, waited, frozen=frozen)
        log.error("%s", message)
        self.dump(message)
        end_run(message, hung=tuple(frozen), here=True)

    def _obey(self, request: dict) -> None:
        """A peer asked every rank to stop: give this process a little time to end by itself (its pipeline waits
        fail and it raises the peer's error), then end it, saying why."""
        now = time.monotonic()
        if self._stop_seen is None:
            self._stop_seen = now
        hung = self.rank in request.get("hung", ())
        if now - self._stop_seen < (HUNG_GRACE if hung else STOP_GRACE):
            return
        words = (f"lightning_pipedream: rank {self.rank}{_stage_words(self.stage)} ends its process: rank "
                 f"{request.get('rank')}{_stage_words(request.get('stage'))} stopped the run"
                 + (", naming this rank as hung" if hung else "") + f". {request.get('message')}")
        try:
            path = self.dump(words)
            sys.stderr.write(f"{words}\nThis rank was {self.doing()}; its last actions are in {path}. Its threads:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            os._exit(1)


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
        store = _default_store()
        for rank in missing:
            key = _REPORT_KEY + str(rank)
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


def _stage_words(stage: int | None) -> str:
    return "" if stage is None else f" (stage {stage})"


def _peer_stage(rank: int, report: dict | None) -> int | None:
    if report is not None and report.get("stage") is not None:
        return report["stage"]
    peer = mailbox().peers.get(rank)
    return peer.stage if peer is not None else None


def _report_words(rank: int, status: str, report: dict | None) -> str:
    who = f"rank {rank}{_stage_words(_peer_stage(rank, report))}"
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


def hang_message(current: _Current | None, waited: float, warning: bool = False, error: str = "",
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


def hung_peers(current: _Current | None, reports: dict[int, tuple[str, dict | None]] | None = None) -> tuple[int, ...]:
    """The peers a timed-out wait blames: those it waited for, or in a collective those that do not answer."""
    if current is not None and current.peers:
        return tuple(current.peers)
    if reports is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        reports = peer_reports([r for r in range(world) if r != _RECORDER.rank])
    return tuple(r for r, (status, _) in reports.items() if status != ANSWERED)


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
