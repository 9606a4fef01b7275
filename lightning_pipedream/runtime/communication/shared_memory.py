"""Byte messages between two processes on one machine through a ring buffer in shared memory (no socket, no thread).

The pipeline's transport sends each tensor tree as one byte message whose size both ends know, and two ranks consume
their messages in the order they were sent; so one ring per direction of a link is all it needs. A ring is a file in
``/dev/shm``, mapped by both processes: a page of counters, then the data. The writer copies a message in and
advances ``written``; the reader copies it out and advances ``read``. A process with nothing to do sleeps in the
kernel (a futex on a counter) and the other wakes it after every advance, so neither burns a core waiting; a wake-up
costs one system call. A message that does not fit in the free space goes out in pieces from a small thread of its
own, so a send never blocks the caller (gloo's sends do not either, and the executor relies on it).

Only used on x86-64 Linux: its stores are seen by other cores in program order, so the data of a message is visible
before the counter that announces it (other architectures would need barriers that Python cannot express).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

_PAGE = 4096
# int64 counters (bytes ever written, ever read), then int32 futex words bumped after each advance of each counter
_WRITTEN, _READ = 0, 1
_DATA_SEQ, _SPACE_SEQ = 4, 5  # in int32 units: bytes 16 and 20
_CLOSED = 6  # int32: the writer closed the ring
NAME_BYTES = 256  # the fixed size of the message that tells the reader the ring's file name
_POLL_S = 0.1  # how often a sleeping wait looks at its peer (is it alive?) and its deadline

SYS_FUTEX = {"x86_64": 202, "AMD64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


def supported() -> bool:
    """Whether this machine can use shared-memory rings (x86-64 Linux with a writable ``/dev/shm``)."""
    return SYS_FUTEX is not None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)


def shm_identity() -> tuple[int, int]:
    """Which ``/dev/shm`` this process sees: two containers on one host may have different ones."""
    st = os.stat("/dev/shm")
    return st.st_dev, st.st_ino


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)  # a foreign call releases the GIL: other threads run while one sleeps


def _futex_wait(address: int, expected: int, seconds: float) -> None:
    """Sleep until woken, ``seconds`` pass, or the int32 at ``address`` no longer holds ``expected``."""
    ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    _libc.syscall(SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(ts),
                  None, 0)


def _futex_wake(address: int) -> None:
    _libc.syscall(SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(1 << 30), None, None, 0)


class RingClosedError(RuntimeError):
    """The other end of a ring closed it, or a wait on it gave up (its ``check`` raised, or the deadline passed)."""


class Ring:
    """One direction of a link: a byte FIFO in a file of ``/dev/shm`` shared by a writer and a reader process.

    ``check`` is called about every 0.1 s while a call sleeps; it raises to end the wait (the peer is gone, a stop
    was requested). ``timeout``: how long a wait may last in all (None: no limit).
    """

    def __init__(self, path: str, capacity: int, create: bool) -> None:
        self.path, self.capacity = path, capacity
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:  # reserved now: a full /dev/shm would otherwise kill the process (SIGBUS) at its first write
                    os.posix_fallocate(fd, 0, _PAGE + capacity)
                except OSError as err:
                    os.unlink(path)
                    raise RingClosedError(
                        f"No room for a {capacity >> 10} KiB shared-memory ring in /dev/shm ({err.strerror}). Free "
                        "space there (a container's /dev/shm is often 64 MB: docker run --shm-size=1g), set "
                        "LIGHTNING_PIPEDREAM_SHM_RING_BYTES smaller, or LIGHTNING_PIPEDREAM_TRANSPORT=gloo on every "
                        "rank."
                    ) from None
            # Populated now: a ring's pages would otherwise fault in, in both processes, during its first lap.
            self._map = mmap.mmap(fd, _PAGE + capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=_PAGE // 8)
        self._words = np.frombuffer(self._map, dtype=np.int32, count=_PAGE // 4)
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_PAGE, count=capacity)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    @classmethod
    def create(cls, capacity: int) -> Ring:
        """A new ring in a file of its own (the reader opens it by name, then :meth:`unlink` removes the name)."""
        return cls(f"/dev/shm/lightning_pipedream-{os.getpid()}-{secrets.token_hex(8)}", capacity, create=True)

    @classmethod
    def open(cls, path: str) -> Ring:
        capacity = os.stat(path).st_size - _PAGE
        if capacity <= 0:
            raise RingClosedError(f"{path} is not a lightning_pipedream ring")
        return cls(path, capacity, create=False)

    def unlink(self) -> None:
        """Remove the file's name; the memory lives on while either process maps it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Tell the reader that no more bytes will come."""
        self._words[_CLOSED] = 1
        self._bump(_DATA_SEQ)

    # -- the two ends ----------------------------------------------------------------------------------------
    def write(self, message: Tensor, start: int = 0, wait: bool = True, check: Callable[[], None] | None = None,
              timeout: float | None = None) -> int:
        """Copy ``message[start:]`` (uint8) in; with ``wait=False`` only what fits now. Returns where it stopped."""
        end = message.numel()
        deadline = None if timeout is None else time.monotonic() + timeout
        while start < end:
            seq = int(self._words[_SPACE_SEQ])
            written = int(self._counters[_WRITTEN])
            free = self.capacity - (written - int(self._counters[_READ]))
            if free == 0:
                if not wait:
                    return start
                self._sleep(_SPACE_SEQ, seq, check, deadline, timeout, "send")
                continue
            at = written % self.capacity
            n = min(free, end - start, self.capacity - at)
            self._data[at:at + n].copy_(message[start:start + n])
            self._counters[_WRITTEN] = written + n  # after the data: x86-64 keeps the two stores in order
            self._bump(_DATA_SEQ)
            start += n
        return start

    def read_into(self, message: Tensor, check: Callable[[], None] | None = None,
                  timeout: float | None = None) -> None:
        """Fill ``message`` (uint8) with the next ``message.numel()`` bytes, waiting for them as needed."""
        start, end = 0, message.numel()
        deadline = None if timeout is None else time.monotonic() + timeout
        while start < end:
            seq = int(self._words[_DATA_SEQ])
            read = int(self._counters[_READ])
            ready = int(self._counters[_WRITTEN]) - read
            if ready == 0:
                if self._words[_CLOSED]:
                    raise RingClosedError("the sending rank closed its link")
                self._sleep(_DATA_SEQ, seq, check, deadline, timeout, "recv")
                continue
            at = read % self.capacity
            n = min(ready, end - start, self.capacity - at)
            message[start:start + n].copy_(self._data[at:at + n])
            self._counters[_READ] = read + n
            self._bump(_SPACE_SEQ)
            start += n

    def _bump(self, word: int) -> None:
        self._words[word] = (int(self._words[word]) + 1) & 0x7FFFFFFF
        _futex_wake(self._base + 4 * word)

    def _sleep(self, word: int, seq: int, check: Callable[[], None] | None, deadline: float | None,
               timeout: float | None, waited_for: str) -> None:
        now = time.monotonic()
        if deadline is not None and now >= deadline:  # gloo's words, which the failure messages quote
            raise RingClosedError(f"Timed out waiting {round((timeout or 0) * 1000)}ms for {waited_for} operation to "
                                  "complete")
        _futex_wait(self._base + 4 * word, seq, _POLL_S if deadline is None else min(_POLL_S, deadline - now))
        # Is the peer still there? Only after a real sleep (the look is not free), and only if nothing came meanwhile:
        # a peer that wrote its last message and ended at once has left that message here to be read.
        if check is not None and int(self._words[word]) == seq and time.monotonic() - now >= _POLL_S * 0.5:
            check()


