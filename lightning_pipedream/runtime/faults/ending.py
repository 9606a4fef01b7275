"""What ends a whole run: a stop request left in every peer's mailbox, and local peers ended that cannot obey it."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import threading
import time

import torch.distributed as dist

from lightning_pipedream.runtime.faults.flight import HEARTBEAT, HUNG_GRACE, STOP_GRACE, post_error_soon, recorder
from lightning_pipedream.runtime.faults.mailbox import ANSWERED, GONE, SILENT, Mailbox, mailbox, process_state

log = logging.getLogger("lightning_pipedream")


def end_run(message: str, hung: tuple[int, ...] = (), here: bool = False) -> None:
    """Make sure the whole run ends: leave a stop request with ``message`` in every peer's mailbox (each rank's
    watchdog obeys it, see :meth:`~.watchdog.Watchdog.obey`), end at once the local peers named in ``hung`` that cannot
    obey (stopped, or not even their mailbox answers), and at this process's exit end the local peers still there
    after the grace. ``here``: this rank's own watchdog obeys it too (it may be stuck in a wait itself)."""
    box = mailbox()
    flight = recorder()
    request = {"rank": flight.rank, "stage": flight.stage, "message": message, "hung": list(hung)}
    if here:
        box.put_here("stop", request, first=True)
    statuses: dict[int, str] = {}
    if box.is_open:
        learner = threading.Thread(target=box.learn_peers, daemon=True)  # a peer may have registered just now
        learner.start()
        learner.join(1.0)
        statuses = box.put_everywhere("stop", request, first=True)
        for rank in hung:
            if box.is_local(rank) and (statuses.get(rank) == SILENT or box.local_state(rank) == "T"):
                _kill(rank, "it is stopped or frozen")
        _end_local_peers_at_exit()
        _wait_at_exit_for(tuple(rank for rank in hung if statuses.get(rank) == ANSWERED))
    exit_without_final_collections()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(statuses) < world - 1 or any(status != ANSWERED for status in statuses.values()):
        post_error_soon(message)  # and the store, for peers whose mailbox this rank does not know or reach


def _kill(rank: int, why: str) -> None:
    peer = mailbox().peers[rank]
    if process_state(peer.pid, peer.started) in (None, "Z"):
        return
    log.error("lightning_pipedream: rank %d ends rank %d (process %d on this machine): %s.", recorder().rank, rank,
              peer.pid, why)
    try:
        os.kill(peer.pid, signal.SIGKILL)
    except OSError:
        pass


_ending = [0.0]  # when this process asked its peers to stop (0: it did not)
_failed = [False]  # this process's run failed (its own failure, a peer's, or a timeout)


def exit_without_final_collections() -> None:
    """This process's run failed: at exit, skip the garbage collector's last passes (see below)."""
    _failed[0] = True


def _skip_final_collections_after_a_failure() -> None:
    """At exit from a run that failed: skip the garbage collector's last passes over the interpreter's heap.

    A process that imported torch and Lightning spends about 1.3 s of CPU in those passes as it exits (measured: 6.6
    s of user CPU for import-and-exit, 5.3 s with this, 5.1 s with ``os._exit``), and ten times as long in wall time
    when many processes share few cores; a failing rank's peers, a launcher and the user wait for that. Every other
    step of the exit still runs (this is registered at import, so every atexit handler registered later, a logger's
    or the user's, runs before it), and objects reachable from modules are still freed; only unreachable cycles left
    at exit are not collected, which Python does not promise to finalize anyway.
    """
    if _failed[0]:
        gc.freeze()


atexit.register(_skip_final_collections_after_a_failure)


_hung_to_wait_for: list[int] = []  # ranks named as hung that answered the stop request: they say where they were


def _wait_at_exit_for(hung: tuple[int, ...]) -> None:
    """At this process's exit, give the ranks named as hung (and able to obey) the time to print where they were.

    Launchers end every rank as soon as one exits (Lightning's observes its children every 5 s, torchrun's agent
    every 0.1 s): without this wait a hung rank could be killed before its watchdog, which obeys a stop request
    within a heartbeat and a grace, writes its threads' stacks, which are the point of naming it."""
    if not hung:
        return
    if not _hung_to_wait_for:
        atexit.register(_wait_for_hung_ranks)
    _hung_to_wait_for.extend(rank for rank in hung if rank not in _hung_to_wait_for)


def _wait_for_hung_ranks() -> None:
    box = mailbox()
    deadline = _ending[0] + HUNG_GRACE + 2 * HEARTBEAT + 2.0
    waiting = list(_hung_to_wait_for)
    while waiting and time.monotonic() < deadline:
        waiting = [rank for rank in waiting if not _gone(box, rank)]
        if waiting:
            time.sleep(0.1)


def _gone(box: Mailbox, rank: int) -> bool:
    if box.is_local(rank):
        return box.local_state(rank) in (None, "Z")
    return box.ask(rank, "report", 0.5)[0] == GONE


def _end_local_peers_at_exit() -> None:
    if _ending[0] == 0.0:
        atexit.register(_end_local_peers)
    _ending[0] = time.monotonic()


def _end_local_peers() -> None:
    """At exit: the local peers asked to stop get the grace to end by themselves; those still there then (a thread
    holding the interpreter, a process stopped since) are ended, so that no rank outlives the run. A child process
    of its own waits for them, so that this one exits at once (its closed connections tell the peers to stop)."""
    box = mailbox()
    peers = [(box.peers[r].pid, box.peers[r].started) for r in box.peers if box.is_local(r)]
    if not any(process_state(pid, started) not in (None, "Z") for pid, started in peers):
        return
    deadline = _ending[0] + STOP_GRACE + 2.0
    if os.fork() != 0:
        return
    # The child: only system calls from here on (other threads' locks may have been held at the fork).
    try:
        os.closerange(0, 1024)  # no pipe of the parent's kept open (a caller waits for their end)
        while time.monotonic() < deadline:
            if all(process_state(pid, started) in (None, "Z") for pid, started in peers):
                break
            time.sleep(0.1)
        else:
            for pid, started in peers:
                if process_state(pid, started) not in (None, "Z"):
                    os.kill(pid, signal.SIGKILL)
    finally:
        os._exit(0)
