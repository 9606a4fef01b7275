"""Joining a process group (a rendezvous that outwaits late ranks), and N local test processes run with a deadline."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

RENDEZVOUS_TIMEOUT = timedelta(minutes=30)  # torch's (and Lightning's) default: how long a rank may start late


def rendezvous_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta | None,
                     rendezvous_timeout: timedelta = RENDEZVOUS_TIMEOUT) -> dist.Store:
    """The store for ``init_process_group(store=...)``, joined at ``address:port`` as torch's own ``env://``
    rendezvous does (under torchrun, its agent's store), waiting up to ``rendezvous_timeout`` (or ``timeout``, if
    longer) for every rank to join: one rank may start many seconds after another (a busy machine, a slow file
    system, a queue). The store's own operations then wait at most ``timeout``, as the process group's do: a short
    pipeline timeout bounds the pipeline's waits, never the start."""
    timeout = timeout if timeout is not None else RENDEZVOUS_TIMEOUT
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=max(timeout, rendezvous_timeout)))
    store.set_timeout(timeout)
    return dist.PrefixStore("default_pg", store)  # the prefix torch's own rendezvous gives (a shared store's keys)


class RankFailedError(RuntimeError):
    """A rank started by :func:`run_local` raised; the message carries its traceback."""


def _child(fn: Callable, rank: int, world_size: int, store_path: str, timeout: float, queue: Any, args: tuple) -> None:
    # Each rank computes with one thread: two ranks on a two-core machine otherwise fight for cores.
    torch.set_num_threads(1)
    # If the deadline passes, say where this rank was stuck before the parent kills it.
    faulthandler.dump_traceback_later(max(1.0, timeout - 2.0), exit=False)
    code = 0
    try:
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's pairs on loopback
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as err:  # report everything, then leave: peers see the closed sockets
        queue.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        code = 1
    finally:
        queue.close()
        queue.join_thread()
    os._exit(code)


def _exit_words(code: int) -> str:
    """A process's exit code in words: ``-9`` -> "killed by signal 9 (SIGKILL)"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"killed by signal {-code} ({name})"


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` forked processes and return their results.

    The ranks share a gloo process group (rendezvous through a temporary file, gloo on loopback). If any rank raises,
    this raises :class:`RankFailedError` with every failing rank's traceback; if the ranks have
    not all finished after ``timeout`` seconds they are killed and this raises too, so a broken
    pipeline fails instead of hanging.

    The ranks are forked and compute on one thread each. A rank that raises its threads (``torch.set_num_threads``)
    in a process forked from one whose OpenMP threads have already run can hang in its first parallel operation
    (GNU OpenMP does not survive a fork); start such work from a fresh interpreter.
    """
    # A file rendezvous: no port to pick, and no store thread in this process, which forks below
    # (forking while a TCPStore server thread runs has deadlocked children).
    store_dir = tempfile.mkdtemp(prefix="lightning_pipedream_")
    store_path = os.path.join(store_dir, "store")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, store_path, timeout, queue, args), daemon=True)
        for r in range(world_size)
    ]
    killed_here: dict[int, bool] = {}  # ranks this launcher killed at the deadline (not a silent death)
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:  # nothing yet: check whether a rank died without reporting
                if any(p.exitcode not in (None, 0) for p in procs) and all(p.exitcode is not None for p in procs):
                    break
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                killed_here[r] = True
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    # A rank that ended without a report (a signal: the kernel's out-of-memory killer, a crash in native code)
    silent = {r: p.exitcode for r, p in enumerate(procs) if r not in results and r not in failures
              and p.exitcode not in (None, 0) and not killed_here.get(r)}
    for r, code in silent.items():
        failures[r] = f"ended without a report, {_exit_words(code)}"
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
        raise RankFailedError(f"{len(failures)} of {world_size} ranks failed:\n{text}")
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise RankFailedError(f"Ranks {missing} did not finish within {timeout:.0f} s and were killed.")
    return [results[r] for r in range(world_size)]
