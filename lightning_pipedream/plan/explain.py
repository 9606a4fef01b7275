"""The plan's prediction against what a run measured: a table per stage, the gap split into its causes, and a new plan
from the measured times.

Inputs are plain numbers: the :class:`~lightning_pipedream.plan.partition.Plan` the run used (its stage times, from
the profile) and each rank's measured mean per training step (the runtime's accounts: ``compute``, ``wait``,
``transfer``, ``update``, ``other`` and ``step``, in seconds; see ``runtime/execution/accounts.py``). No torch, no
Lightning: the strategy calls :func:`explain` at the end of a fit, ``python -m lightning_pipedream show --trace``
from a merged trace's metadata.

Like for like: the plan's figures are per minibatch of its profile (the strategy profiles the first training batch)
and, with replicated stages, per replica with the minibatches shared among the replicas; a rank's training step may
hold several of them (``minibatches_per_batch=k`` with a plan of one minibatch's profile: k; ``d`` data-parallel
pipelines with a plan that counts them as replicas: d). Each rank's figures say how many
(``minibatches_per_step``, default 1), and every measured figure is divided by it: the comparison is per minibatch
of the plan on both sides. Replicas of a stage are averaged (the table gives their steps' range).

How the gap between the plan's time per minibatch ``P`` and the measured step ``S`` (of the stage whose mean step is
longest, the reference ``r``) is split; the parts add up to ``S - P`` exactly, by construction:

- **schedule**: the schedule simulator's step with the plan's stage times, minus ``P`` (PipeDream's partitioner
  predicts the asynchronous steady state: a flushed schedule's fill and drain are not in ``P``);
- **imbalance**: the simulator's step with every stage's times scaled to its measured compute, minus the same with
  the plan's (a stage whose compute is off its profile moves the whole pipeline, the more so if it is the slowest);
- **communication**: stage ``r``'s waiting and transfer beyond the idle time the simulator gives it with the measured
  compute (its step less that compute and its predicted all-reduce; negative when the stage idled less than the
  schedule predicts);
- **update**: stage ``r``'s optimizer step, which no profile times, less the gradient all-reduce the plan predicts
  for its replicas (``allreduce_s``): the strategy all-reduces a replicated stage's gradients right before each update,
  inside the optimizer step that the accounts time as ``update`` (the runtime's ``ALLREDUCE_GRAD`` action is a no-op
  there), so the all-reduce is compared where it is measured. The simulator counts the predicted all-reduce in the
  stage's busy time, so **communication** is left with the point-to-point messages only;
- **outside**: stage ``r``'s time outside the pipeline's actions: Lightning's per-step work, data loading.

On CUDA the ranks also say their compute's time on the device (``device_compute``, from CUDA events; the host's clock
reads only the kernels' launch there). Where every rank has it, it is the stage's measured compute (the profile times
a layer's kernels with a synchronization: the device's time is the like-for-like figure), the table says so, and the
host's ``compute`` is kept as ``host_compute``. The host's other parts then hold the time the host waited for its
own kernels (mostly at a receive's header read), so **communication** leaves it out: it counts ``wait + transfer``
less the idle time at the device compute, less the device compute beyond the host's (``compute - host_compute``). The
parts still add up to ``S - P`` exactly.

:func:`replan` partitions the plan's profile again with the measured times: each layer's forward as a traced window
timed it (``layer_forward``, where the ranks have it), the stage's backwards scaled together to its measured compute;
elsewhere each layer scaled by its stage's measured compute over its predicted compute (the accounts time stages).
A split chosen from a wrong profile is corrected by one rerun (``python -m lightning_pipedream plan --from-trace``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lightning_pipedream.plan.errors import InputFormatError
from lightning_pipedream.plan.partition import Plan
from lightning_pipedream.plan.profile import Profile

MEASURED = ("compute", "wait", "transfer", "update", "other", "step")
PARTS = ("schedule", "imbalance", "communication", "update", "outside")
PART_WORDS = {
    "schedule": "schedule (fill and drain, not in the plan's figure)",
    "imbalance": "stage imbalance (measured compute against the profile)",
    "communication": "communication (waiting beyond the schedule's bubble, transfers)",
    "update": "optimizer update (not in the profile)",
    "outside": "outside the pipeline (Lightning's step, data loading)",
}


class ExplainError(InputFormatError):
    """The run cannot be explained against its plan (no plan stage times, stages that do not match); says why."""


@dataclass
class StageRow:
    """One stage: predicted and measured compute per minibatch of the plan (seconds), predicted and measured bubble
    (shares of the step), the measured parts of its mean step (seconds; replicas averaged), the plan's all-reduce of
    its replicas' gradients, and with replicas their number and their mean steps' range; where known, the memory
    model's predicted peak and the traced window's measured peak of live tensor bytes."""

    stage: int
    predicted_compute: float
    predicted_bubble: float
    compute: float
    wait: float
    transfer: float
    update: float
    other: float
    step: float
    predicted_allreduce: float = 0.0
    replicas: int = 1
    step_min: float | None = None
    step_max: float | None = None
    host_compute: float | None = None  # CUDA: the host's compute (kernel launches); ``compute`` is then the device's
    predicted_memory: float | None = None  # bytes: the memory model's peak for the stage, where it made one
    live_peak: float | None = None  # bytes: the traced window's peak of live tensor bytes (the replicas' largest)

    @property
    def bubble(self) -> float:
        return self.wait / self.step if self.step > 0 else 0.0

    @property
    def ratio(self) -> float:
        """Measured compute over predicted (inf when the plan predicted none)."""
        return self.compute / self.predicted_compute if self.predicted_compute > 0 else math.inf


@dataclass
class Explanation:
    """The plan's time per minibatch against the measured step, per stage and split into parts (module text)."""

    schedule: str
    predicted: float  # the plan's time per minibatch (s)
    simulated: float  # the simulator's step with the plan's stage times (s)
    simulated_measured: float  # the simulator's step with the measured compute (s)
    reference: int  # the stage whose measured step is the figure explained
    stages: list[StageRow]
    parts: dict[str, float] = field(default_factory=dict)
    minibatches_per_step: float = 1.0  # the plan's minibatches a training step held: the measured figures divided by it

    @property
    def measured(self) -> float:
        return self.stages[self.reference].step

    @property
    def gap(self) -> float:
        return self.measured - self.predicted

    @property
    def device(self) -> bool:
        """Whether the measured compute is the device's (CUDA events), not the host's."""
        return any(s.host_compute is not None for s in self.stages)

    @property
    def slowest(self) -> int:
        """The stage whose compute is furthest above its profile."""
        return max(self.stages, key=lambda s: s.ratio).stage

    def table(self) -> str:
        """The per-stage table and the split of the gap, for people (milliseconds)."""
        ms = 1e3
        compute = "compute ms pred/meas" + (" (device)" if self.device else "")
        head: tuple[str, ...] = ("stage", compute, "bubble pred/meas", "wait ms", "transfer ms", "update ms",
                                 "other ms", "step ms")
        memory = any(s.predicted_memory is not None and s.live_peak is not None for s in self.stages)
        if memory:  # the memory model against the traced window's live tensors (trace=, a stage the model predicted)
            head = (*head, "memory pred/live")
        rows = [head]
        for s in self.stages:
            step = f"{s.step * ms:.2f}"
            if s.replicas > 1 and s.step_min is not None and s.step_max is not None:
                step += f" ({s.replicas} replicas, {s.step_min * ms:.2f}-{s.step_max * ms:.2f})"
            row: tuple[str, ...] = (str(s.stage), f"{s.predicted_compute * ms:.2f} / {s.compute * ms:.2f}",
                                    f"{s.predicted_bubble:.2f} / {s.bubble:.2f}", f"{s.wait * ms:.2f}",
                                    f"{s.transfer * ms:.2f}", f"{s.update * ms:.2f}", f"{s.other * ms:.2f}", step)
            if memory:
                row = (*row, f"{_bytes(s.predicted_memory)} / {_bytes(s.live_peak)}")
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        ratios = ", ".join(f"stage {s.stage} {s.ratio:.2f}x" for s in self.stages)
        n = self.minibatches_per_step
        step = f"stage {self.reference}'s mean step"
        if n != 1:  # the measured figures are per minibatch of the plan: a step held n of them
            step += f" / {n:.3g}, the plan's minibatches per step"
        allreduce = sum(s.predicted_allreduce for s in self.stages) > 0
        device = "; measured compute: the device's (CUDA events)" if self.device else ""
        out = [f"time per minibatch: predicted {self.predicted * ms:.1f} ms, measured {self.measured * ms:.1f} ms "
               f"({step}), gap {self.gap * ms:+.1f} ms; schedule {self.schedule}{device}", *lines,
               f"where the gap went (measured compute over the profile's: {ratios}; furthest above: stage "
               f"{self.slowest}):"]
        words = max(len(w) for w in PART_WORDS.values())
        for part in PARTS:
            value = self.parts[part]
            share = f"  {value / self.gap:5.0%} of the gap" if self.gap > 0 else ""  # a share of a saving reads badly
            label = PART_WORDS[part]
            if part == "update" and allreduce:
                label = "optimizer update (beyond the plan's all-reduce)"
            out.append(f"  {label.ljust(words)}  {value * ms:+9.2f} ms{share}")
        out.append(f"  {'total'.ljust(words)}  {sum(self.parts.values()) * ms:+9.2f} ms")
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "predicted_s": self.predicted, "measured_s": self.measured,
                "gap_s": self.gap, "simulated_s": self.simulated, "simulated_measured_s": self.simulated_measured,
                "reference_stage": self.reference, "slowest_stage": self.slowest, "parts_s": dict(self.parts),
                "minibatches_per_step": self.minibatches_per_step,
                "stages": [dataclasses.asdict(s) | {"bubble": s.bubble} for s in self.stages]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Explanation:
        """Back from :meth:`to_json` (a recipe's ``results.json``), e.g. to print its table again."""
        names = [f.name for f in dataclasses.fields(StageRow)]
        return cls(data["schedule"], data["predicted_s"], data["simulated_s"], data["simulated_measured_s"],
                   data["reference_stage"], [StageRow(**{k: s[k] for k in names if k in s}) for s in data["stages"]],
                   dict(data["parts_s"]), data.get("minibatches_per_step", 1.0))


