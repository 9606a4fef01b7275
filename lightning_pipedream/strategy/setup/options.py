"""PipeDreamStrategy's own arguments as one frozen value, checked when the strategy is built (before any process)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_pipedream.plan.shards import check_shard_choice
from lightning_pipedream.runtime.communication.transport import transport_kind
from lightning_pipedream.runtime.stages.sharding import SHARD_MODES, check_shard
from lightning_pipedream.schedule.builders import check_schedule_options, v_virtual_stages
from lightning_pipedream.schedule.specs import AUTO, ScheduleSpec, spec_of

ON_DIVERGENCE = (None, "flush")  # the divergence guard (strategy/training/divergence.py): off, or back to 1f1b
DEFAULT_FACTOR = 2.0  # the smoothed loss may rise to this many times its lowest before the guard steps in

ARGUMENT_OF = {"plan_path": "plan", "trace_dir": "trace"}  # fields whose argument has another name


@dataclass(frozen=True)
class PipelineOptions:
    """What the user chose: the schedule and its options, how to split the model, what to check and record.

    Every combination that cannot run is refused here, in the process that builds the Trainer, with the fix.
    Each field is the argument of :class:`~lightning_pipedream.PipeDreamStrategy` of the same name (``plan_path`` is
    ``plan=``, ``trace_dir`` is ``trace=``), documented there, and comes from it by that name (:meth:`from_arguments`).
    """

    schedule: str = "pipedream"
    chunks: int = 1
    balance: tuple[int, ...] | None = None
    plan_path: str | os.PathLike | None = None
    layers: str | None = None
    split_points: tuple[str, ...] | None = None
    weight_stashing: bool = True
    vertical_sync: bool = False
    bandwidth: float | tuple[float, ...] = 1e9
    trace_dir: str | os.PathLike | None = None
    stages: int | None = None
    replicas: tuple[int, ...] | None = None
    check_finite: bool = False
    straight: bool = True
    virtual_stages: int = 1
    recompute: bool | tuple[bool, ...] = False
    keep_freed_memory: bool = True
    mean_over: Callable[[Any], Any] | None = None
    memory_limit: float | None = None
    exact: bool = False
    on_divergence: str | None = None
    divergence_factor: float = DEFAULT_FACTOR
    minibatches_per_batch: int = 1
    transport: str | None = None
    shard: str | None = None
    pretrained: str | os.PathLike | None = None
    pretrained_prefix: str | None = None
    log_figures: bool = True
    trace_steps: tuple[int, int] | None = None
    trace_memory: bool = False  # with trace=: each stage's live tensor bytes over the window (reporting/live_memory.py)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> PipelineOptions:
        """The options from ``PipeDreamStrategy``'s arguments (its ``locals()``), each field by its argument's name,
        lists as tuples: an option added or moved in either place shifts no other."""
        values = {}
        for field in fields(cls):
            name = ARGUMENT_OF.get(field.name, field.name)
            if name not in arguments:
                raise TypeError(f"PipelineOptions.{field.name} has no argument {name}= in PipeDreamStrategy.__init__")
            values[field.name] = arguments[name]
        for name in ("balance", "split_points", "replicas", "trace_steps"):
            values[name] = tuple_or_none(values[name])
        for name in ("bandwidth", "recompute"):  # one value, or one per link kind / model stage
            if isinstance(values[name], (list, tuple)):
                values[name] = tuple(values[name])
        return cls(**values)

    def __post_init__(self) -> None:
        window = self.trace_steps
        whole = window is not None and all(isinstance(v, int) and not isinstance(v, bool) for v in window)
        if window is not None and (len(window) != 2 or not whole or window[0] < 0 or window[1] < 1):
            raise ValueError(f"trace_steps={self.trace_steps!r} is not a window of steps: give (first, count), the "
                             "first training step to record (from 0) and how many, e.g. trace_steps=(10, 5).")
        if self.trace_memory and self.trace_dir is None:
            raise ValueError("trace_memory=True measures each stage's live tensors over the traced steps: it needs "
                             "trace=DIR (and trace_steps= for a window of them). Give trace=, or drop trace_memory.")
        if self.pretrained is not None and not os.path.exists(self.pretrained):
            from lightning_pipedream.runtime.stages.loading import FORMATS

            raise ValueError(f"pretrained={str(self.pretrained)!r} does not exist. Give {FORMATS}.")
        if self.transport is not None:
            transport_kind(self.transport)  # an unknown name is refused here, with the choices
        if self.shard is not None:
            self._check_shard()
        if self.auto:
            self._check_auto()
        else:
            # zb-v and dualpipev run two chunks per rank: virtual_stages' default (1) means those two.
            object.__setattr__(self, "virtual_stages", v_virtual_stages(self.schedule, self.virtual_stages))
            check_schedule_options(self.schedule, self.chunks, self.vertical_sync,
                                   virtual_stages=self.virtual_stages, recompute=self.recompute)
            if self.memory_limit is not None or self.exact:
                raise ValueError(
                    f"memory_limit= and exact= apply to schedule='auto' (the planner chooses the schedule under "
                    f"them); schedule={self.schedule!r} is fixed. Drop them, or use schedule='auto'."
                )
        if self.plan_path is not None and self.virtual_stages > 1:
            raise ValueError(
                "PipeDreamStrategy(plan=...) gives one layer range per process; schedule='interleaved' with "
                f"virtual_stages={self.virtual_stages} needs processes x {self.virtual_stages} of them. Give balance= "
                "with that many layer counts, or drop plan= for an even split."
            )
        if self.split_points is not None and self.layers is not None:
            raise ValueError(
                "PipeDreamStrategy takes layers= (split an nn.Sequential between its layers) or split_points= (split "
                "the traced forward graph at module names), not both."
            )
        if not self.straight:
            given = [name for name, value in (("plan", self.plan_path), ("balance", self.balance),
                                              ("replicas", self.replicas), ("stages", self.stages),
                                              ("split_points", self.split_points)) if value is not None]
            if given:
                raise ValueError(
                    f"PipeDreamStrategy(straight=False) lets the planner choose stages and replicas, but {given} "
                    "already decide them. Drop those, or keep straight=True."
                )
        if self.mean_over is not None and not callable(self.mean_over):
            raise ValueError(
                f"mean_over must be a function of a batch (or micro-batch) returning what the loss averages over in "
                f"it, e.g. mean_over=lambda batch: (batch['labels'] != -100).sum(); got {self.mean_over!r}."
            )
        self._check_divergence_guard()
        self._check_minibatches_per_batch()
        if self.stages is not None and (not isinstance(self.stages, int) or isinstance(self.stages, bool)
                                        or self.stages < 1):
            raise ValueError(f"stages must be an integer >= 1 (the pipeline's length), got {self.stages!r}.")

    def _check_divergence_guard(self) -> None:
        if self.on_divergence not in ON_DIVERGENCE:
            raise ValueError(f"on_divergence={self.on_divergence!r} is not a choice: use None (the default: no guard) "
                             "or 'flush' (after a divergence, go back to the last drained weights and go on under "
                             "1f1b).")
        factor = self.divergence_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
            raise ValueError(f"divergence_factor={factor!r}: give a number > 1, how many times its lowest value the "
                             "smoothed loss may reach before on_divergence steps in.")
        if self.on_divergence is not None and not self.auto and not spec_of(self.schedule).asynchronous:
            raise ValueError(f"on_divergence={self.on_divergence!r} guards the asynchronous schedules (pipedream, "
                             f"2bw), whose stale weights can diverge; schedule={self.schedule!r} computes what one "
                             "device would. Drop on_divergence, or use schedule='pipedream' or '2bw'.")

    def _check_minibatches_per_batch(self) -> None:
        k = self.minibatches_per_batch
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"minibatches_per_batch={k!r}: give an integer >= 1, the minibatches (each with its own "
                             "update) that schedule='pipedream' cuts each batch into.")
        if k > 1 and self.auto:
            raise ValueError(
                f"minibatches_per_batch={k} cuts each batch into PipeDream minibatches, each with its own update; "
                "schedule='auto' chooses the schedule (and how a batch is cut) when training starts. Name "
                "schedule='pipedream', or drop minibatches_per_batch."
            )
        if k > 1 and not self.spec.several_minibatches_per_step:
            raise ValueError(
                f"minibatches_per_batch={k} cuts each batch into PipeDream minibatches, each with its own update: "
                f"schedule='pipedream' only. schedule={self.schedule!r} makes one update per batch; cut the batch "
                "into micro-batches with chunks= instead, or use schedule='pipedream'."
            )

    @property
    def auto(self) -> bool:
        """The planner chooses the schedule and the split at setup (``schedule='auto'``)."""
        return self.schedule == AUTO

    def _check_shard(self) -> None:
        """What sharded replicas cannot run, refused before any process starts (the layout is checked at setup)."""
        if self.auto:  # the planner shards only what can be: equal replicas of a flushed schedule
            if self.shard not in SHARD_MODES and self.shard != "auto":
                check_shard_choice(self.shard)  # the planner's words, with its choices
            return
        if self.shard == "auto":
            raise ValueError(f"shard='auto' lets the planner weigh whole against sharded replicas, which it does under "
                             f"schedule='auto'; schedule={self.schedule!r} is fixed. Use schedule='auto' (with "
                             "memory_limit=), or choose shard='full', 'grad_op' or None yourself.")
        spec = self.spec
        if spec.v_shape:
            raise ValueError(f"shard={self.shard!r} does not combine with schedule={self.schedule!r} yet (two model "
                             "chunks per process in a V). Use schedule='zb-h1' or 'interleaved' with shard=, or "
                             "shard=None.")
        check_shard(self.shard, self.schedule, asynchronous=spec.asynchronous, replicas=(2, 2))
        unequal = self.replicas is not None and (len(set(self.replicas)) != 1 or self.replicas[0] < 2)
        if unequal or not self.straight:
            raise ValueError(f"shard={self.shard!r} shards the replicas of data-parallel pipelines (stages= with "
                             "devices = stages x copies); it does not combine with unequal replicas= or "
                             "straight=False yet (equal replicas=[d] * stages, d >= 2, are such copies and do). Drop "
                             "those, or shard=None.")

    def _check_auto(self) -> None:
        given = [name for name, value in (("plan", self.plan_path), ("balance", self.balance),
                                          ("replicas", self.replicas), ("stages", self.stages),
                                          ("split_points", self.split_points), ("chunks", self.chunks != 1 or None),
                                          ("virtual_stages", self.virtual_stages != 1 or None),
                                          ("recompute", self.recompute or None),
                                          ("vertical_sync", self.vertical_sync or None)) if value is not None]
        if given:
            raise ValueError(
                f"PipeDreamStrategy(schedule='auto') lets the planner choose the schedule, split, replicas, "
                f"micro-batches and recompute, but {given} already decide some of them. Drop those, or name a "
                "schedule."
            )
        limit = self.memory_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            raise ValueError(f"memory_limit is {limit!r}; give bytes per process > 0, or None for no limit.")

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's properties (asynchronous, micro-batches, replicas, ...)."""
        if self.auto:
            raise RuntimeError("schedule='auto' is decided in setup; ask for the schedule's properties after it.")
        return spec_of(self.schedule)

    @property
    def link_bandwidth(self) -> float:
        """The bandwidth between two stages of one pipeline (within a node when two are given)."""
        return float(self.bandwidth[0] if isinstance(self.bandwidth, tuple) else self.bandwidth)

    def load_plan(self) -> Any:
        """The ``plan=`` file as a Plan (None without one); a missing, unreadable or malformed file is named."""
        if self.plan_path is None:
            return None
        from lightning_pipedream.plan.partition import Plan

        if not os.path.isfile(self.plan_path):
            raise ValueError(
                f"PipeDreamStrategy(plan={str(self.plan_path)!r}): no such file. Write one with `python -m "
                "lightning_pipedream plan --profile PROFILE.json --workers N --bandwidth B --straight --save "
                f"{self.plan_path}`, or drop plan= to profile the model when training starts."
            )
        try:
            return Plan.load(os.fspath(self.plan_path))
        except OSError as err:
            raise ValueError(f"PipeDreamStrategy(plan={str(self.plan_path)!r}) cannot be read: {err}.") from None


def tuple_or_none(values: Any) -> tuple | None:
    """A list argument as a tuple (hashable, and the value cannot change under the strategy), or None."""
    return tuple(values) if values is not None else None
