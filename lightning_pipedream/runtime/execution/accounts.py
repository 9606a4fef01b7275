"""Where each training step's time went on this rank: compute, waiting for a peer, transfer, update and the rest.

The executor already reads the clock around every action (the flight recorder keeps them); :class:`StepAccounts`
adds those spans up by kind, so that a step's wall time splits into

- **compute**: forwards, backwards (recompute included) and weight-gradient passes;
- **wait**: the part of a receive spent before the peer had even started sending (the bubble): from the receive's
  start to the peer's send's start (stamped into the message on the clock the ranks share, see
  :class:`~lightning_pipedream.runtime.communication.transport.Transport`);
- **transfer**: the rest of each receive, the host time of each send, the wait for a step's sends to be received
  (sends that were not hidden) and the replicas' gradient all-reduce;
- **update**: the optimizer step (with what runs inside it: tied and replicated gradients' reductions, clipping);
- **other**: the rest of the step's wall time: Lightning's per-step work, data loading, the step summaries.

A step's wall time runs from the start of one training step to the start of the next on this rank (so the data
loading and Lightning's hooks between them count); a step followed by evaluation or a checkpoint's gathering ends
where its own work ends (:meth:`StepAccounts.interrupt`). Only actions inside a step count.

What it costs: a few additions per action, no synchronization per action. The parts above are read on the host's
clock, also on CUDA, where compute is then the time to launch the kernels and the wait for them shows up at the next
host synchronization (a receive's header read, usually): the five parts still add up to the step's wall time.

**The device's compute (CUDA).** On a CUDA device each compute action (forward, backward with its recompute,
weight-gradient pass) is also timed on the device: the executor records a pair of ``torch.cuda.Event(enable_timing=
True)`` on the current stream around it (:meth:`StepAccounts.device_begin`, :meth:`StepAccounts.device_end`), and
nothing waits for them then. The pairs of the steps closed since the last :meth:`~StepAccounts.take` are resolved
there, at most once per logging interval: one ``synchronize()`` on the last of their events (the compute actions
run on one stream, in order, so every earlier event is done then), then each pair's ``elapsed_time``; their sum is
:attr:`Figures.device_compute` (and :attr:`Figures.device_actions` counts them). Events go back to a pool and are
used again. Memory is bounded: when more than ``device_cap`` pairs wait (a long logging interval), all waiting pairs
are resolved early, with the same single synchronization, and their times kept for their steps. The device figure
is beside the host's parts, not one of them (the host's parts add up to the step); ``device_events`` is the seam
that makes the events (tests give a stand-in); off CUDA it is None and no event is ever made or looked at. This
path has run only against that stand-in on a CPU machine (``tests/runtime/test_device_timing.py``), not on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

from lightning_pipedream.schedule.actions import Op

PARTS = ("compute", "wait", "transfer", "update", "other")

_F, _B, _W, _O = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_WEIGHT, Op.OPTIMIZER_STEP
_RA, _RG = Op.RECV_ACT, Op.RECV_GRAD


def clock() -> float:
    """The clock every span here is read on (seconds; ``perf_counter``: monotonic, and on Linux one clock for all
    processes of a machine)."""
    return time.perf_counter()


@dataclass
class Figures:
    """Sums over some training steps of one rank, in seconds; ``other`` is what the step times leave."""

    steps: int = 0
    step: float = 0.0
    compute: float = 0.0
    wait: float = 0.0
    transfer: float = 0.0
    update: float = 0.0
    device_compute: float = 0.0  # CUDA: the compute actions' time on the device (beside the parts, not one of them)
    device_actions: float = 0.0  # how many compute actions the device timed (0: no device figure)

    @property
    def other(self) -> float:
        return self.step - self.compute - self.wait - self.transfer - self.update

    def per_step_ms(self) -> dict[str, float]:
        """Each part's mean per step in milliseconds, and the step's (``step``); on CUDA also ``device_compute``."""
        n = max(self.steps, 1)
        out = {part: getattr(self, part) * 1e3 / n for part in PARTS}
        out["step"] = self.step * 1e3 / n
        if self.device_actions:
            out["device_compute"] = self.device_compute * 1e3 / n
        return out

    def values(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def of(cls, values: list[float]) -> Figures:
        names = [f.name for f in fields(cls)]
        return cls(int(values[0]), *values[1 : len(names)])

    def __add__(self, other: Figures) -> Figures:
        return Figures(*(a + b for a, b in zip(self.values(), other.values())))  # type: ignore[arg-type]


SLOTS = len(fields(Figures))

DEVICE_CAP = 4096  # compute actions' event pairs kept before they are resolved early (two small CUDA events each)


class DeviceEvent(Protocol):
    """What the accounts use of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self) -> Any: ...

    def synchronize(self) -> Any: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds from this event to ``end``


def cuda_event() -> DeviceEvent:
    """A timing CUDA event (the default of :func:`device_events` on a CUDA device)."""
    import torch

    return torch.cuda.Event(enable_timing=True)


def device_events(device: Any) -> Callable[[], DeviceEvent] | None:
    """What makes the events that time compute on ``device``: :func:`cuda_event` on a CUDA device, None elsewhere (a
    CPU device, or none known). Looks only at ``device.type``: a CPU-only machine never touches ``torch.cuda``."""
    if getattr(device, "type", None) == "cuda":
        return cuda_event
    return None


