"""The action IR: what one rank does, in order, as plain data (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):
    """The kinds of action a rank performs."""

    FORWARD = "F"
    BACKWARD = "B"
    OPTIMIZER_STEP = "O"
    SEND_ACT = "SA"  # send a forward output to the next stage (asynchronous)
    RECV_ACT = "RA"  # receive a forward input from the previous stage (blocking)
    SEND_GRAD = "SG"  # send an input-gradient to the previous stage (asynchronous)
    RECV_GRAD = "RG"  # receive an output-gradient from the next stage (blocking)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACT, Op.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACT, Op.RECV_GRAD)

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD)


@dataclass(frozen=True)
class Action:
    """One thing one rank does.

    ``stage`` is the pipeline stage the action belongs to (equal to the rank, except for
    schedules with several model chunks per rank). ``microbatch`` numbers micro-batches within a
    training step for flushed schedules, and minibatches within a run of steps for ``pipedream``.
    ``peer`` is the rank at the other end of a send or receive. ``step`` is the training step
    (one Lightning batch) in which the action runs; it only differs from 0 in schedules that keep
    the pipeline full across steps.
    """

    op: Op
    stage: int
    microbatch: int | None = None
    peer: int | None = None
    step: int = 0

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        text = f"{self.op.value}{mb}"
        if self.op.is_send or self.op.is_recv:
            text += f"@{self.peer}"
        return text


@dataclass(frozen=True)
class Schedule:
    """Every rank's list of actions for one schedule and size.

    ``chunks`` is the number of micro-batches one training step splits its batch into (1 for
    ``pipedream``); ``minibatches`` the number of batches the action lists admit (1 for a flushed
    schedule, the minibatches before the drain for ``pipedream``). Action micro-batch numbers run
    over ``0 .. chunks * minibatches - 1``.

    ``num_ranks`` is kept apart from ``num_stages``: the validator and the simulator already handle
    several stages per rank (stage s on rank s % num_ranks), which interleaved schedules need.
    """

    name: str
    num_ranks: int
    num_stages: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...]  # actions[rank] in execution order
    minibatches: int = 1

    def rank_of(self, stage: int) -> int:
        """Stages are laid out round-robin over ranks (stage s lives on rank s % num_ranks)."""
        return stage % self.num_ranks

    def steps(self) -> int:
        """How many training steps the schedule spans (1 for flushed schedules)."""
        return 1 + max((a.step for rank in self.actions for a in rank), default=0)

    @property
    def microbatch_count(self) -> int:
        """How many micro-batch numbers the actions use: ``chunks * minibatches``."""
        return self.chunks * self.minibatches

    def size(self) -> str:
        """``"4 stages x 8 chunks"``, or ``"... x 8 minibatches"`` for a schedule that runs several."""
        count = f"{self.minibatches} minibatches" if self.minibatches > 1 else f"{self.chunks} chunks"
        return f"{self.num_stages} stages x {count}"