@dataclass
class SendWork:
    """A send in flight: done once its last byte is in the ring (a reader may not have taken it yet)."""

    message: Tensor
    sent: int = 0
    error: BaseException | None = None
    done: threading.Event | None = None

    def is_completed(self) -> bool:
        return self.error is not None or self.sent >= self.message.numel()


class Sender:
    """The writing end of a ring: writes at once what fits, and hands the rest to a thread of its own, in order."""

    def __init__(self, ring: Ring, check: Callable[[], None], timeout: float | None) -> None:
        self.ring, self.check, self.timeout = ring, check, timeout
        self._backlog: deque[SendWork] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def send(self, message: Tensor) -> SendWork:
        work = SendWork(message)
        with self._lock:
            if not self._backlog:
                work.sent = self.ring.write(message, wait=False)
                if work.is_completed():
                    return work
            work.done = threading.Event()
            self._backlog.append(work)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="lightning_pipedream-shm-sender",
                                                daemon=True)
                self._thread.start()
        return work

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._backlog:
                    self._thread = None
                    return
                work = self._backlog[0]
            try:
                work.sent = self.ring.write(work.message, work.sent, check=self.check, timeout=self.timeout)
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the send
                work.error = err
            with self._lock:
                self._backlog.popleft()
            assert work.done is not None
            work.done.set()

    def wait(self, work: SendWork, timeout: float | None) -> None:
        """Wait until ``work`` is in the ring; raise what stopped it."""
        if work.done is not None and not work.done.wait(timeout):
            raise RingClosedError("timed out")
        if work.error is not None:
            raise work.error