def _no_device() -> DeviceEvent:
    raise RuntimeError("StepAccounts(events=None) times compute on the host only: the executor records device events "
                       "only where StepAccounts.timing is True.")


class StepAccounts:
    """This rank's time, by part, since the last :meth:`take` (see the module's text).

    ``events``: what makes a device event (:func:`device_events`; None: compute is timed on the host alone);
    ``device_cap``: how many event pairs may wait before they are resolved early (module text)."""

    def __init__(self, events: Callable[[], DeviceEvent] | None = None, device_cap: int = DEVICE_CAP) -> None:
        self.active = False  # inside a training step: actions count
        self.events = events
        self.timing = events is not None  # the executor records event pairs around compute actions
        self._make: Callable[[], DeviceEvent] = events or _no_device
        self.device_cap = max(1, int(device_cap))
        self._pool: list[DeviceEvent] = []  # events resolved, to record again
        self._open_pairs: list[tuple[DeviceEvent, DeviceEvent]] = []  # the step in progress's (or ended, not closed)
        self._closed_pairs: list[tuple[DeviceEvent, DeviceEvent]] = []  # closed steps' since the last take
        self._open = Figures()  # the step in progress (or ended and not yet closed): its parts
        self._now = Figures()  # closed steps since the last take
        self._total = Figures()
        self._step_start: float | None = None
        self._step_end: float | None = None
        self._interrupted = False

    # -- what the executor and the engine call ------------------------------------------------------------------
    def action(self, op: Op, start: float, end: float, sent_at: float | None = None) -> None:
        """One action's span; ``sent_at``: for a receive, when the peer began sending (this rank's clock)."""
        if not self.active:
            return
        now = self._open
        span = end - start
        # Identity tests: an Op is a str Enum, whose == and hash run Python code (a tuple's `in` cost ~3x more).
        if op is _F or op is _B or op is _W:
            now.compute += span
        elif op is _RA or op is _RG:
            if sent_at is None:  # from this rank itself, or a message without tensors: nothing to tell apart
                now.transfer += span
                return
            waited = min(max(sent_at - start, 0.0), span)
            now.wait += waited
            now.transfer += span - waited
        elif op is _O:
            now.update += span
        else:  # sends, the replicas' all-reduce
            now.transfer += span

    def transfer(self, seconds: float) -> None:
        """Communication outside the actions (waiting for a step's sends to be received)."""
        if self.active:
            self._open.transfer += seconds

    def device_begin(self) -> DeviceEvent:
        """Before a compute action (only where :attr:`timing`): an event recorded on the current stream."""
        event = self._pool.pop() if self._pool else self._make()
        event.record()
        return event

    def device_end(self, begin: DeviceEvent) -> None:
        """After the compute action that :meth:`device_begin` began: its end event; nothing waits for it here."""
        end = self._pool.pop() if self._pool else self._make()
        end.record()
        self._open_pairs.append((begin, end))
        if len(self._open_pairs) + len(self._closed_pairs) > self.device_cap:
            self._resolve(early=True)

    def _resolve(self, early: bool = False) -> None:
        """The waiting pairs' device times into their steps' figures: the closed steps' (and, ``early``, the open
        step's too), after one synchronization on the last event recorded of them."""
        closed, opened = self._closed_pairs, self._open_pairs if early else []
        if not closed and not opened:
            return
        (opened or closed)[-1][1].synchronize()
        for pairs, figures in ((closed, self._now), (opened, self._open)):
            if pairs:
                figures.device_compute += sum(begin.elapsed_time(end) for begin, end in pairs) / 1e3
                figures.device_actions += len(pairs)
                for pair in pairs:
                    self._pool.extend(pair)
        self._closed_pairs = []
        if early:
            self._open_pairs = []

    # -- what the strategy calls ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A training step starts here: the previous one ends (at its own end, if something came in between)."""
        now = clock()
        self._close(now if not self._interrupted else self._step_end)
        self._step_start, self._interrupted, self.active = now, False, True

    def end_step(self) -> None:
        self._step_end, self.active = clock(), False

    def interrupt(self) -> None:
        """Evaluation or a checkpoint comes between two steps: the last step ends where its own work ended."""
        self._interrupted = True

    def finish(self) -> None:
        """The fit is over: the last step ends where its work ended."""
        self._close(self._step_end)
        self._step_start = None

    def _close(self, end: float | None) -> None:
        if self._step_start is None or end is None:
            return
        closed, self._open = self._open, Figures()
        closed.steps, closed.step = 1, end - self._step_start
        self._now = self._now + closed
        self._step_start = None
        if self._open_pairs:
            self._closed_pairs.extend(self._open_pairs)
            self._open_pairs = []

    def take(self) -> Figures:
        """The figures of the steps closed since the last call (a step closes when the next one starts), and start
        again. On CUDA their compute actions' device times are resolved here (one synchronization)."""
        self._resolve()
        taken, self._now = self._now, Figures()
        self._total = self._total + taken
        return taken

    @property
    def total(self) -> Figures:
        """Every figure taken so far."""
        return self._total
