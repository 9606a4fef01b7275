"""SIGTERM under the pipeline: rank 0's request to end reaches every rank by point-to-point messages, and every rank
stops training at the same step, without Lightning's blocking broadcasts.

Lightning checks for a SIGTERM with a broadcast from rank 0 over every rank before each training batch, and its
signal handler broadcasts too, wherever the signal finds the main thread. Under an asynchronous schedule the ranks
are at different points of the schedule at a batch boundary: a collective there closes a circle with any collective
that spans the boundary (a tied weight's all-reduce: the last stage reduces minibatch t in step t, the first stage
in step t + stages - 1), and the run hangs (issue #52). So, under PipeDreamStrategy (every schedule alike):

- Lightning's per-batch broadcast is not issued, and its handler only records the signal (and forwards it to the
  processes its launcher started, as Lightning does), see :func:`install`;
- at the end of every training step t, rank 0 sends its flag (requested or not) to every other rank on a process
  group of its own, without waiting; every rank reads step ``t - DELAY``'s flag at the end of step t. Rank 0 sent
  it before it began step ``t - DELAY + 1``, whose first stage's work every rank's step t needs (its activations,
  or the gradients and summaries that follow from them), so the read does not wait in practice; and it never waits
  on a rank's later step, so it cannot close a circle. It is bounded by the pipeline's timeout all the same;
- a set flag makes every rank drain the pipeline at the end of that same step, set Lightning's ``received_sigterm``
  and raise Lightning's ``SIGTERMException`` there (``Training._stop_for_sigterm``): every rank stops at the same
  batch, with whole weights, and Lightning handles the exception as it does without a pipeline.

A rank other than 0 that gets a SIGTERM alone tells rank 0 through its mailbox (the watchdog does it), so the
request is never swallowed; a rank that is stuck in a wait when asked to end ends the run after saying where
(``runtime/faults/termination.py``).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_pipedream.runtime.communication.waits import BackgroundWaits, Posted, unprofiled
from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.runtime.faults.termination import termination

log = logging.getLogger(__name__)

DELAY = 1  # every rank acts on step t's flag at the end of step t + DELAY

# The flags' group of each pipeline (a StagePipeline, by id, with a weak reference to tell a reused id), made once:
# a later fit with the same model keeps it.
_GROUPS: dict[int, tuple[weakref.ref, dist.ProcessGroup]] = {}


class StopRequests:
    """Rank 0's request to end, agreed at the same training step on every rank (see the module's text).

    Call :meth:`after_step` at the end of every training step on every rank, :meth:`settle` where every rank ends
    the fit normally, :meth:`forget` after a failure.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, device: torch.device,
                 stage: int | None = None, delay: int = DELAY) -> None:
        self.group, self.rank, self.world, self.device, self.stage = group, rank, world, device, stage
        self.delay = delay
        self.steps = 0
        self.stopped_at: int | None = None  # the step (counted from the fit's first) at which training stops
        self._sends: deque[tuple[int, list[tuple[Any, torch.Tensor]]]] = deque()  # rank 0: (step, works)
        # gloo: a thread waits for rank 0's sends (gloo never says one is complete otherwise: the deque would keep
        # every step's for the whole fit); NCCL's say so themselves.
        self._waits = BackgroundWaits() if rank == 0 and _backend(group) == "gloo" else None
        self._posted: deque[Posted] = deque()
        self._receives: deque[tuple[int, Any, torch.Tensor]] = deque()  # others: (step, work, flag)
        self._own: deque[bool] = deque()  # rank 0: its flags as sent, read ``delay`` steps later as the others do
        termination().reset()

    def after_step(self) -> bool:
        """This step's part: rank 0 sends its flag; every rank reads step ``t - delay``'s. True: training stops at
        the end of this step, on every rank."""
        t = self.steps
        self.steps += 1
        with pipeline_failures(self.stage, waiting="posting rank 0's SIGTERM flag (to or from rank 0)", peers=(0,)):
            if self.rank == 0:
                requested = termination().requested
                self._own.append(requested)
                flag = torch.tensor([1.0 if requested else 0.0], device=self.device)
                with unprofiled() if self._waits is not None else nullcontext():  # the waiter ends them (waits.py)
                    works = [(dist.isend(flag, dst=peer, group=self.group), flag) for peer in range(1, self.world)]
                self._sends.append((t, works))
                if self._waits is not None:
                    self._posted.append(self._waits.post([work for work, _ in works]))
                    while self._posted and self._posted[0].done.is_set() and self._posted[0].error is None:
                        self._posted.popleft()
                        self._sends.popleft()
                else:
                    while self._sends and all(work.is_completed() for work, _ in self._sends[0][1]):
                        self._sends.popleft()
            else:
                flag = torch.zeros(1, device=self.device)
                self._receives.append((t, dist.irecv(flag, src=0, group=self.group), flag))
        if t < self.delay:
            return False
        if self.rank == 0:
            stop = self._own.popleft()
        else:
            stop = self._read(t - self.delay)
        if stop and self.stopped_at is None:
            self.stopped_at = t
        return stop

    def _read(self, step: int) -> bool:
        t, work, flag = self._receives.popleft()
        assert t == step, (t, step)
        with pipeline_failures(self.stage, waiting=f"rank 0's SIGTERM flag of training step {step}", peers=(0,)):
            work.wait()
        return bool(flag.item())

    def settle(self) -> None:
        """Where every rank ends the fit normally: take what is still on its way (every rank has sent and posted
        all of it), so that nothing of this fit is left in flight."""
        with pipeline_failures(self.stage, waiting="the last SIGTERM flags between rank 0 and the other ranks",
                               peers=tuple(range(1, self.world)) if self.rank == 0 else (0,)):
            while self._posted:  # gloo: what the thread has not waited for yet, it waits for; raised here
                self._posted.popleft().result()
                self._sends.popleft()
            while self._sends:
                for work, _ in self._sends.popleft()[1]:
                    work.wait()
            while self._receives:
                self._receives.popleft()[1].wait()
        if self._waits is not None:
            self._waits.stop()

    def forget(self) -> None:
        """After a failure: the ranks stopped at different steps; nothing more is waited for."""
        self._sends.clear()
        self._posted.clear()
        if self._waits is not None:
            self._waits.stop()
        self._receives.clear()
        self._own.clear()
        for key, (_, group) in list(_GROUPS.items()):  # receives may still be posted on it: a later fit makes anew
            if group is self.group:
                del _GROUPS[key]


