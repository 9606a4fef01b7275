"""The action IR: what one rank does, in order, as plain data (no torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property


class Op(str, Enum):
    """The kinds of action a rank performs."""

    FORWARD = "F"
    # The backward of a micro-batch; in a schedule that also has BACKWARD_WEIGHT for it (zero
    # bubble), only its input-gradient half: the half the previous stage waits for.
    BACKWARD = "B"
    # The weight-gradient half of a split backward (zero bubble): the parameters' gradients of a
    # micro-batch whose BACKWARD already ran; nobody waits for it, so it can fill a bubble.
    BACKWARD_WEIGHT = "W"
    OPTIMIZER_STEP = "O"
    SEND_ACT = "SA"  # send a forward output to the next stage (asynchronous)
    RECV_ACT = "RA"  # receive a forward input from the previous stage (blocking)
    SEND_GRAD = "SG"  # send an input-gradient to the previous stage (asynchronous)
    RECV_GRAD = "RG"  # receive an output-gradient from the next stage (blocking)
    # Sum the gradients over the replicas of a replicated stage (blocking, collective): every
    # replica's n-th ALLREDUCE_GRAD of a stage meets the other replicas' n-th.
    ALLREDUCE_GRAD = "AR"

    @property
    def is_send(self) -> bool:
        return self is Op.SEND_ACT or self is Op.SEND_GRAD

    @property
    def is_recv(self) -> bool:
        return self is Op.RECV_ACT or self is Op.RECV_GRAD

    @property
    def is_compute(self) -> bool:
        return self is Op.FORWARD or self is Op.BACKWARD or self is Op.BACKWARD_WEIGHT

    @property
    def is_collective(self) -> bool:
        return self is Op.ALLREDUCE_GRAD


# (source rank, destination rank) of a message, as actions name their peers (None only in a malformed schedule)
Link = tuple[int | None, int | None]


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

    ``num_ranks`` is kept apart from ``num_stages``: interleaved schedules put several stages on a
    rank (stage s on rank s % num_ranks: rank r holds model chunks r, r + num_ranks, ...).
    ``v_shape`` (zb-v, dualpipev) places two stages per rank in a V instead: rank r holds stages r
    and 2P-1-r (see :func:`v_rank`), so the first and last stages share rank 0.

    ``replicas`` (one count per stage, e.g. ``(2, 1)``) makes a replicated schedule laid out by
    :class:`Layout`: stage s runs on ``replicas[s]`` ranks, micro-batch m on replica
    ``m % replicas[s]`` (PipeDream's 1F1B-RR). Each training step admits ``chunks`` micro-batches
    per replica of the input stage (one data shard each), so micro-batch numbers run over
    ``0 .. chunks * minibatches * replicas[0] - 1``. ``None``: one rank per stage.
    """

    name: str
    num_ranks: int
    num_stages: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...]  # actions[rank] in execution order
    minibatches: int = 1
    replicas: tuple[int, ...] | None = None
    v_shape: bool = False

    @property
    def layout(self) -> Layout | None:
        """Where a replicated schedule's stages live (None: one rank per stage, or stages round-robin)."""
        return None if self.replicas is None else Layout(self.replicas)

    def rank_of(self, stage: int) -> int:
        """Stages are laid out round-robin over ranks (stage s lives on rank s % num_ranks), or in a V."""
        if self.replicas is not None:
            raise ValueError("A replicated stage lives on several ranks; use Schedule.owner(stage, microbatch).")
        return v_rank(stage, self.num_ranks) if self.v_shape else stage % self.num_ranks

    def owner(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``microbatch`` on ``stage``."""
        return self.rank_of(stage) if self.replicas is None else Layout(self.replicas).owner(stage, microbatch)

    def stages_of(self, rank: int) -> Sequence[int]:
        """The stages that live on ``rank``, in increasing order."""
        if self.replicas is not None:
            stage = Layout(self.replicas).stage_of(rank)
            return range(stage, stage + 1)
        if self.v_shape:
            return (rank, 2 * self.num_ranks - 1 - rank)
        return range(rank, self.num_stages, self.num_ranks)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per rank (1 unless the schedule is interleaved)."""
        return 1 if self.replicas is not None else self.num_stages // self.num_ranks

    @cached_property
    def splits_backward(self) -> bool:
        """Whether the backwards are split into input- and weight-gradient halves (BACKWARD_WEIGHT actions)."""
        return any(a.op is Op.BACKWARD_WEIGHT for rank in self.actions for a in rank)

    def steps(self) -> int:
        """How many training steps the schedule spans (1 for flushed schedules)."""
        return 1 + max((a.step for rank in self.actions for a in rank), default=0)

    @property
    def microbatch_count(self) -> int:
        """How many micro-batch numbers the actions use: ``chunks * minibatches`` (times the input stage's replicas)."""
        shards = 1 if self.replicas is None else self.replicas[0]
        return self.chunks * self.minibatches * shards

    def size(self) -> str:
        """``"4 stages x 8 chunks"``, or ``"... x 8 minibatches"`` for a schedule that runs several."""
        count = f"{self.minibatches} minibatches" if self.minibatches > 1 else f"{self.chunks} chunks"
        where = "" if self.replicas is None else f" (replicas {','.join(map(str, self.replicas))})"
        return f"{self.num_stages} stages{where} x {count}"


def v_rank(stage: int, num_ranks: int) -> int:
    """The rank of ``stage`` in a V placement of ``2 * num_ranks`` stages: down the ranks, then back up
    (rank r holds stages r and 2P-1-r; stage P-1 hands over to stage P on the same rank)."""
    return stage if stage < num_ranks else 2 * num_ranks - 1 - stage


@dataclass(frozen=True)
class Layout:
    """Stages with replicas placed on ranks, stage-major: stage 0's replicas first, then stage 1's...

    ``Layout((2, 1))``: stage 0 on ranks 0 and 1, stage 1 on rank 2. For d data-parallel copies of
    a p-stage pipeline (``Layout.data_parallel(p, d)``) rank ``s * d + k`` holds stage s of
    pipeline k. Stage-major keeps a stage's replicas on neighbouring ranks (one server when ranks
    fill servers in order), so the gradient all-reduce, whose size is the stage's parameters,
    stays on the fastest links and only activations cross servers (Megatron-LM orders its
    pipeline dimension outermost for the same reason; PipeDream's plans number ranks this way).
    """

    replicas: tuple[int, ...]

    def __post_init__(self) -> None:
        counts = tuple(self.replicas)
        if not counts or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in counts):
            raise ValueError(
                f"replicas must list one whole number >= 1 per stage (e.g. (2, 1)), got {self.replicas!r}."
            )
        object.__setattr__(self, "replicas", counts)

    @classmethod
    def data_parallel(cls, num_stages: int, copies: int) -> Layout:
        """``copies`` data-parallel pipelines of ``num_stages`` stages: every stage has ``copies`` replicas."""
        return cls((copies,) * num_stages)

    @classmethod
    def of(cls, replicas: Sequence[int] | None, num_stages: int) -> Layout:
        """The layout for ``replicas`` (checked against ``num_stages``); None means one rank per stage."""
        layout = cls(tuple(replicas) if replicas is not None else (1,) * num_stages)
        if layout.num_stages != num_stages:
            raise ValueError(
                f"replicas {list(layout.replicas)} lists {layout.num_stages} stages but there are {num_stages}; "
                "give one replica count per stage."
            )
        return layout

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def num_ranks(self) -> int:
        return sum(self.replicas)

    @property
    def input_replicas(self) -> int:
        """Replicas of stage 0: the data shards each training step reads (the data-parallel degree)."""
        return self.replicas[0]

    @property
    def is_replicated(self) -> bool:
        return any(r > 1 for r in self.replicas)

    @property
    def is_uniform(self) -> bool:
        """Every stage has the same replica count: d data-parallel copies of the pipeline."""
        return len(set(self.replicas)) == 1

    def ranks_of(self, stage: int) -> range:
        """The ranks that hold ``stage``, replica 0 first."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is out of range 0..{self.num_stages - 1}.")
        first = sum(self.replicas[:stage])
        return range(first, first + self.replicas[stage])

    def stage_of(self, rank: int) -> int:
        """The stage ``rank`` holds."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} is out of range 0..{self.num_ranks - 1} for replicas {list(self.replicas)}.")
        end = 0
        for stage, count in enumerate(self.replicas):
            end += count
            if rank < end:
                return stage
        raise AssertionError("unreachable")

    def replica_of(self, rank: int) -> int:
        """Which replica of its stage ``rank`` is (0-based)."""
        return rank - self.ranks_of(self.stage_of(rank)).start

    def owner(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``microbatch`` on ``stage``: replicas take micro-batches round robin."""
        ranks = self.ranks_of(stage)
        return ranks[microbatch % len(ranks)]

    def shard_of(self, microbatch: int) -> int:
        """The data shard (input replica) a micro-batch comes from: ``microbatch % replicas[0]``."""
        return microbatch % self.input_replicas

    def in_flight(self, stage: int) -> int:
        """Minibatches PipeDream keeps in flight on each replica of ``stage``.

        PipeDream's rule: ceil(ranks of this and later stages / replicas of this stage), which is
        NOAM = ceil(#workers / #replicas of the input stage) on the input stage and ``p - s`` in a
        straight pipeline (its runtime warms up with one forward fewer).
        """
        following = sum(self.replicas[stage:])
        return math.ceil(following / self.replicas[stage])

    def shards_of(self, rank: int) -> tuple[int, ...]:
        """The data shards whose samples ``rank`` reads: its inputs (first stage) or targets (last stage).

        A middle stage reads none. A rank that reads exactly one shard can use a sampler of
        ``input_replicas`` replicas at that shard's index; one that reads several (the single last
        stage of a 2-1 plan) needs them all.
        """
        stage = self.stage_of(rank)
        if 0 < stage < self.num_stages - 1:
            return ()
        r, d = self.replicas[stage], self.input_replicas
        k = self.replica_of(rank)
        # Micro-batches m with m % r == k come from shards m % d: every j with j = k (mod gcd(r, d)).
        g = math.gcd(r, d)
        return tuple(j for j in range(d) if j % g == k % g)