def _bytes(nbytes: float | None) -> str:
    from lightning_pipedream.plan.choice import bytes_text

    return "-" if nbytes is None else bytes_text(nbytes)


def measured_stages(ranks: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per stage (in order), the mean per minibatch of the plan of each of :data:`MEASURED` over its replicas' ranks,
    and ``replicas``, ``step_min``, ``step_max`` (the replicas' range) and ``minibatches_per_step``; ``ranks``: one
    dict per rank with ``stage`` and those keys in seconds per training step, and optionally
    ``minibatches_per_step`` (how many of the plan's minibatches the step held; 1) (ranks that ran no step are left
    out). Where every such rank also has ``device_compute`` (CUDA), it is the stage's ``compute`` and the host's is
    ``host_compute`` (module text)."""
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        if r.get("steps", 1) and r["step"] > 0:
            by_stage.setdefault(int(r["stage"]), []).append(r)
    if not by_stage or sorted(by_stage) != list(range(len(by_stage))):
        raise ExplainError(f"measured figures for stages {sorted(by_stage)}: every stage from 0 on needs one rank's "
                           "figures of at least one training step.")
    device = all(r.get("device_compute") is not None for rs in by_stage.values() for r in rs)
    out = []
    for s in range(len(by_stage)):
        per = []
        for r in by_stage[s]:
            n = float(r.get("minibatches_per_step", 1.0))
            if not n > 0:
                raise ExplainError(f"rank figures with minibatches_per_step={n!r}: it counts the plan's minibatches "
                                   "one training step held, a number > 0.")
            one = {k: float(r[k]) / n for k in MEASURED} | {"minibatches_per_step": n}
            if device:  # the like-for-like compute: the device's (module text)
                one["host_compute"], one["compute"] = one["compute"], float(r["device_compute"]) / n
            per.append(one)
        keys = (*MEASURED, "minibatches_per_step") + (("host_compute",) if device else ())
        stage: dict[str, Any] = {k: sum(p[k] for p in per) / len(per) for k in keys}
        stage.update(replicas=len(per), step_min=min(p["step"] for p in per), step_max=max(p["step"] for p in per))
        # Memory is per rank, not per minibatch: the replicas' largest measured peak, and the stage's prediction.
        for key in ("peak_live_bytes", "predicted_memory_bytes"):
            known = [float(r[key]) for r in by_stage[s] if r.get(key) is not None]
            if known:
                stage[key] = max(known)
        # Each layer's forward where the ranks timed it (a traced window): the mean over the replicas that did.
        timed = [(r["layer_forward"], float(r.get("minibatches_per_step", 1.0))) for r in by_stage[s]
                 if isinstance(r.get("layer_forward"), dict) and r["layer_forward"]]
        if timed:
            names = set.intersection(*(set(layers) for layers, _ in timed))
            stage["layer_forward"] = {name: sum(float(layers[name]) / n for layers, n in timed) / len(timed)
                                      for name in names}
        out.append(stage)
    return out


def _rank_of_plan_stages(plan: Plan, ranks: int) -> list[int]:
    """Which pipeline rank runs each of the plan's stages: one each, or where the plan lists model chunks
    (``extra["chunk_stages"]``: the auto planner's, a traced graph's split for several chunks per rank) the rank the
    plan's schedule puts each on: stage i on rank i mod ranks (interleaved), or a V (``zb-v``, ``dualpipev``: chunk i
    on rank i for i < ranks, else on rank 2 ranks - 1 - i)."""
    from lightning_pipedream.schedule.builders import stage_rank
    from lightning_pipedream.schedule.specs import spec_of

    n = len(plan.stages)
    if n == ranks:
        return list(range(n))
    if plan.extra.get("chunk_stages") and n % ranks == 0:
        try:
            v_shape = spec_of(plan.schedule).v_shape
        except ValueError:  # a schedule this version does not know: its chunks as interleaved ones
            v_shape = False
        if not v_shape:
            return [i % ranks for i in range(n)]
        if n == 2 * ranks:
            return [stage_rank(plan.schedule, ranks, i) for i in range(n)]
    raise ExplainError(f"the plan has {n} stages but the run measured {ranks}; explain a run against the plan it "
                       "ran with.")


def _scaled(plan: Plan, factors: list[float]) -> Plan:
    """``plan`` with each stage's times scaled by its rank's factor."""
    owner = _rank_of_plan_stages(plan, len(factors))
    stages = [dataclasses.replace(s, compute_s=s.compute_s * factors[owner[i]],
                                  forward_s=s.forward_s * factors[owner[i]]) for i, s in enumerate(plan.stages)]
    return dataclasses.replace(plan, stages=stages)


def explain(plan: Plan, ranks: list[dict[str, Any]]) -> Explanation:
    """The plan's prediction against the measured ``ranks`` (see :func:`measured_stages`): the module text's split."""
    measured = measured_stages(ranks)
    owner = _rank_of_plan_stages(plan, len(measured))
    predicted = [0.0] * len(measured)
    allreduce = [0.0] * len(measured)
    for i, s in enumerate(plan.stages):
        predicted[owner[i]] += s.compute_s
        allreduce[owner[i]] += s.allreduce_s
    if not all(p > 0 for p in predicted):
        raise ExplainError("the plan has no compute time for every stage (a plan from balance= or a layer count, not "
                           "a profile): there is no prediction to explain. Let the strategy profile the model (no "
                           "balance=), or give a plan made by `python -m lightning_pipedream plan`.")
    simulated = plan.simulated_time_per_minibatch()
    factors = [m["compute"] / p for m, p in zip(measured, predicted)]
    simulated_measured = _scaled(plan, factors).simulated_time_per_minibatch()
    # The simulator's stage is busy for its compute and its all-reduce (in its backward): the rest is its bubble.
    stages = [StageRow(k, p, max(0.0, 1.0 - (p + a) / simulated) if simulated > 0 else 0.0,
                       compute=m["compute"], wait=m["wait"], transfer=m["transfer"], update=m["update"],
                       other=m["other"], step=m["step"], predicted_allreduce=a, replicas=int(m["replicas"]),
                       step_min=m["step_min"], step_max=m["step_max"], host_compute=m.get("host_compute"),
                       predicted_memory=m.get("predicted_memory_bytes"), live_peak=m.get("peak_live_bytes"))
              for k, (p, a, m) in enumerate(zip(predicted, allreduce, measured))]
    r = max(range(len(stages)), key=lambda k: stages[k].step)
    ref = stages[r]
    # What the schedule leaves stage r idle at the measured compute; its predicted all-reduce is measured in `update`.
    idle = simulated_measured - ref.compute - ref.predicted_allreduce
    # On CUDA the host waited for its own kernels beyond their launch in its other parts (a receive's header read,
    # mostly): that is compute, not communication (module text). Zero where compute is the host's.
    kernels = ref.compute - ref.host_compute if ref.host_compute is not None else 0.0
    parts = {
        "schedule": simulated - plan.time_per_minibatch,
        "imbalance": simulated_measured - simulated,
        "communication": ref.wait + ref.transfer - idle - kernels,
        "update": ref.update - ref.predicted_allreduce,
        "outside": ref.other,
    }
    n = sum(m["minibatches_per_step"] for m in measured) / len(measured)
    return Explanation(plan.schedule, plan.time_per_minibatch, simulated, simulated_measured, r, stages, parts, n)


def measured_profile(plan: Plan, ranks: list[dict[str, Any]]) -> Profile:
    """The profile the plan was made from (``plan.extra["profile"]``, which the strategy keeps when it profiles),
    with the run's measured times.

    Where the ranks timed each layer's forward (``layer_forward``, seconds per step by layer name, from a traced
    window: ``runtime/execution/layer_clock.py``), a stage's layers take their measured forwards and the stage's
    backwards (weight-gradient parts included) are scaled together so that the stage adds up to its measured compute:
    one slow layer is found alone. Elsewhere (no timed layers, or forwards that leave no backward time) every layer's
    times are scaled by its stage's measured compute over the plan's."""
    if not isinstance(plan.extra.get("profile"), dict):
        raise ExplainError("the plan holds no profile of its layers (a plan given with plan=, or balance=): nothing to "
                           "partition again. Let the strategy profile the model (no balance= or plan=), with trace=, "
                           "and plan again from that run's trace.")
    profile = Profile.from_json(plan.extra["profile"])
    measured = measured_stages(ranks)
    owner = _rank_of_plan_stages(plan, len(measured))
    predicted = [0.0] * len(measured)
    for i, s in enumerate(plan.stages):
        predicted[owner[i]] += s.compute_s
    factor_of: dict[str, float] = {}
    for i, s in enumerate(plan.stages):
        factor = measured[owner[i]]["compute"] / predicted[owner[i]] if predicted[owner[i]] > 0 else 1.0
        factor_of.update({name: factor for name in s.layers})
    missing = [layer.name for layer in profile.layers if layer.name not in factor_of]
    if missing:
        raise ExplainError(f"the plan's stages do not list the profile's layers {missing[:3]}: the plan and its "
                           "profile disagree.")
    timed = _timed_layers(plan, profile, measured, owner)
    layers = []
    for layer in profile.layers:
        if layer.name in timed:
            forward, g = timed[layer.name]
            weight = None if layer.weight_s is None else layer.weight_s * g
            layers.append(dataclasses.replace(layer, forward_s=forward, backward_s=layer.backward_s * g,
                                              weight_s=weight))
            continue
        f = factor_of[layer.name]
        weight = None if layer.weight_s is None else layer.weight_s * f
        layers.append(dataclasses.replace(layer, forward_s=layer.forward_s * f, backward_s=layer.backward_s * f,
                                          weight_s=weight))
    how = "the measured layer forwards and stage compute" if timed else "the measured stage compute"
    source = f"{profile.source or 'profile'} scaled by {how}"
    return dataclasses.replace(profile, layers=layers, source=source)


def _timed_layers(plan: Plan, profile: Profile, measured: list[dict[str, Any]],
                  owner: list[int]) -> dict[str, tuple[float, float]]:
    """Per layer of the ranks that timed every one of their layers' forwards: (its measured forward for a whole
    minibatch of the plan, the factor of its backward); see :func:`measured_profile`."""
    by_name = {layer.name: layer for layer in profile.layers}
    out: dict[str, tuple[float, float]] = {}
    for rank, m in enumerate(measured):
        forwards = m.get("layer_forward") or {}
        mine = [s for i, s in enumerate(plan.stages) if owner[i] == rank]
        names = [name for s in mine for name in s.layers]
        if not names or not all(name in forwards and name in by_name for name in names):
            continue
        # The plan's figures (and so the measured ones, per minibatch of the plan) are per replica: a replica runs
        # 1/r of the minibatches; the profile's layers are whole minibatches.
        r = mine[0].replicas
        forward = {name: float(forwards[name]) * r for name in names}
        backward = sum(by_name[name].backward_s for name in names)
        g = (m["compute"] * r - sum(forward.values())) / backward if backward > 0 else 0.0
        if g <= 0:  # the window's forwards exceed the fit's compute: no backward left to scale
            continue
        out.update({name: (forward[name], g) for name in names})
    return out


def replan(plan: Plan, ranks: list[dict[str, Any]]) -> Plan:
    """A new plan from :func:`measured_profile`, on the plan's topology, for the same schedule and micro-batches: a
    straight one (one stage per rank, as the run had), or for a plan with replicated stages one made as the strategy's
    ``straight=False`` makes it (replication allowed, every process used); its ``extra["profile"]`` is the scaled
    profile."""
    from lightning_pipedream.plan.partition import every_stage_trains_or_repartition, partition
    from lightning_pipedream.plan.topology import Topology

    profile = measured_profile(plan, ranks)
    replicated = any(stage.replicas > 1 for stage in plan.stages)
    workers = plan.num_workers if replicated else len(measured_stages(ranks))
    levels = [(int(level[0]), float(level[1])) for level in plan.topology or []]
    bandwidth = float(plan.topology[0][1]) if plan.topology else 1e9
    flat = Topology.flat(workers, bandwidth)
    topology = Topology(levels) if levels and Topology(levels).num_workers == workers else flat
    if replicated:
        new = partition(profile, topology, "pipedream", straight=False)
        if sum(stage.replicas for stage in new.stages) != workers:  # it left processes idle: one stage per process
            new = partition(profile, flat, "time")
        topology = flat
    else:
        new = partition(profile, topology, "pipedream", straight=True)
        if len(new.stages) != workers:  # the optimizer may leave workers idle; the pipeline runs one stage per rank
            new = partition(profile, topology, "time")
    new = every_stage_trains_or_repartition(new, profile, topology)
    new.schedule, new.chunks = plan.schedule, plan.chunks
    new.extra = {**new.extra, "profile": profile.to_json()}
    return new


def from_trace(trace: dict[str, Any], path: str = "the trace") -> tuple[Plan, list[dict[str, Any]]]:
    """The plan and the measured means a merged trace's metadata holds (``PipeDreamStrategy(trace=...)`` writes them
    at the end of a fit), or :class:`ExplainError` saying what is missing."""
    meta = trace.get("metadata") if isinstance(trace, dict) else None
    if not isinstance(meta, dict) or "measured" not in meta:
        raise ExplainError(f"{path} holds no measured stage figures: it is not a merged trace of "
                           "PipeDreamStrategy(trace=...) (pipeline_trace.json), or one written before they were kept.")
    if not meta.get("plan"):
        raise ExplainError(f"{path} holds no plan: the run split its model without one (balance=, or a traced graph's "
                           "split points), so nothing was predicted. Let the strategy profile and plan the model (no "
                           "balance=) to compare and plan again.")
    return Plan.from_json(meta["plan"], path=path), list(meta["measured"])
