"""What the auto planner chose: the candidates it timed, its choice with the reasons, and its refusal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_pipedream.plan.memory import StageMemory
from lightning_pipedream.plan.partition import Plan
from lightning_pipedream.plan.shards import shard_label
from lightning_pipedream.schedule.specs import spec_of


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner timed: what it runs, its predicted time per minibatch and memory per worker.

    ``balance`` lists layers per model stage (interleaved: ``stages x virtual_stages`` chunks, chunk c of rank r
    being stage ``c * stages + r``); ``replicas`` and ``memory`` have one entry per pipeline stage (per rank).
    A minibatch is the profile's batch: one data shard's batch of a training step.
    """

    schedule: str
    balance: tuple[int, ...]
    replicas: tuple[int, ...]
    chunks: int
    virtual_stages: int
    recompute: tuple[bool, ...]  # per model stage
    time_per_minibatch: float
    memory: tuple[StageMemory, ...]
    shard: str | None = None  # FSDP2 over each stage's (equal) replicas: "grad_op" or "full"; None: whole copies

    @property
    def peak_bytes(self) -> int:
        """The most any worker needs."""
        return max(m.predicted_peak_bytes for m in self.memory)

    @property
    def shape(self) -> tuple[str, tuple[int, ...], int, str | None]:
        """What makes two candidates different configurations (not just another micro-batch count or split)."""
        return self.schedule, self.replicas, self.virtual_stages, self.shard

    def label(self) -> str:
        """``1f1b, 4 stages (1-1-1-1), 8 micro-batches, recompute on stages 0, 1``."""
        stages = len(self.replicas)
        text = f"{self.schedule}, {stages} stage{'s' if stages > 1 else ''} ({'-'.join(map(str, self.replicas))})"
        if self.virtual_stages > 1:
            text += f" x {self.virtual_stages} chunks"
        if spec_of(self.schedule).microbatches:
            text += f", {self.chunks} micro-batch{'es' if self.chunks > 1 else ''}"
        p = len(self.replicas)  # interleaved: a rank recomputes all of its chunks or none
        rc = [str(s) for s in range(p) if any(self.recompute[s::p])]
        if rc:
            text += ", recompute " + (
                "everywhere" if len(rc) == p else f"on stage{'s' if len(rc) > 1 else ''} " + ", ".join(rc)
            )
        return text + shard_label(self.shard, self.replicas[0])

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"shard": self.shard} if self.shard is not None else {}
        return data | {
            "schedule": self.schedule,
            "balance": list(self.balance),
            "replicas": list(self.replicas),
            "chunks": self.chunks,
            "virtual_stages": self.virtual_stages,
            "recompute": list(self.recompute),
            "time_per_minibatch": self.time_per_minibatch,
            "predicted_peak_bytes": [m.predicted_peak_bytes for m in self.memory],
            "memory": [m.to_json() for m in self.memory],
        }


class NoPlanFitsError(ValueError):
    """No configuration keeps every worker within the memory limit; ``smallest_limit`` is the least that fits."""

    def __init__(self, message: str, smallest_limit: int, candidate: Candidate) -> None:
        super().__init__(message)
        self.smallest_limit = smallest_limit
        self.candidate = candidate


