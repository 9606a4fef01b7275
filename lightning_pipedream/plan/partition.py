"""Partitioners (uniform, parameters, time, PipeDream's dynamic programme) and the Plan they produce."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning_pipedream.plan.errors import PlanFormatError, is_number, is_whole
from lightning_pipedream.plan.profile import Profile
from lightning_pipedream.plan.topology import Topology
from lightning_pipedream.schedule.builders import build_schedule
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.specs import SCHEDULES, spec_of

METHODS = ("uniform", "parameters", "time", "pipedream")
COST_MODELS = ("code", "paper")
_INF = math.inf


@dataclass
class StagePlan:
    """One stage: its layers (names from the profile) and how many workers replicate it.

    The times are a per-stage breakdown for people (seconds per minibatch, per replica); the plan's
    ``time_per_minibatch`` is the optimizer's prediction for the whole pipeline."""

    layers: list[str]
    replicas: int = 1
    compute_s: float = 0.0
    forward_s: float = 0.0  # the forward share of compute_s (the simulator needs the split)
    allreduce_s: float = 0.0
    transfer_s: float = 0.0
    parameter_bytes: int = 0
    output_bytes: int = 0


@dataclass
class Plan:
    """What runs where: stages in pipeline order, the schedule, and the predicted time per minibatch."""

    stages: list[StagePlan]
    schedule: str = "pipedream"
    chunks: int = 1
    time_per_minibatch: float = 0.0
    speedup_vs_data_parallel: float | None = None
    speedup_vs_one_worker: float | None = None
    method: str = "pipedream"
    cost_model: str | None = None
    topology: list[list[float]] | None = None
    data_parallel_time: float | None = None
    one_worker_time: float | None = None
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    shard: str | None = None  # the replicas shard their stage (FSDP2): "grad_op" or "full"; None: whole copies

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("A plan needs at least one stage.")
        for index, stage in enumerate(self.stages):
            if not stage.layers:
                raise ValueError(f"Stage {index} of the plan has no layers; every stage needs at least one.")
            if not isinstance(stage.replicas, int) or stage.replicas < 1:
                raise ValueError(f"Stage {index} of the plan has replicas={stage.replicas!r}; use a whole number >= 1.")

    @property
    def balance(self) -> list[int]:
        """Layers per stage, in pipeline order."""
        return [len(stage.layers) for stage in self.stages]

    def simulated_time_per_minibatch(self, minibatches: int = 32, bandwidth: float | None = None) -> float:
        """The schedule simulator's steady-state time per minibatch for this plan's stages.

        Each stage runs at its per-replica compute time (replicas share the minibatches) plus its
        all-reduce time in the backward; activations cross links at ``bandwidth``. Beside the
        partitioner's analytic prediction it shows what the schedule's dependencies add.
        """
        if bandwidth is None:  # the links between stages: the topology's innermost level
            bandwidth = float(self.topology[0][1]) if self.topology else math.inf
        forward = [stage.forward_s for stage in self.stages]
        backward = [stage.compute_s - stage.forward_s + stage.allreduce_s for stage in self.stages]
        spec = spec_of(self.schedule)
        v = int(self.extra.get("virtual_stages", 1)) if spec.virtual_stages else 1
        if v > 1 and self.extra.get("chunk_stages"):  # the auto planner lists the model chunks themselves
            ranks = len(self.stages) // v
            chunks = max(1, self.chunks)
            given = self.extra.get("recompute", False)
            replays = given if isinstance(given, list) else [bool(given)] * len(self.stages)
            result = simulate(
                build_schedule(self.schedule, ranks, chunks, virtual_stages=v),
                [f / chunks for f in forward],
                [(b + (f if replay else 0.0)) / chunks for f, b, replay in zip(forward, backward, replays)],
                activation_bytes=[stage.output_bytes / chunks for stage in self.stages],
                bandwidth=bandwidth,
            )
            return result.step_time
        # extra={"recompute": true} replays each forward in its backward; {"virtual_stages": v} (interleaved)
        # splits each stage's layers into v chunks of equal cost, chunk c of rank r being stage c * p + r.
        # {"recompute": [...]} (the auto planner) names the stages that recompute: their backward replays the forward.
        flags = self.extra.get("recompute", False)
        if isinstance(flags, list):
            backward = [b + (f if flag else 0.0) for b, f, flag in zip(backward, forward, flags)]
            recompute = False
        else:
            recompute = bool(flags)
        # pipedream runs each batch whole; the others split it into `chunks` micro-batches of equal cost.
        chunks = max(1, self.chunks) if spec.microbatches else 1
        if spec.asynchronous:
            schedule = build_schedule(self.schedule, len(self.stages), chunks, minibatches=minibatches)
        else:
            schedule = build_schedule(self.schedule, len(self.stages), chunks, virtual_stages=v)
        result = simulate(
            schedule,
            [f / chunks / v for _ in range(v) for f in forward],
            [b / chunks / v for _ in range(v) for b in backward],
            activation_bytes=[stage.output_bytes / chunks for _ in range(v) for stage in self.stages],
            bandwidth=bandwidth,
            recompute=recompute,
        )
        return result.step_time

    @property
    def num_workers(self) -> int:
        stages = self.stages
        if self.extra.get("chunk_stages"):  # interleaved model chunks: a rank holds virtual_stages of them
            stages = stages[: len(stages) // int(self.extra.get("virtual_stages", 1))]
        return sum(stage.replicas for stage in stages)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["extra"]:
            del data["extra"]
        if data["shard"] is None:  # whole replicas: the JSON as before sharding came
            del data["shard"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any] | str, *, path: str | Path | None = None) -> Plan:
        """A plan from :meth:`to_json`'s dict (or its JSON text); :class:`PlanFormatError` names the stage and
        field that is wrong (and ``path``, the file it came from, when given)."""
        where = f" {path}" if path is not None else ""
        if isinstance(data, str):
            data = _parse_json(data, f"The plan{where}")
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
            raise PlanFormatError(
                f"A plan is a JSON object with a 'stages' list, each stage with 'layers' and 'replicas'; "
                f"the plan{where} has none."
            )
        if not data["stages"]:
            raise PlanFormatError(f"The plan{where} has no stages; a plan needs at least one stage.")
        stages = []
        seen: dict[str, int] = {}
        for index, entry in enumerate(data["stages"]):
            if not isinstance(entry, dict) or not isinstance(entry.get("layers"), list):
                raise PlanFormatError(
                    f"Stage {index} of the plan{where} is {_short(entry)}; give it a 'layers' list of layer names."
                )
            unknown = set(entry) - set(StagePlan.__dataclass_fields__)
            if unknown:
                raise PlanFormatError(
                    f"Stage {index} of the plan{where} has unknown fields {sorted(unknown)}; "
                    f"known fields are {sorted(StagePlan.__dataclass_fields__)}."
                )
            layers = entry["layers"]
            if not layers:
                raise PlanFormatError(
                    f"Stage {index} of the plan{where} has no layers; every stage needs at least one."
                )
            for name in layers:
                if not isinstance(name, str) or not name:
                    raise PlanFormatError(
                        f"Stage {index} of the plan{where} has a layer {_short(name)}; layers are the profile's "
                        "layer names (non-empty strings)."
                    )
                if name in seen:
                    raise PlanFormatError(
                        f"Stage {index} of the plan{where} lists layer {name!r}, which stage {seen[name]} lists "
                        "too; each layer belongs to one stage."
                    )
                seen[name] = index
            _check_fields(entry, _STAGE_CHECKS, f"Stage {index} of the plan{where}")
            stage_fields: dict[str, Any] = {k: int(v) if k in _WHOLE_FIELDS else v for k, v in entry.items()}
            stages.append(StagePlan(**stage_fields))
        known = {f for f in cls.__dataclass_fields__ if f != "stages"}
        unknown = set(data) - known - {"stages"}
        if unknown:
            raise PlanFormatError(
                f"The plan{where} has unknown fields {sorted(unknown)}; known fields are {sorted(known)}."
            )
        _check_fields(data, _PLAN_CHECKS, f"The plan{where}")
        topology = data.get("topology")
        if topology is not None:
            try:
                Topology([tuple(level) if isinstance(level, list) else level for level in topology])
            except ValueError as err:
                raise PlanFormatError(
                    f"The plan{where} has topology={_short(topology)}: {err} Use [[workers, bytes/s], ...], "
                    "innermost level first."
                ) from None
        fields: dict[str, Any] = {k: int(v) if k == "chunks" else v for k, v in data.items() if k != "stages"}
        return cls(stages=stages, **fields)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan saved by :meth:`save` (or `python -m lightning_pipedream plan --save`)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise PlanFormatError(
                f"The plan {path} is not UTF-8 text (byte {err.start}: {err.reason}); a plan is JSON written by "
                "Plan.save or `python -m lightning_pipedream plan --save`."
            ) from None
        if not text.strip():
            raise PlanFormatError(
                f"The plan {path} is empty; write one with `python -m lightning_pipedream plan ... --save {path}`."
            )
        return cls.from_json(_parse_json(text, f"The plan {path}"), path=path)

    def describe(self, simulated: bool = False) -> str:
        """A table for people: stage, layers, replicas and the predicted per-stage times.

        ``simulated=True`` adds the schedule simulator's time per minibatch (it runs the simulator,
        which takes milliseconds to seconds on deep pipelines, so only when asked).
        """
        rows = [("stage", "layers", "replicas", "compute ms", "all-reduce ms", "transfer ms")]
        for index, stage in enumerate(self.stages):
            names = stage.layers
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"
            rows.append(
                (
                    str(index),
                    span,
                    str(stage.replicas),
                    f"{stage.compute_s * 1e3:.2f}",
                    f"{stage.allreduce_s * 1e3:.2f}",
                    f"{stage.transfer_s * 1e3:.2f}",
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = [
            "  ".join(cell.ljust(w) if c == 1 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        config = "-".join(str(stage.replicas) for stage in self.stages)
        summary = [
            f"method {self.method}"
            + (f" (cost model {self.cost_model})" if self.cost_model else "")
            + f", {len(self.stages)} stages on {self.num_workers} workers, configuration {config}",
            f"predicted time per minibatch: {self.time_per_minibatch * 1e3:.3f} ms (analytic)"
            + (f", {self.simulated_time_per_minibatch() * 1e3:.3f} ms (schedule simulator)" if simulated else ""),
        ]
        if self.speedup_vs_one_worker is not None:
            summary.append(
                f"predicted speedup: {self.speedup_vs_one_worker:.2f}x over one worker"
                + (
                    f", {self.speedup_vs_data_parallel:.2f}x over data parallelism"
                    if self.speedup_vs_data_parallel is not None
                    else ""
                )
            )
        if self.schedule:
            summary.append(f"schedule {self.schedule}" + (f", {self.chunks} micro-batches" if self.chunks > 1 else ""))
        return "\n".join(lines + [""] + summary)


def _parse_json(text: str, what: str) -> Any:
    """``json.loads``, with errors that name ``what`` (e.g. "The plan plan.json") and the line and column."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanFormatError(f"{what} is not valid JSON: line {err.lineno}, column {err.colno}: {err.msg}.") from None
    except RecursionError:
        raise PlanFormatError(f"{what} is not valid JSON: its arrays or objects nest too deeply.") from None


def _optional(check):
    return lambda value: value is None or check(value)


_NUMBER = (is_number, "a number >= 0")
_STAGE_CHECKS = {
    "replicas": (lambda v: is_whole(v, 1), "a whole number >= 1"),
    "compute_s": _NUMBER,
    "forward_s": _NUMBER,
    "allreduce_s": _NUMBER,
    "transfer_s": _NUMBER,
    "parameter_bytes": (is_whole, "a whole number of bytes >= 0"),
    "output_bytes": (is_whole, "a whole number of bytes >= 0"),
}
_WHOLE_FIELDS = ("replicas", "parameter_bytes", "output_bytes")
_PLAN_CHECKS = {
    "schedule": (lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
    "chunks": (lambda v: is_whole(v, 1), "a whole number >= 1"),
    "time_per_minibatch": _NUMBER,
    "speedup_vs_data_parallel": (_optional(is_number), "a number >= 0, or null"),
    "speedup_vs_one_worker": (_optional(is_number), "a number >= 0, or null"),
    "method": (lambda v: isinstance(v, str), "a string (the partition method)"),
    "cost_model": (_optional(lambda v: isinstance(v, str)), "a string, or null"),
    "topology": (_optional(lambda v: isinstance(v, list) and bool(v)), "a list of [workers, bytes/s], or null"),
    "data_parallel_time": (_optional(is_number), "a number >= 0, or null"),
    "one_worker_time": (_optional(is_number), "a number >= 0, or null"),
    "source": (lambda v: isinstance(v, str), "a string"),
    "extra": (lambda v: isinstance(v, dict), "a JSON object"),
    "shard": (lambda v: v in (None, "grad_op", "full"), "'grad_op', 'full' or null (whole replicas)"),
}


def _check_fields(entry: dict[str, Any], checks: dict[str, tuple[Any, str]], what: str) -> None:
    for key, value in entry.items():
        if key in checks and not checks[key][0](value):
            raise PlanFormatError(f"{what} has {key}={_short(value)}; use {checks[key][1]}.")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------
# Ranges and costs shared by the partitioners


class _Sums:
    """Range sums over the profile's layers: ``range(a)[i, j]`` sums a per-layer array over layers i..j."""

    def __init__(self, profile: Profile) -> None:
        self.count = len(profile.layers)
        self.compute = np.array([l.forward_s + l.backward_s for l in profile.layers], dtype=float)
        self.forward = np.array([l.forward_s for l in profile.layers], dtype=float)
        self.params = np.array([l.parameter_bytes for l in profile.layers], dtype=float)
        self.acts = np.array([l.activation_bytes for l in profile.layers], dtype=float)
        # cut[k]: bytes sent from layers 0..k to layers k+1..; 0 after the last layer.
        self.cut = np.array(profile.cut_bytes() + [0], dtype=float)
        self.cuttable = np.array(profile.cut_allowed() + [False])  # may a stage end after layer k (not the last)?

    def range(self, values: np.ndarray, empty: float = 0.0) -> np.ndarray:
        """``[i, j]``: the sum over layers i..j; ``empty`` where j < i."""
        prefix = np.concatenate([[0.0], np.cumsum(values)])
        table = prefix[None, 1:] - prefix[:-1, None]
        table[np.tril_indices(self.count, -1)] = empty
        return table


def _allreduce(params: np.ndarray | float, replicas: int, bandwidth: float) -> np.ndarray | float:
    """Seconds to all-reduce ``params`` bytes among ``replicas`` workers: 4(m-1)|w| / (m B), as PipeDream."""
    return 4.0 * (replicas - 1) * params / (replicas * bandwidth)


# ---------------------------------------------------------------------------------------------------------
# PipeDream's dynamic programme, one level of the topology at a time


class _Level:
    """One level of the hierarchical DP. ``inner[i, j]`` is the time of layers i..j on one unit of this
    level (a worker at level 0, the best pipeline of the level below otherwise).

    Cost model "code" follows PipeDream's optimizer: a stage costs (compute + all-reduce)/m; every stage
    after the first of a pipeline also pays 2*bytes/(B*m) for its input and, unless it ends the model,
    for its output; a lone stage divides its all-reduce by the units' worker count of the level below.
    Cost model "paper" follows the paper's text: max(compute, all-reduce)/m, and 2*bytes/B per cut.
    """

    def __init__(
        self,
        sums: _Sums,
        inner: np.ndarray,
        workers: int,
        bandwidth: float,
        within: int,
        rows: int,
        model: str,
        straight: bool,
        memory_cap: float | None,
    ) -> None:
        self.n, self.workers, self.bandwidth, self.model = sums.count, workers, bandwidth, model
        self.replica_choices = [1] if straight else list(range(1, workers + 1))
        self.memory_cap = memory_cap
        self.inner = inner
        self.params = sums.range(sums.params)
        self.stash = self.params + sums.range(sums.acts)  # weights and activations a stage keeps per minibatch
        self.cut, self.cuttable = sums.cut, sums.cuttable
        self.within = within
        self._last_cache: dict[tuple[int, int], np.ndarray] = {}
        self.single = {r: self._single(r) for r in self.replica_choices}
        self.best = self._solve(rows)

    def _memory_ok(self, stash: np.ndarray, replicas: int, downstream: int) -> np.ndarray | bool:
        # In flight at a stage: one minibatch per downstream worker, spread over its replicas, plus its own.
        if self.memory_cap is None:
            return True
        return (math.ceil(downstream / replicas) + 1) * stash <= self.memory_cap

    def _single(self, r: int) -> np.ndarray:
        """Layers i..j as the first stage of a pipeline (or all of it), replicated r times."""
        sync = _allreduce(self.params, r, self.bandwidth)
        if self.model == "code":
            cost = (self.inner + sync / self.within) / r
        else:
            cost = np.maximum(self.inner, sync) / r
        return np.where(self._memory_ok(self.stash, r, self.workers - r), cost, _INF)

    def last(self, r: int, used: int) -> np.ndarray:
        """``[k, j]``: layers k+1..j as a later stage with r replicas, bringing the workers used to ``used``."""
        key = (r, used if self.memory_cap is not None else 0)
        if key not in self._last_cache:
            n, band = self.n, self.bandwidth
            table = np.full((n, n), _INF)
            inner, params, stash = self.inner[1:, :], self.params[1:, :], self.stash[1:, :]  # row k -> layers k+1..
            sync = _allreduce(params, r, band)
            receive = 2.0 * self.cut[: n - 1, None] / band
            if self.model == "code":
                send = 2.0 * np.where(np.arange(n) < n - 1, self.cut[:n], 0.0)[None, :] / band
                cost = np.maximum((inner + sync) / r, np.maximum(receive, send) / r)
            else:
                cost = np.maximum(np.maximum(inner, sync) / r, receive)
            ok = self._memory_ok(stash, r, self.workers - used) & self.cuttable[: n - 1, None]
            table[: n - 1] = np.where(ok, cost, _INF)
            self._last_cache[key] = table
        return self._last_cache[key]

    def _solve(self, rows: int) -> dict[int, np.ndarray]:
        """Best time of layers i..j on m workers, for i < rows: A[m] = min(single, min_k,r max(A[m-r], last))."""
        best: dict[int, np.ndarray] = {}
        for m in range(1, self.workers + 1):
            value = self.single[m][:rows].copy() if m in self.single else np.full((rows, self.n), _INF)
            for r in self.replica_choices:
                if r < m:
                    value = np.minimum(value, _minmax_product(best[m - r], self.last(r, m)))
            best[m] = value
        return best

    def cover(self, start: int, end: int, workers: int, limit: float) -> list[tuple[int, int, int, bool]]:
        """A configuration of layers start..end on ``workers`` with every stage within ``limit``, and the fewest
        stages (later cuts and fewer replicas on the last stage break ties).

        Returns (first, last, replicas, is_first_stage) per stage in order."""
        n, rows = self.n, range(start, end + 1)
        stages = np.full((workers + 1, n), _INF)  # stages[m, j]: fewest stages for start..j on m workers
        choice: dict[tuple[int, int], tuple[int, int]] = {}
        for m in range(1, workers + 1):
            for j in rows:
                if m in self.single and self.single[m][start, j] <= limit:
                    stages[m, j], choice[m, j] = 1, (-1, m)
                    continue
                for r in self.replica_choices:
                    if r >= m:
                        continue
                    ks = np.arange(start, j)
                    ok = (self.last(r, m)[ks, j] <= limit) & np.isfinite(stages[m - r, ks])
                    if not ok.any():
                        continue
                    counts = np.where(ok, stages[m - r, ks] + 1, _INF)
                    k = ks[len(ks) - 1 - int(np.argmin(counts[::-1]))]  # latest cut among the fewest stages
                    if counts[k - start] < stages[m, j]:
                        stages[m, j], choice[m, j] = counts[k - start], (k, r)
        if not math.isfinite(stages[workers, end]):
            raise AssertionError("internal error: the optimum found by the DP could not be rebuilt")
        result = []
        j, m = end, workers
        while True:
            k, r = choice[m, j]
            result.append((k + 1 if k >= 0 else start, j, r, k < 0))
            if k < 0:
                return result[::-1]
            j, m = k, m - r


def _minmax_product(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``out[i, j] = min_k max(left[i, k], right[k, j])``, in blocks of rows to bound memory."""
    rows, n = left.shape
    out = np.empty((rows, n))
    block = max(1, 4_000_000 // (n * n))
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        k0 = r0 if rows == n else 0  # left[i, k] is infinite for k < i when rows are all start layers
        out[r0:r1] = np.maximum(left[r0:r1, k0:, None], right[None, k0:, :]).min(axis=1)
    return out


def _pipedream(
    profile: Profile, topology: Topology, *, memory_limit: float | None, straight: bool, cost_model: str
) -> tuple[float, list[tuple[int, int, int, float]]]:
    """Solve level by level (innermost first); return the time and the stages as
    (first layer, last layer, replicas, bandwidth of the link their input arrives on)."""
    sums = _Sums(profile)
    inner = sums.range(sums.compute, empty=_INF)
    levels: list[_Level] = []
    within, unit = 1, 1
    for index, (workers, bandwidth) in enumerate(topology.levels):
        final = index == len(topology.levels) - 1
        cap = None if memory_limit is None else memory_limit * unit
        level = _Level(sums, inner, workers, bandwidth, within, 1 if final else sums.count, cost_model, straight, cap)
        levels.append(level)
        inner = level.best[workers]  # the next level's unit runs a whole pipeline of this level
        within, unit = workers, unit * workers
    total = float(levels[-1].best[levels[-1].workers][0, sums.count - 1])
    if not math.isfinite(total):
        raise ValueError(_infeasible_message(profile, topology, memory_limit, straight))

    def expand(depth: int, first: int, last: int, limit: float, replicas: int, level_of_input: int):
        level = levels[depth]
        out = []
        for a, b, r, is_first in level.cover(first, last, level.workers, limit):
            input_level = level_of_input if is_first else depth
            if depth == 0:
                out.append((a, b, replicas * r, topology.levels[input_level][1]))
            else:
                below = levels[depth - 1]
                out += expand(depth - 1, a, b, float(below.best[below.workers][a, b]), replicas * r, input_level)
        return out

    return total, expand(len(levels) - 1, 0, sums.count - 1, total, 1, len(levels) - 1)


def _infeasible_message(profile: Profile, topology: Topology, memory_limit: float | None, straight: bool) -> str:
    if memory_limit is not None:
        return (
            f"No partition of the {len(profile.layers)} layers on {topology.num_workers} workers keeps every "
            f"worker within memory_limit={memory_limit:.4g} bytes; raise the limit or add workers."
        )
    shape = " x ".join(str(w) for w, _ in reversed(topology.levels))
    return (
        f"No straight partition fits the topology {shape}: each group of the inner levels needs at least as "
        f"many layers as it has workers; allow replication or use fewer workers."
    )


def _too_many_workers(layers: int, workers: int, stages: int) -> str:
    most = f"{layers} layers" if stages == layers else f"{layers} layers that can form at most {stages} stages"
    return (
        f"{workers} workers but the profile has only {most}: without replication every worker needs its own "
        f"stage. Use at most {stages} workers, or allow replication (method='pipedream' without "
        f"straight / --straight)."
    )


# ---------------------------------------------------------------------------------------------------------
# Straight partitioners: one stage per worker


def _min_max_split(weights: np.ndarray, parts: int, cuttable: np.ndarray) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` non-empty groups minimising the largest group sum,
    with group boundaries only where ``cuttable`` (after layer k) allows."""
    n = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full((parts + 1, n + 1), _INF)  # best[s, j]: first j layers in s groups
    arg = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, parts + 1):
        for j in range(s, n + 1):
            ks = np.arange(s - 1, j)
            cand = np.maximum(best[s - 1, ks], prefix[j] - prefix[ks])
            cand[(ks > 0) & ~cuttable[np.maximum(ks - 1, 0)]] = _INF
            pick = len(ks) - 1 - int(np.argmin(cand[::-1]))  # ties: the latest boundary
            best[s, j], arg[s, j] = cand[pick], ks[pick]
    bounds, j = [], n
    for s in range(parts, 0, -1):
        k = arg[s, j]
        bounds.append(j - k)
        j = k
    return bounds[::-1]


def _straight_time(sums: _Sums, topology: Topology, balance: list[int]) -> float:
    """A pipeline of one worker per stage, ranks in order: its slowest stage or activation transfer."""
    time, start = 0.0, 0
    for s, count in enumerate(balance):
        end = start + count - 1
        time = max(time, float(sums.compute[start : end + 1].sum()))
        if s + 1 < len(balance):
            time = max(time, 2.0 * float(sums.cut[end]) / topology.bandwidth_between(s, s + 1))
        start = end + 1
    return time


# ---------------------------------------------------------------------------------------------------------
# The entry point


def data_parallel_time(profile: Profile, topology: Topology, cost_model: str = "code") -> float:
    """Time per minibatch of the whole model replicated on every worker (PipeDream's estimate)."""
    time = float(sum(l.forward_s + l.backward_s for l in profile.layers))
    params = float(sum(l.parameter_bytes for l in profile.layers))
    within = 1
    for workers, bandwidth in topology.levels:
        sync = _allreduce(params, workers, bandwidth)
        time = float((time + sync / within) / workers if cost_model == "code" else max(time, sync) / workers)
        within = workers
    return time


def configuration_time(
    profile: Profile, topology: Topology, replicas: list[int], cost_model: str = "code"
) -> float | None:
    """The predicted time per minibatch of the best plan whose stages have exactly ``replicas`` workers each
    (e.g. ``[15, 1]``: stage boundaries chosen by the same dynamic programme and cost model as
    :func:`partition`), on a one-level topology; None when no split of the layers has that shape.

    It prices a configuration someone else chose (a paper's "15-1") under this planner's cost model.
    """
    if cost_model not in COST_MODELS:
        raise ValueError(f"Unknown cost model {cost_model!r}; choose 'code' (PipeDream's optimizer) or 'paper'.")
    if len(topology.levels) != 1:
        raise ValueError(
            f"configuration_time needs a one-level topology, got {len(topology.levels)} levels: a configuration "
            "such as 15-1 on 4 servers of 4 workers splits a server, which the levels' programme cannot express. "
            "Use Topology.flat(workers, bandwidth)."
        )
    if not replicas or any(not isinstance(r, int) or r < 1 for r in replicas) or sum(replicas) != topology.num_workers:
        raise ValueError(
            f"replicas={replicas!r} must be whole numbers >= 1, one per stage, adding up to the topology's "
            f"{topology.num_workers} workers."
        )
    sums = _Sums(profile)
    workers, bandwidth = topology.levels[0]
    level = _Level(sums, sums.range(sums.compute, empty=_INF), workers, bandwidth, 1, 1, cost_model, False, None)
    best = level.single[replicas[0]][:1].copy()  # [0, j]: layers 0..j as the first stage
    used = replicas[0]
    for r in replicas[1:]:
        used += r
        best = _minmax_product(best, level.last(r, used))
    time = float(best[0, sums.count - 1])
    return time if math.isfinite(time) else None


def partition(
    profile: Profile,
    topology: Topology,
    method: str = "pipedream",
    *,
    memory_limit: float | None = None,
    straight: bool = False,
    cost_model: str = "code",
) -> Plan:
    """Split ``profile``'s layers into stages for ``topology``.

    ``uniform`` (equal layer counts), ``parameters`` (balanced parameter bytes) and ``time`` (balanced
    forward+backward time) make one stage per worker. ``pipedream`` runs PipeDream's dynamic programme over
    the topology's levels, with stage replication unless ``straight``, activation transfers, and an
    optional ``memory_limit`` in bytes per worker; ``cost_model`` is "code" (PipeDream's optimizer) or
    "paper" (the SOSP'19 text).
    """
    if method not in METHODS:
        raise ValueError(f"Unknown partition method {method!r}; choose one of {', '.join(METHODS)}.")
    if cost_model not in COST_MODELS:
        raise ValueError(f"Unknown cost model {cost_model!r}; choose 'code' (PipeDream's optimizer) or 'paper'.")
    if memory_limit is not None and not memory_limit > 0:
        raise ValueError(f"memory_limit is {memory_limit!r}; give bytes per worker > 0, or None for no limit.")
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology, e.g. Topology.flat(4, 1e9); got {topology!r}.")
    names = profile.names
    workers = topology.num_workers
    sums = _Sums(profile)
    one_worker = float(sums.compute.sum())
    if method == "pipedream":
        stages_possible = 1 + int(sums.cuttable.sum())
        if straight and stages_possible < workers:
            raise ValueError(_too_many_workers(len(names), workers, stages_possible))
        time, spans = _pipedream(profile, topology, memory_limit=memory_limit, straight=straight, cost_model=cost_model)
    else:
        stages_possible = 1 + int(sums.cuttable.sum())
        if stages_possible < workers:
            raise ValueError(_too_many_workers(len(names), workers, stages_possible))
        weights = {"uniform": np.ones(len(names)), "parameters": sums.params, "time": sums.compute}[method]
        balance = _min_max_split(weights, workers, sums.cuttable)
        time = _straight_time(sums, topology, balance)
        starts = np.cumsum([0] + balance[:-1])
        spans = [
            (int(a), int(a) + c - 1, 1, topology.bandwidth_between(max(s - 1, 0), s))
            for s, (a, c) in enumerate(zip(starts, balance))
        ]
    stages = [_stage_plan(sums, names, topology, span, cost_model) for span in spans]
    dp_time = data_parallel_time(profile, topology, cost_model)
    return Plan(
        stages=stages,
        time_per_minibatch=time,
        speedup_vs_data_parallel=dp_time / time if time > 0 else None,
        speedup_vs_one_worker=one_worker / time if time > 0 else None,
        method=method,
        cost_model=cost_model if method == "pipedream" else None,
        topology=topology.to_json(),
        data_parallel_time=dp_time,
        one_worker_time=one_worker,
        source=profile.source,
        extra={"straight": True} if straight else {},
    )


def _stage_plan(
    sums: _Sums, names: list[str], topology: Topology, span: tuple[int, int, int, float], cost_model: str
) -> StagePlan:
    first, last, replicas, input_bandwidth = span
    compute = float(sums.compute[first : last + 1].sum())
    forward = float(sums.forward[first : last + 1].sum())
    params = float(sums.params[first : last + 1].sum())
    # Replicas spread over the smallest level group that holds them.
    group, sync_band = 1, topology.levels[0][1]
    for workers, bandwidth in topology.levels:
        if group >= replicas:
            break
        group, sync_band = group * workers, bandwidth
    transfer = 0.0
    if first > 0:
        transfer = 2.0 * float(sums.cut[first - 1]) / input_bandwidth
        transfer /= replicas if cost_model == "code" else 1
    return StagePlan(
        layers=names[first : last + 1],
        replicas=replicas,
        compute_s=compute / replicas,
        forward_s=forward / replicas,
        allreduce_s=float(_allreduce(params, replicas, sync_band)) / replicas,
        transfer_s=transfer,
        parameter_bytes=int(params),
        output_bytes=int(sums.cut[last]) if last < len(names) - 1 else 0,
    )


def every_stage_trains_or_repartition(plan: Plan, profile: Profile, topology: Topology) -> Plan:
    """A stage of parameter-free layers (an activation alone: noisy timings can make it look worth a stage)
    cannot have an optimizer: partition by time, then by parameters, until every stage trains."""
    for method in ("time", "parameters"):
        if _every_stage_trains(profile, plan.balance):
            break
        plan = partition(profile, topology, method)
    return plan


def _every_stage_trains(profile: Profile, balance: list[int]) -> bool:
    """Whether each stage of ``balance`` holds a layer with parameters, by ``profile``'s parameter bytes."""
    start = 0
    for count in balance:
        if not any(layer.parameter_bytes for layer in profile.layers[start : start + count]):
            return False
        start += count
    return True
