"""A request to end the run (SIGTERM: ``timeout``, a cluster's preemption notice) and the watchdog's part in it.

The strategy stops training on every rank at the same step when rank 0 is asked to end (see
``strategy/reporting/stop_signal.py``); this module keeps what that decision needs without any collective:

- :meth:`Termination.request`: this process was asked to end (its signal handler, or a peer's request forwarded to
  rank 0 through its mailbox, see :meth:`Termination.forward`);
- :meth:`Termination.watch_signals`: a signal's arrival is also written to a pipe (``signal.set_wakeup_fd``), so
  that the watchdog thread learns of a SIGTERM even while the main thread is blocked inside a wait, where Python
  runs no signal handler;
- :meth:`Termination.stuck`: the watchdog's verdict on a rank that was asked to end but sits in one wait for
  longer than the grace: it says where it was stuck and ends the run, instead of swallowing the signal.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

log = logging.getLogger("lightning_pipedream")

GRACE_ENV = "LIGHTNING_PIPEDREAM_SIGTERM_GRACE"  # seconds a wait may last after a SIGTERM before the run is ended
DEFAULT_GRACE = 30.0
MAILBOX_KEY = "terminate"  # where a rank leaves its own SIGTERM in rank 0's mailbox
EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


def grace() -> float:
    """Seconds a rank asked to end may sit in one wait before its watchdog ends the run
    (``LIGHTNING_PIPEDREAM_SIGTERM_GRACE``)."""
    try:
        return float(os.environ.get(GRACE_ENV, DEFAULT_GRACE))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %s.", GRACE_ENV, os.environ[GRACE_ENV], DEFAULT_GRACE)
        return DEFAULT_GRACE


class Termination:
    """This process's request to end, from its own signal or from a peer's (on rank 0)."""

    def __init__(self) -> None:
        self.requested_at: float | None = None  # time.perf_counter() of the first request
        self.by: str | None = None  # in words: "SIGTERM", "rank 1's SIGTERM"
        self.forwarded = False  # a rank other than 0 left its request in rank 0's mailbox
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None
        self._previous_fd: int | None = None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def request(self, by: str) -> None:
        """Record a request to end (the first one counts; the signal handler and the watchdog may both see it)."""
        with self._lock:
            if self.requested_at is None:
                self.requested_at, self.by = time.perf_counter(), by

    def reset(self) -> None:
        """A new fit in this process: an earlier request was acted on."""
        with self._lock:
            self.requested_at, self.by, self.forwarded = None, None, False

    # -- signals seen from the watchdog thread ---------------------------------------------------------------
    def watch_signals(self) -> None:
        """From the main thread: every caught signal also writes its number to a pipe that :meth:`signalled` reads
        (Python runs a signal's handler only between bytecodes of the main thread, never inside a blocked wait)."""
        if self._pipe is not None or threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read)
            os.close(write)
            return
        self._pipe = (read, write)

    def unwatch_signals(self) -> None:
        """Give the wakeup descriptor back (from the main thread, at the end of a run)."""
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        try:
            signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        except ValueError:
            return
        for fd in self._pipe:
            os.close(fd)
        self._pipe, self._previous_fd = None, None

    def signalled(self) -> bool:
        """Whether a SIGTERM arrived since the last call (read without blocking; records the request)."""
        if self._pipe is None:
            return False
        try:
            data = os.read(self._pipe[0], 512)
        except (BlockingIOError, OSError):
            return False
        if signal.SIGTERM in data:
            self.request("SIGTERM")
            return True
        return False

    # -- what the watchdog does with it ----------------------------------------------------------------------
    def forward(self, rank: int, box: Any) -> None:
        """On a rank other than 0: leave this rank's request in rank 0's mailbox, once (rank 0 decides for all)."""
        if rank == 0 or not self.requested or self.forwarded:
            return
        self.forwarded = True
        box.put(0, MAILBOX_KEY, {"rank": rank, "by": self.by}, first=True)

    def stuck(self, current: Any, now: float | None = None) -> float | None:
        """How long the wait ``current`` (a flight recorder's :class:`~.flight.Current`) has lasted past the grace
        since this process was asked to end, if it has; None while the rank is not stuck."""
        if self.requested_at is None or current is None:
            return None
        now = time.perf_counter() if now is None else now
        since = max(current.start, self.requested_at)
        return now - current.start if now - since > grace() else None


_TERMINATION = Termination()


def _after_fork_in_child() -> None:
    global _TERMINATION
    _TERMINATION = Termination()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def termination() -> Termination:
    """This process's termination request."""
    return _TERMINATION
