"""Allocator advice for CPU ranks: glibc keeps freed memory for reuse instead of returning it to the OS."""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_MMAP_THRESHOLD = 32 << 20  # the largest mmap threshold glibc accepts; fixing it also stops its dynamic adjustment
_GLIBC_DEFAULT_THRESHOLD = 128 << 10  # both thresholds' values when a process starts


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed blocks for reuse rather than give them back to the OS.

    By default glibc returns large freed blocks (``munmap``, heap trimming), so the next
    allocation of a tensor that size faults its pages in again: about a microsecond per 4 KiB
    page on the machine of docs/benchmarks.md, so a 4 MiB gradient or weight buffer costs ~1 ms
    more each time it is allocated. A pipeline stage allocates its gradients and activations
    anew at every minibatch. The PyTorch CPU tuning guide's advice (jemalloc, tcmalloc) aims at
    the same. Blocks up to 32 MiB are kept; the process's resident memory then stays at its peak
    rather than shrinking between steps. Applies to this process from now on and to the
    processes it forks afterwards (:func:`return_freed_memory` undoes it); returns False where it cannot
    (not glibc).
    """
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def return_freed_memory() -> bool:
    """Undo :func:`keep_freed_memory` (e.g. when training ends): glibc's starting thresholds again, and the
    freed memory it kept given back to the OS (``malloc_trim``). Returns False where it cannot (not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
    libc.malloc_trim(0)
    return True


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
