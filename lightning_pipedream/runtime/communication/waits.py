"""Waiting for gloo's point-to-point operations off the training thread.

gloo says a send or receive is complete only once something has waited for it: its ``is_completed()`` stays False
until ``wait()`` was called, however long ago the message went. A loop that drops what ``is_completed()`` says is
done, and otherwise never waits, keeps every operation it posted (and its buffer) until the end, and a receiver that
only looks never sees a message arrive. :class:`BackgroundWaits` waits for them on a thread of its own, in the order
they were posted, so the training thread can look without blocking. For gloo groups: a NCCL operation's
``is_completed()`` asks its CUDA event, and its ``wait()`` binds the calling thread's stream, so NCCL's stay with the
thread that posted them.

Post them inside :func:`unprofiled`: under an active profiler (``Trainer(profiler="pytorch")``) each operation opens a
profiler range (``gloo:recv``) on the posting thread that its ``wait()`` closes, and a range closed on another thread
than the one that opened it is not something Kineto expects (a 3-process fit under the profiler ended in a SIGSEGV
on rank 0 once in CI with the ranges on).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def unprofiled() -> Iterator[None]:
    """Operations posted here open no profiler range (this thread's record functions off meanwhile, on again after:
    torch keeps that switch per thread, on unless turned off)."""
    switch = getattr(torch._C._autograd, "_enable_record_function", None)  # private: absent, the ranges stay
    if switch is None:
        yield
        return
    switch(False)
    try:
        yield
    finally:
        switch(True)


class Posted:
    """Point-to-point operations that :class:`BackgroundWaits` waits for: ``done`` once it has, with their ``error``
    if any."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works
        self.done = threading.Event()
        self.error: BaseException | None = None

    def result(self) -> None:
        """Blocks until waited for; raises what the wait raised (a peer gone, the group's timeout)."""
        self.done.wait()
        if self.error is not None:
            raise self.error


class BackgroundWaits:
    """Waits for point-to-point operations on a thread of its own, in the order they were posted: the training
    thread posts them and later looks at :attr:`Posted.done`, never blocking on a peer."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def post(self, works: list[Any]) -> Posted:
        posted = Posted(works)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self._todo,), name="lightning_pipedream-waits",
                                            daemon=True)
            self._thread.start()
        self._todo.put(posted)
        return posted

    @staticmethod
    def _run(todo: queue.SimpleQueue[Posted | None]) -> None:
        while (posted := todo.get()) is not None:
            try:
                for work in posted.works:
                    work.wait()
            except BaseException as err:  # kept for the training thread, which raises it where it waits
                posted.error = err
            posted.done.set()

    def stop(self) -> None:
        """No more posts: the thread ends once it has waited for what it holds (a daemon: a wait that never ends,
        a peer gone, does not keep the process alive)."""
        if self._thread is not None:
            self._todo.put(None)
            self._todo, self._thread = queue.SimpleQueue(), None  # a later post starts a thread of its own
