"""BackgroundWaits: gloo's point-to-point operations waited for off the training thread, in order."""

from __future__ import annotations

import threading

import pytest

from lightning_pipedream.runtime.communication.waits import BackgroundWaits

LIMIT = 60.0  # an outer hang limit only


class Work:
    """A gloo work as gloo has it: not complete until waited for; its wait returns once the message is there."""

    def __init__(self, error: Exception | None = None) -> None:
        self.arrived = threading.Event()
        self.waited = False
        self.error = error

    def is_completed(self) -> bool:
        return self.waited

    def wait(self) -> bool:
        assert self.arrived.wait(LIMIT)
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


def test_posted_works_are_waited_for_in_order_and_the_poster_only_looks() -> None:
    waits = BackgroundWaits()
    first, second = [Work(), Work()], [Work()]
    a, b = waits.post(first), waits.post(second)
    assert not a.done.is_set() and not b.done.is_set()
    second[0].arrived.set()  # the later message is there first: the earlier is still awaited, so neither is done
    assert not b.done.wait(0.2)
    for work in first:
        work.arrived.set()
    assert a.done.wait(LIMIT) and b.done.wait(LIMIT)
    a.result()
    b.result()
    assert all(w.is_completed() for w in first + second)
    waits.stop()


def test_a_failed_wait_is_kept_and_raised_where_the_poster_asks() -> None:
    waits = BackgroundWaits()
    failing = Work(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    posted = waits.post([failing])
    after = waits.post([Work()])
    failing.arrived.set()
    assert posted.done.wait(LIMIT) and posted.error is not None
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        posted.result()
    assert not after.done.is_set()  # the next one is still waited for, not skipped
    waits.stop()


def test_after_stop_a_new_post_gets_a_thread_of_its_own() -> None:
    waits = BackgroundWaits()
    held = Work()
    waits.post([held])
    waits.stop()  # the old thread still waits for `held`, then ends
    work = Work()
    work.arrived.set()
    assert waits.post([work]).done.wait(LIMIT)  # not stuck behind the old thread's wait
    held.arrived.set()
    waits.stop()


def test_operations_posted_unprofiled_open_no_range_and_the_switch_comes_back_on() -> None:
    # What a waiter thread ends must not have opened a profiler range on the posting thread (waits.py).
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lightning_pipedream.runtime.communication.waits import unprofiled

    a = torch.randn(4, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with unprofiled():
            torch.mm(a, a)
        torch.addmm(a, a, a)
    names = {e.name for e in prof.events()}
    assert "aten::addmm" in names and "aten::mm" not in names
