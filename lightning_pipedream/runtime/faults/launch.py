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
    waited = max(timeout, rendezvous_timeout)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=waited))
    attempt = join_attempt(store, rank, world_size, waited)
    store.set_timeout(timeout)
    # torch's own prefix (a shared store's keys), then this attempt's: a restarted run never reads the keys of the
    # attempt before it (the gloo addresses of ranks that are gone, the failure reports in the mailboxes).
    return dist.PrefixStore(f"default_pg/attempt-{attempt}", store)


ATTEMPT_KEYS = "lightning_pipedream/attempt/"
_POLL = 0.05  # seconds between two looks at the store while the attempt is agreed (a few round trips per rank)


def join_attempt(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A name every rank of this start of the run agrees on and no earlier start had: its keys' prefix.

    torchrun keeps one store for all the attempts of a job (the static rendezvous's and the c10d one's alike), and
    the keys of an attempt that a kill ended stay in it. ``TORCHELASTIC_RESTART_COUNT`` cannot tell attempts apart
    by itself: under the c10d rendezvous on several nodes, an agent whose workers were still healthy restarts them
    without counting a restart, so two nodes' counts can differ within one attempt. So rank 0 draws a fresh random
    name and hands it to every rank, and each rank proves it read this attempt's: rank 0 answers each rank with the
    fresh number that rank wrote (an old answer cannot hold it), and waits until each rank echoes its name (an old
    echo cannot hold it). Every wait outlasts a late rank as the rendezvous does (``timeout``)."""
    deadline = time.monotonic() + timeout.total_seconds()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if rank == 0:
        name = f"{restart}-{os.urandom(8).hex()}"
        pending = set(range(1, world_size))
        while pending:
            for peer in sorted(pending):
                member, echo = f"{ATTEMPT_KEYS}member/{peer}", f"{ATTEMPT_KEYS}echo/{peer}"
                if not store.check([member]):
                    continue
                store.set(f"{ATTEMPT_KEYS}answer/{peer}", f"{name} {store.get(member).decode()}")
                if store.check([echo]) and store.get(echo).decode() == name:
                    pending.discard(peer)
            _wait_or_give_up(deadline, pending, "rank 0 waited for ranks {} to join")
        return name
    mine = os.urandom(8).hex()
    store.set(f"{ATTEMPT_KEYS}member/{rank}", mine)
    while True:
        if store.check([f"{ATTEMPT_KEYS}answer/{rank}"]):
            name, echoed = store.get(f"{ATTEMPT_KEYS}answer/{rank}").decode().split(" ")
            if echoed == mine:
                store.set(f"{ATTEMPT_KEYS}echo/{rank}", name)
                return name
        _wait_or_give_up(deadline, {0}, f"rank {rank} waited for rank {{}} to answer")


def _wait_or_give_up(deadline: float, waited_for: set[int], words: str) -> None:
    if not waited_for:
        return
    if time.monotonic() > deadline:
        raise TimeoutError(f"The rendezvous did not complete: {words.format(sorted(waited_for))} until the rendezvous "
                           "timeout. Start every rank of the run (the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT), "
                           "or raise the rendezvous timeout if a rank starts this late.")
    time.sleep(_POLL)


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