@dataclass
class AutoPlan:
    """The planner's choice (``plan``, ``chosen``), the best configuration of another shape (``runner_up``), and
    how many candidates it weighed and simulated."""

    plan: Plan
    chosen: Candidate
    runner_up: Candidate | None
    memory_limit: float | None
    exact: bool
    optimizer: str
    considered: int
    simulated: int
    batch_size: int | None = None
    shard_note: str | None = None  # why the plan shards, or why not, when the planner weighed it (shard="auto")

    def _per(self, seconds: float) -> str:
        text = f"{seconds * 1e3:.3f} ms per minibatch"
        if self.batch_size:
            text += f" ({seconds / self.batch_size * 1e6:.2f} us per sample)"
        return text

    def describe(self) -> str:
        """The chosen plan, each worker's predicted memory and its terms, and why (the runner-up)."""
        c = self.chosen
        limit = "no memory limit"
        if self.memory_limit is not None:
            limit = f"memory limit {bytes_text(self.memory_limit)} per worker"
        lines = [
            f"auto plan ({'exact schedules only' if self.exact else 'every schedule'}, {limit}, "
            f"optimizer {self.optimizer}): {c.label()}",
            f"predicted time {self._per(c.time_per_minibatch)} (schedule simulator)",
            "",
        ]
        header: tuple[str, ...] = ("stage", "layers", "replicas", "recompute", "weights", "grads", "optimizer",
                                   "stashed", "activations", "held", "replay", "backward", "step", "peak")
        if c.shard is not None:  # the shards' terms, and what a step holds whole on top of them
            header = header[:-1] + ("whole in step", "peak")
        rows = [header]
        names = self.plan.stages
        for m in c.memory:
            span = ", ".join(span_text(names[s].layers) for s in m.chunks)
            rows.append((
                str(m.stage), span, str(m.replicas), "yes" if m.recompute else "no", bytes_text(m.parameters),
                bytes_text(m.gradients), bytes_text(m.optimizer_state),
                bytes_text(m.stashed_weights) + (f" ({m.weight_versions - 1}x)" if m.weight_versions > 1 else ""),
                bytes_text(m.activations), str(m.held), bytes_text(m.replay), bytes_text(m.backward_working),
                bytes_text(m.activations_at_update + max(m.update_working, m.sync_working)),
                *([bytes_text(m.whole_gradients - m.gradients + m.gathered)] if c.shard is not None else []),
                bytes_text(m.predicted_peak_bytes),
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        table = ["  ".join(cell.ljust(w) if i == 1 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                 for row in rows]
        table.insert(1, "  ".join("-" * w for w in widths))
        lines += table + [""]
        if self.runner_up is None:
            lines.append("why: no configuration of another shape fits")
        else:
            r = self.runner_up
            slower = r.time_per_minibatch / c.time_per_minibatch - 1 if c.time_per_minibatch > 0 else 0.0
            lines.append(
                f"why: the runner-up, {r.label()}, takes {self._per(r.time_per_minibatch)} "
                f"({slower:+.1%}) and needs {bytes_text(r.peak_bytes)} on its fullest worker "
                f"(the choice: {bytes_text(c.peak_bytes)})"
            )
        if self.shard_note:
            lines.append(self.shard_note)
        lines.append(f"weighed {self.considered} configurations, simulated {self.simulated}")
        arguments = ", ".join(f"{key}={value!r}" for key, value in self.strategy_arguments().items())
        lines.append(f"run it with PipeDreamStrategy({arguments})")
        return "\n".join(lines)

    def strategy_arguments(self) -> dict[str, Any]:
        """``PipeDreamStrategy``'s arguments that run this plan: schedule, chunks, balance (layers per stage; per
        model chunk under interleaved), replicas (when a stage has several), virtual_stages (interleaved) and
        recompute (True when every stage recomputes, else one flag per stage), shard (when the replicas shard)."""
        c = self.chosen
        args: dict[str, Any] = {"schedule": c.schedule, "chunks": c.chunks, "balance": list(c.balance)}
        if any(r > 1 for r in c.replicas):
            args["replicas"] = list(c.replicas)
        if c.virtual_stages > 1:
            args["virtual_stages"] = c.virtual_stages
        if any(c.recompute):
            args["recompute"] = True if all(c.recompute) else list(c.recompute)
        if c.shard is not None:
            args["shard"] = c.shard
        return args

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_json(),
            "strategy_arguments": self.strategy_arguments(),
            "chosen": self.chosen.to_json(),
            "predicted_peak_bytes": [m.predicted_peak_bytes for m in self.chosen.memory],
            "runner_up": None if self.runner_up is None else self.runner_up.to_json(),
            "memory_limit": self.memory_limit,
            "exact": self.exact,
            "optimizer": self.optimizer,
            "considered": self.considered,
            "simulated": self.simulated,
        } | ({"shard": self.chosen.shard, "shard_note": self.shard_note} if self.shard_note else {})


def span_text(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"


def bytes_text(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"
