"""One ScheduleSpec per schedule name: the properties every other layer asks for instead of comparing names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule is, as the engine, the strategy, the planner and the CLI need to know it.

    Attributes:
        name: the name users give (``PipeDreamStrategy(schedule=...)``, ``build_schedule``).
        asynchronous: the pipeline stays full across training steps; a drain empties it (pipedream, 2bw).
        exact: a training step equals one device's step on the whole batch (the flushed schedules).
        microbatches: a batch is split into ``chunks`` micro-batches (False: each batch is one minibatch).
        minibatch_updates: every minibatch makes its own update on each stage (PipeDream): under replicated
            stages each data shard is a minibatch of its own and a stage averages its replicas' gradients.
        weight_versions: weight versions a stage keeps: 1, 2 (2BW) or one per minibatch in flight (PipeDream's
            weight stashing, ``None``).
        unequal_replicas: runs stages with different replica counts (PipeDream's 1F1B-RR).
        virtual_stages: runs several model chunks per rank (interleaved).
        splits_backward: each backward is split into input-gradient and weight-gradient passes (zero bubble).
        v_shape: exactly two model chunks per rank, placed in a V (rank r holds stages r and 2P-1-r, so the last
            stage, where the loss is, lives on rank 0): zb-v, dualpipev.
    """

    name: str
    asynchronous: bool
    exact: bool
    microbatches: bool
    minibatch_updates: bool = False
    weight_versions: int | None = 1
    unequal_replicas: bool = False
    virtual_stages: bool = False
    splits_backward: bool = False
    v_shape: bool = False

    @property
    def flushes(self) -> bool:
        """Every training step ends with an empty pipeline (the synchronous schedules)."""
        return not self.asynchronous

    @property
    def several_minibatches_per_step(self) -> bool:
        """A training step may admit several minibatches, each with its own update: its actions are those of as many
        one-minibatch steps, one after another (pipedream; ``minibatches_per_batch``)."""
        return self.asynchronous and self.minibatch_updates and not self.microbatches

    @property
    def two_weight_versions(self) -> bool:
        """PipeDream-2BW's rule: gradients coalesced over a step's micro-batches, the update applied a step late."""
        return self.weight_versions == 2


SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", asynchronous=False, exact=True, microbatches=True, unequal_replicas=True),
        ScheduleSpec("1f1b", asynchronous=False, exact=True, microbatches=True, unequal_replicas=True),
        ScheduleSpec("pipedream", asynchronous=True, exact=False, microbatches=False, minibatch_updates=True,
                     weight_versions=None, unequal_replicas=True),
        ScheduleSpec("2bw", asynchronous=True, exact=False, microbatches=True, weight_versions=2),
        ScheduleSpec("interleaved", asynchronous=False, exact=True, microbatches=True, virtual_stages=True),
        ScheduleSpec("zb-h1", asynchronous=False, exact=True, microbatches=True, splits_backward=True),
        ScheduleSpec("zb-v", asynchronous=False, exact=True, microbatches=True, virtual_stages=True,
                     splits_backward=True, v_shape=True),
        ScheduleSpec("dualpipev", asynchronous=False, exact=True, microbatches=True, virtual_stages=True,
                     splits_backward=True, v_shape=True),
    )
}

SCHEDULES = tuple(SPECS)
# Not a schedule: PipeDreamStrategy(schedule=AUTO) lets the planner (plan/auto.py) choose one, with the split,
# replicas, micro-batches and recompute, under a memory limit.
AUTO = "auto"
ASYNCHRONOUS = tuple(name for name, spec in SPECS.items() if spec.asynchronous)
REPLICATED_SCHEDULES = tuple(name for name, spec in SPECS.items() if spec.unequal_replicas)
V_SCHEDULES = tuple(name for name, spec in SPECS.items() if spec.v_shape)
# Model chunks per rank of a V schedule: the only number it runs (one chunk down the ranks, one back up).
V_CHUNKS = 2


def spec_of(name: str) -> ScheduleSpec:
    """The spec of schedule ``name``; an unknown name raises an error that lists the known ones."""
    try:
        return SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown schedule {name!r}. Choose one of: {', '.join(SCHEDULES)}.") from None
