"""Each rank's heartbeat and watchdog: its report every second, the no-progress warning, ending the run when the
peer waited for is frozen, obeying a peer's stop request, and ending a run stuck when it is asked to end (SIGTERM)."""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import sys
import threading
import time

import torch.distributed as dist

from lightning_pipedream.runtime.faults.ending import end_run
from lightning_pipedream.runtime.faults.errors import default_store
from lightning_pipedream.runtime.faults.flight import (
    HEARTBEAT,
    HUNG_GRACE,
    REPORT_KEY,
    STOP_GRACE,
    Current,
    FlightRecorder,
    frozen_limit,
    hang_message,
    no_progress_limit,
    peer_reports,
    recorder,
    stage_words,
)
from lightning_pipedream.runtime.faults.mailbox import ANSWERED, SILENT, mailbox
from lightning_pipedream.runtime.faults.termination import EXIT_CODE, GRACE_ENV, MAILBOX_KEY, grace, termination

log = logging.getLogger("lightning_pipedream")


class Watchdog:
    """Two daemon threads per process, started once per process group: the heartbeat (this rank's report in the
    store) and the watchdog (its report in its mailbox, warnings, the frozen-peer check, stop requests)."""

    def __init__(self, flight: FlightRecorder) -> None:
        self.flight = flight
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned: Current | None = None
        self._frozen_checked: Current | None = None
        self._stop_seen: float | None = None  # when this rank's watchdog found a stop request in its mailbox

    def start(self, stage: int | None = None) -> None:
        """Once per process group (called by every pipeline_failures): open this rank's mailbox, report :meth:`doing`
        there and to the store every second, warn when one wait lasts longer than the no-progress limit, end the
        run when the peer waited for is frozen, and obey a stop request a peer leaves (see :meth:`_watch`)."""
        if stage is not None:
            self.flight.stage = stage
        box = mailbox()
        if self._heartbeat is not None and box.is_open and self._heartbeat.is_alive():
            return  # running (the call at every step costs this much)
        if not dist.is_initialized():
            return
        self.flight.rank = dist.get_rank()
        if dist.get_world_size() == 1:  # no peer to report to, wait for or stop
            return
        store = default_store()
        if store is not None and not (box.is_open and self._heartbeat is not None and self._heartbeat.is_alive()):
            try:
                box.open(self.flight.rank, dist.get_world_size(), store, self.flight.stage)
            except OSError as err:  # no port to listen on: failures travel through the store only
                log.warning("lightning_pipedream: rank %d could not open its mailbox (%s).", self.flight.rank, err)
        if self._heartbeat is not None and self._heartbeat.is_alive():
            return
        if self._heartbeat is None:
            # Stop it before the interpreter (and torch's store) goes away: a thread killed inside a store call
            # at exit aborts the process ("terminate called without an active exception").
            atexit.register(self.stop)
        self._stop = stop = threading.Event()  # its own: threads of an earlier run still asleep end on theirs
        # A new run in this process (after a teardown stopped the threads): an earlier run's stop request is done.
        with box.lock:
            box.values.pop("stop", None)
        self._stop_seen = None
        self._heartbeat = threading.Thread(target=self._beat, args=(stop,), name="lightning_pipedream-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        threading.Thread(target=self._watch, args=(stop,), name="lightning_pipedream-watchdog", daemon=True).start()

    def stop(self) -> None:
        """Stop the heartbeat and watchdog threads and wait a little for the heartbeat to leave the store."""
        self._stop.set()
        termination().unwatch_signals()
        if self._heartbeat is not None and self._heartbeat.is_alive():
            self._heartbeat.join(timeout=3)

    def _beat(self, stop: threading.Event) -> None:
        """The report in the process group's store, for peers whose mailbox request finds this rank stopped (a
        store call may block while the store's host is stopped: the watchdog is another thread)."""
        while not stop.is_set():
            store = default_store()
            if store is None:
                return
            if mailbox().here("stop") is None:  # else the run is ending, and its store may be gone
                try:
                    store.set(REPORT_KEY + str(self.flight.rank), json.dumps(self.flight.report()))
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
            box.put_here("report", self.flight.report())
            box.learn_peers()
            request = box.here("stop")
            if request is not None:
                self.obey(request)
            current = self.flight.current
            self._watch_termination(current)
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

    def _watch_termination(self, current: Current | None) -> None:
        """A SIGTERM (seen through the wakeup pipe even while the main thread is blocked): rank 0 learns of its
        peers' through its mailbox; a rank that sits in one wait for longer than the grace ends the run, saying where
        it was stuck (the strategy stops training at an agreed step otherwise)."""
        term = termination()
        term.signalled()
        box = mailbox()
        if self.flight.rank == 0:
            forwarded = box.here(MAILBOX_KEY)
            if forwarded is not None:
                term.request(f"rank {forwarded.get('rank')}'s {forwarded.get('by')}")
        elif term.requested and not term.forwarded and box.is_open:
            term.forward(self.flight.rank, box)
        if current is None or not (current.peers or current.action is None):  # computing, not waiting
            return
        waited = term.stuck(current)
        if waited is not None:
            self._end_stuck(current, waited, term.by or "SIGTERM")

    def _end_stuck(self, current: Current, waited: float, by: str) -> None:
        rank = self.flight.rank
        peers = list(current.peers) or [r for r in range(dist.get_world_size()) if r != rank]
        reports = peer_reports(peers)
        said = "; ".join(
            f"rank {r}: " + (str(report["doing"]) if report is not None else "no report")
            + ("" if status == ANSWERED else f" ({status})") for r, (status, report) in reports.items())
        message = (f"lightning_pipedream: rank {rank}{stage_words(self.flight.stage)} was asked to end ({by}) while "
                   f"stuck in {current.what} for {waited:.1f} s, {grace():.0f} s past the request ({GRACE_ENV}="
                   f"seconds), so it cannot reach the step at which training stops: it ends the run here. What the "
                   f"peers it waits for last reported: {said}.")
        try:
            log.error("%s", message)
            path = self.flight.dump(message)
            sys.stderr.write(f"{message}\nIts last actions are in {path}. Its threads:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            sys.stderr.flush()
            end_run(message)
        finally:
            os._exit(EXIT_CODE)

    def _check_frozen(self, current: Current, waited: float) -> None:
        """The peer this rank waits for is stopped (SIGSTOP, a debugger) or its whole process is frozen: end the run
        now rather than at the timeout."""
        box = mailbox()
        # Only peers whose mailbox this rank knows (never itself: a wait left marked by an error in a long-lived
        # process, a test's in-memory transport, is no frozen peer).
        known = [peer for peer in current.peers if peer in box.peers and peer != self.flight.rank]
        frozen = [peer for peer in known if (box.local_state(peer) == "T" if box.is_local(peer)
                                             else box.ask(peer, "report", 2.0)[0] == SILENT)]
        if not frozen:
            return
        self._frozen_checked = current
        message = hang_message(current, waited, frozen=frozen)
        log.error("%s", message)
        self.flight.dump(message)
        end_run(message, hung=tuple(frozen), here=True)

    def obey(self, request: dict) -> None:
        """A peer asked every rank to stop: give this process a little time to end by itself (its pipeline waits
        fail and it raises the peer's error), then end it, saying why."""
        now = time.monotonic()
        if self._stop_seen is None:
            self._stop_seen = now
        hung = self.flight.rank in request.get("hung", ())
        if now - self._stop_seen < (HUNG_GRACE if hung else STOP_GRACE):
            return
        words = (f"lightning_pipedream: rank {self.flight.rank}{stage_words(self.flight.stage)} ends its process: rank "
                 f"{request.get('rank')}{stage_words(request.get('stage'))} stopped the run"
                 + (", naming this rank as hung" if hung else "") + f". {request.get('message')}")
        try:
            path = self.flight.dump(words)
            sys.stderr.write(f"{words}\nThis rank was {self.flight.doing()}; its last actions are in {path}. "
                             "Its threads:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            os._exit(1)


_WATCHDOG: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's watchdog (a forked child, another rank, gets its own with its own recorder)."""
    global _WATCHDOG
    if _WATCHDOG is None or _WATCHDOG.flight is not recorder():
        _WATCHDOG = Watchdog(recorder())
    return _WATCHDOG