def _backend(group: Any) -> str | None:
    """``group``'s backend, or None where torch does not know the group (a stand-in's, in the tests' NCCL model)."""
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        return None


def install(trainer: Trainer, owner: object, device: torch.device, stage: int | None,
            timeout: timedelta | None) -> StopRequests | None:
    """Replace Lightning's SIGTERM collectives in this fit (see the module's text); None in a single process.
    ``owner``: what the flags' process group is kept with (the rank's pipeline), so that a later fit reuses it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop._broadcast_sigterm_tensor = _no_broadcast  # type: ignore[method-assign]
    connector = trainer._signal_connector
    connector._sigterm_notifier_fn = _Notifier(trainer)  # type: ignore[method-assign]  # registered after setup
    termination().watch_signals()
    kept = _GROUPS.get(id(owner))
    if kept is not None and kept[0]() is owner:
        group = kept[1]
    else:  # every rank makes it, in the same order: setup runs the same code everywhere
        group = dist.new_group(timeout=timeout)
        _GROUPS[id(owner)] = (weakref.ref(owner), group)
    return StopRequests(group, dist.get_rank(), dist.get_world_size(), device, stage)


def _no_broadcast() -> None:
    """Lightning's per-batch SIGTERM broadcast, not issued: :class:`StopRequests` carries the flag."""


class _Notifier:
    """Lightning's SIGTERM handler without its broadcast: record the request, and forward the signal to the processes
    the launcher started (as Lightning does). ``received_sigterm`` is set on every rank at the agreed step."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def __call__(self, signum: int, frame: Any) -> None:
        first = not termination().requested
        termination().request("SIGTERM")
        log.info("lightning_pipedream: rank %d received SIGTERM; training stops at the same step on every rank.",
                 self.trainer.global_rank)
        launcher = self.trainer.strategy.launcher
        if first and launcher is not None:
            launcher.kill(signum)
