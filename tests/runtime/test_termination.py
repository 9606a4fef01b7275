"""A request to end the run (runtime/faults/termination.py): the wakeup pipe tells the watchdog of a SIGTERM, and a
wait counts as stuck only past the grace after the request."""

from __future__ import annotations

import os
import signal

from lightning_pipedream.runtime.faults.flight import Current
from lightning_pipedream.runtime.faults.termination import GRACE_ENV, Termination


def test_a_sigterm_reaches_the_pipe_and_is_recorded_once(monkeypatch):
    term = Termination()
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        term.watch_signals()
        assert not term.signalled()
        os.kill(os.getpid(), signal.SIGTERM)
        assert term.signalled() and term.requested and term.by == "SIGTERM"
        first = term.requested_at
        term.request("rank 1's SIGTERM")  # a later request does not move the first
        assert (term.requested_at, term.by) == (first, "SIGTERM")
    finally:
        term.unwatch_signals()
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]  # the handler ran too: the pipe is only a second way of hearing it


def test_a_wait_is_stuck_only_past_the_grace_after_the_request(monkeypatch):
    monkeypatch.setenv(GRACE_ENV, "5")
    term = Termination()
    wait = Current("step 3: the tied weight 'w''s all-reduce with rank 0", (0,), start=100.0)
    assert term.stuck(wait, now=200.0) is None  # not asked to end: a long wait is the timeout's business
    term.request("SIGTERM")
    term.requested_at = 150.0
    assert term.stuck(wait, now=154.0) is None  # within the grace after the request
    assert term.stuck(wait, now=156.0) == 56.0  # past it: how long the wait has lasted
    later = Current("step 4: RECV_ACT", (0,), start=153.0)
    assert term.stuck(later, now=157.0) is None  # a wait that began after the request has its own grace
