"""Where the stages live: a frozen Placement (stages, replicas, ranks, the groups' members), checked in one process."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch.distributed as dist

from lightning_pipedream.schedule.actions import Layout
from lightning_pipedream.schedule.specs import ScheduleSpec, spec_of


@dataclass(frozen=True)
class Placement:
    """Which stage (and which pipeline) each rank holds, and the members of every process group.

    Two layouts exist. ``d`` data-parallel pipelines of ``p`` stages (``stages=p`` on ``p * d`` processes, or
    equal ``replicas``): ranks are stage-major, stage ``s`` of pipeline ``k`` being rank ``s * d + k``, so that a
    stage's replicas are neighbours (on one node when they fit) and all-reduce over fast links. Or stages with
    unequal replica counts (PipeDream's 1F1B-RR, ``layout``): one pipeline over the whole world, stage ``s``'s
    replicas being ranks ``sum(replicas[:s])`` onwards.

    Build it with :meth:`decide`, which checks the configuration and says how to fix it.
    """

    rank: int
    world_size: int
    num_stages: int
    asynchronous: bool  # the schedule keeps the pipeline full: pipedream's summaries travel on a group of their own
    layout: Layout | None = None  # unequal replicas (1F1B-RR); None for d equal pipelines
    v_shape: bool = False  # zb-v, dualpipev: the model's last stage (the loss) is on the pipeline's first rank

    @classmethod
    def decide(
        cls,
        schedule: str,
        world_size: int,
        rank: int = 0,
        *,
        stages: int | None = None,
        replicas: list[int] | tuple[int, ...] | None = None,
        accumulate_grad_batches: int = 1,
    ) -> Placement:
        """The placement of ``stages`` (default: one per process) or per-stage ``replicas`` on ``world_size``
        processes, for ``schedule``; raises ``ValueError`` for a configuration that cannot run."""
        spec = spec_of(schedule)
        if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
            raise ValueError(f"stages must be an integer >= 1 (the pipeline's length), got {stages!r}.")
        if replicas is not None and all(r == 1 for r in replicas):
            replicas = None  # one replica per stage: a straight pipeline
        layout = None
        if replicas is not None:
            layout = Layout(tuple(replicas))
            if layout.num_ranks != world_size:
                raise ValueError(
                    f"replicas {list(replicas)} need {layout.num_ranks} processes but the Trainer runs {world_size}; "
                    f"set devices x num_nodes to {layout.num_ranks}, or change the replicas."
                )
            if stages is not None and stages != layout.num_stages:
                raise ValueError(
                    f"stages={stages} but replicas {list(replicas)} give {layout.num_stages} stages; drop one of them."
                )
            stages = layout.num_stages
            if layout.is_uniform:  # equal counts: data-parallel pipelines
                layout = None
            else:
                _check_unequal_replicas(spec, list(replicas), accumulate_grad_batches)
        p = stages if stages is not None else world_size
        if layout is None and world_size % p != 0:
            raise ValueError(
                f"PipeDreamStrategy(stages={p}) runs on {world_size} processes: the processes must be a multiple of "
                f"the stages (d data-parallel pipelines of {p} stages). Use devices x num_nodes = {p} x d, or stages "
                f"dividing {world_size}."
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size} processes.")
        return cls(rank, world_size, p, spec.asynchronous, layout, spec.v_shape)

    # ------------------------------------------------------------------------------- this rank
    @property
    def num_pipelines(self) -> int:
        """Data-parallel copies of the pipeline: processes / stages (1 with unequal replicas)."""
        return 1 if self.layout is not None else self.world_size // self.num_stages

    @property
    def stage_index(self) -> int:
        """The stage this rank holds."""
        if self.layout is not None:
            return self.layout.stage_of(self.rank)
        return self.rank // self.num_pipelines

    @property
    def pipeline_index(self) -> int:
        """Which data-parallel pipeline this rank belongs to (0 with unequal replicas)."""
        return 0 if self.layout is not None else self.rank % self.num_pipelines

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the model's last stage, where the loss is computed (the first rank under a V schedule,
        whose chunks go down the ranks and back up)."""
        return self.stage_index == self.last_stage_index

    @property
    def last_stage_index(self) -> int:
        """The pipeline position (rank in the pipeline's group) that holds the model's last stage."""
        return 0 if self.v_shape else self.num_stages - 1

    @property
    def replica_index(self) -> int:
        """This rank's place among its stage's replicas."""
        return self.layout.replica_of(self.rank) if self.layout is not None else self.pipeline_index

    @property
    def round_robin(self) -> bool:
        """Stages with unequal replica counts (PipeDream's 1F1B-RR): micro-batches go round robin over replicas."""
        return self.layout is not None

    @property
    def input_shards(self) -> int:
        """Data shards one training batch is cut into inside a pipeline: the input stage's replicas under 1F1B-RR."""
        return self.layout.input_replicas if self.layout is not None else 1

    @property
    def sampler_kwargs(self) -> dict[str, int]:
        """Every stage of a pipeline reads the same batches: the sampler's replicas are the pipelines."""
        return {"num_replicas": self.num_pipelines, "rank": self.pipeline_index}

    def last_stage_ranks(self) -> list[int]:
        """The ranks, in the pipeline's group, that compute the loss: the last stage's replicas under 1F1B-RR (the
        first of which evaluates), else the last stage."""
        if self.layout is not None:  # the pipeline's group is the world
            return list(self.layout.ranks_of(self.layout.num_stages - 1))
        return [self.last_stage_index]

    def first_replica_ranks(self) -> list[int]:
        """For each stage, the rank of its first replica (evaluation runs on those under 1F1B-RR)."""
        if self.layout is None:
            return list(range(self.num_stages))
        return [self.layout.ranks_of(s)[0] for s in range(self.layout.num_stages)]

    # ---------------------------------------------------------------------------------- groups
    def pipeline_ranks(self) -> list[list[int]]:
        """The members of every pipeline's group (point-to-point traffic), in creation order."""
        if self.layout is not None:
            return [list(range(self.world_size))]
        d = self.num_pipelines
        return [[s * d + k for s in range(self.num_stages)] for k in range(d)]

    def replica_ranks(self) -> list[list[int]]:
        """The members of every stage's replica group (gradient all-reduce), in creation order; a stage with one
        replica has none."""
        if self.layout is not None:
            return [list(self.layout.ranks_of(s)) for s in range(self.layout.num_stages)]
        d = self.num_pipelines
        return [[s * d + k for k in range(d)] for s in range(self.num_stages)] if d > 1 else []

    @property
    def lagged_summaries(self) -> bool:
        """The step summaries travel on a group of their own, used ``stages - 1`` steps late (pipedream, 2bw)."""
        return self.asynchronous and (self.num_stages > 1 or self.layout is not None)


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups: its pipeline's, its summaries' (asynchronous schedules) and its replicas'.

    Each point-to-point group has a twin of the same ranks for the messages that go the other way (to lower
    ranks; the data check's fingerprints, to the last stage): under NCCL both directions of a link on one group
    share one stream and block each other (see :class:`~lightning_pipedream.runtime.communication.transport.Transport`).
    """

    pipeline: dist.ProcessGroup | None = None
    summaries: dist.ProcessGroup | None = None
    replicas: dist.ProcessGroup | None = None
    pipeline_reverse: dist.ProcessGroup | None = None
    summaries_reverse: dist.ProcessGroup | None = None

    @classmethod
    def make(cls, placement: Placement, backend: str | None, timeout: timedelta | None) -> ProcessGroups:
        """Create every group of ``placement`` (``new_group`` is collective: every rank makes every group, in the
        same order) and keep this rank's. Groups made here carry the strategy's timeout (a DeviceMesh's would
        wait torch's default 30 minutes)."""
        def new_group(members: list[int] | None) -> dist.ProcessGroup:
            return cast(dist.ProcessGroup, dist.new_group(members, backend=backend, timeout=timeout))

        rank = placement.rank
        pipeline: dist.ProcessGroup | None = None
        summaries: dist.ProcessGroup | None = None
        replicas: dist.ProcessGroup | None = None
        pipeline_reverse: dist.ProcessGroup | None = None
        summaries_reverse: dist.ProcessGroup | None = None
        single = placement.layout is None and placement.num_pipelines == 1
        for ranks in placement.pipeline_ranks():
            if single and placement.num_stages == 1:
                break  # one process per pipeline and no replicas: nothing to talk to
            # One pipeline over the whole world: the default group's members, but a group of its own.
            members = None if single or placement.layout is not None else ranks
            group, reverse = new_group(members), new_group(members)
            lagged = (new_group(members), new_group(members)) if placement.lagged_summaries else (None, None)
            if rank in ranks:
                pipeline, pipeline_reverse = group, reverse
                summaries, summaries_reverse = lagged
        for ranks in placement.replica_ranks():
            replica_group = new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                replicas = replica_group
        return cls(pipeline, summaries, replicas, pipeline_reverse, summaries_reverse)


def _check_unequal_replicas(spec: ScheduleSpec, replicas: list[int], accumulate_grad_batches: int) -> None:
    if not spec.unequal_replicas:
        raise ValueError(
            f"Stages with unequal replica counts ({replicas}) run with schedule='pipedream', 'gpipe' or "
            f"'1f1b' under PipeDreamStrategy, not {spec.name!r}. Use one of those, or equal replicas "
            "(data-parallel pipelines)."
        )
    if spec.minibatch_updates and accumulate_grad_batches > 1:
        raise ValueError(
            f"PipeDreamStrategy(schedule={spec.name!r}) with replicas {replicas} and "
            f"accumulate_grad_batches={accumulate_grad_batches}: PipeDream's 1F1B-RR makes each shard "
            "a minibatch of its own and does not accumulate. Use a larger batch instead, or schedule='1f1b'."
        )
