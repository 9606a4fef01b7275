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

What it costs: a few additions per action, no synchronization. On CUDA the clock is the host's: compute is the time
to launch kernels and the wait for them shows up in the next host synchronization (a receive's header read); this
module does not read CUDA events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

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

    @property
    def other(self) -> float:
        return self.step - self.compute - self.wait - self.transfer - self.update

    def per_step_ms(self) -> dict[str, float]:
        """Each part's mean per step in milliseconds, and the step's (``step``)."""
        n = max(self.steps, 1)
        out = {part: getattr(self, part) * 1e3 / n for part in PARTS}
        out["step"] = self.step * 1e3 / n
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


class StepAccounts:
    """This rank's time, by part, since the last :meth:`take` (see the module's text)."""

    def __init__(self) -> None:
        self.active = False  # inside a training step: actions count
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

    def take(self) -> Figures:
        """The figures of the steps closed since the last call (a step closes when the next one starts), and start
        again."""
        taken, self._now = self._now, Figures()
        self._total = self._total + taken
        return taken

    @property
    def total(self) -> Figures:
        """Every figure taken so far."""
        return self._total
