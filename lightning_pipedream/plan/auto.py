"""The auto planner: split, replicas (whole or sharded), schedule, micro-batches and recompute within a memory limit,
simulator-timed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_pipedream.plan.choice import AutoPlan, Candidate, NoPlanFitsError, bytes_text
from lightning_pipedream.plan.memory import (
    FOREACH_TEMPORARIES,
    OPTIMIZER_TEMPORARIES,
    Held,
    StageBytes,
    StageMemory,
    backward_working,
    cublas_workspace_bytes,
    gradients_from_first_backward,
    optimizer_state_ratio,
    predict_memory,
    stage_bytes,
    walk_held,
)
from lightning_pipedream.plan.partition import Plan, StagePlan, partition
from lightning_pipedream.plan.profile import Profile
from lightning_pipedream.plan.ranges import LayerRanges, equal_shares, minmax_split, stage_entries
from lightning_pipedream.plan.shards import (
    can_shard,
    gathers_per_microbatch,
    gathers_per_step,
    keeps_stage_gathered,
    ring_allreduce_seconds,
    ring_half_seconds,
    shard_modes,
)
from lightning_pipedream.plan.topology import Topology
from lightning_pipedream.schedule.actions import Layout, Schedule
from lightning_pipedream.schedule.builders import V_CHUNKS, build_schedule, least_chunks, rank_stages, stage_rank
from lightning_pipedream.schedule.simulate import simulate
from lightning_pipedream.schedule.specs import SCHEDULES, spec_of

_INF = math.inf
INTERLEAVED_VIRTUAL_STAGES = 2  # model chunks per rank the planner tries under the interleaved schedule
__all__ = ["AutoPlan", "Candidate", "NoPlanFitsError", "auto_plan", "memory_tables"]


# ---------------------------------------------------------------------------------------------------------
# The search


@dataclass
class _Search:
    profile: Profile
    topology: Topology
    memory_limit: float | None
    optimizer: str
    overhead: float
    input_bytes: float
    ranges: LayerRanges
    timed: dict[tuple, Schedule] = field(default_factory=dict)
    tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # memory and time, per key
    sized: dict[tuple[int, ...], list[StageBytes]] = field(default_factory=dict)
    considered: int = 0
    simulated: int = 0
    device: str = "cpu"  # "cuda": what CUDA adds (plan.memory: the allocator's blocks, foreach temporaries, cuBLAS)
    cuda_capability: tuple[int, int] = (9, 0)
    gradients_carried: bool = False  # accumulate_grad_batches > 1: a step starts with the gradients of the last

    @property
    def limit(self) -> float:
        return _INF if self.memory_limit is None else self.memory_limit

    # -- where ranks are and how fast they talk
    def ranks_of(self, replicas: tuple[int, ...]) -> list[list[int]]:
        """Ranks holding each stage: d equal pipelines put stage s of pipeline k on rank s*d + k, unequal
        replicas are stage-major too (Layout)."""
        layout = Layout(replicas)
        return [list(layout.ranks_of(s)) for s in range(len(replicas))]

    def link(self, ranks: list[list[int]], a: int, b: int) -> float:
        """The slowest link a stage-a-to-stage-b message may take."""
        return min(self.topology.bandwidth_between(x, y) for x in ranks[a] for y in ranks[b])

    def group_bandwidth(self, ranks: list[int]) -> float:
        return min((self.topology.bandwidth_between(ranks[0], y) for y in ranks[1:]), default=_INF)

    # -- in-flight counts from the schedule's own action lists
    def flight(self, schedule: str, stages: int, chunks: int, replicas: tuple[int, ...], v: int) -> Schedule:
        if len(set(replicas)) == 1:  # equal replicas: each holds what a straight pipeline's stage holds
            return self.built(schedule, stages, chunks, v)
        return self.built(schedule, stages, chunks, v, replicas)  # 1F1B-RR: the one the simulator times

    def built(self, schedule: str, stages: int, chunks: int, v: int,
              replicas: tuple[int, ...] | None = None) -> Schedule:
        """The schedule (straight, or 1F1B-RR over ``replicas``), long enough for an asynchronous one to reach its
        steady state."""
        key = (schedule, stages, chunks, v, replicas)
        if key not in self.timed:
            reps = None if replicas is None else list(replicas)
            if spec_of(schedule).asynchronous:
                minibatches = 3 * stages + 2 if chunks == 1 else stages + 2 if chunks >= stages else 2 * stages + 2
                self.timed[key] = build_schedule(schedule, stages, chunks, minibatches=minibatches, replicas=reps)
            elif reps is not None:
                self.timed[key] = build_schedule(schedule, stages, chunks, replicas=reps)
            else:
                self.timed[key] = build_schedule(schedule, stages, chunks, virtual_stages=v)
        return self.timed[key]

    def held(self, flight: Schedule, stages: int) -> list[Held]:
        """Per stage, its micro-batches in flight (counts: :func:`walk_held` on one byte each); unequal replicas:
        its busiest replica's."""
        ones = [1.0] * flight.num_stages
        counts = walk_held(flight, ones, ones)
        if flight.replicas is None:
            return counts
        layout = flight.layout
        assert layout is not None
        return [max((counts[r] for r in layout.ranks_of(s)), key=lambda h: (h.count, h.peak)) for s in range(stages)]

    # -- memory and time of a stage over layers i..j, as tables
    def memory_tables(self, held: Held, versions: int, chunks: int, replicas: int = 1,
                      shard: str | None = None, splits_backward: bool = False,
                      from_first: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Peak bytes of a worker holding layers i..j in stage position with ``held`` micro-batches in flight:
        without and with recompute (the same terms, rounded alike, as :func:`predict_memory`), its ``replicas``
        whole or sharded (``shard``; a split backward keeps a sharded stage gathered through the step);
        ``from_first``: gradients counted from the step's first backward on (:func:`gradients_from_first_backward`)."""
        key = ("memory", held, versions, chunks, replicas, shard, splits_backward, from_first)
        if key not in self.tables:
            self.tables[key] = self._memory_tables(held, versions, chunks, replicas, shard, splits_backward,
                                                   from_first)
        return self.tables[key]

    def _memory_tables(self, held: Held, versions: int, chunks: int, replicas: int,
                       shard: str | None, splits_backward: bool, from_first: bool) -> tuple[np.ndarray, np.ndarray]:
        r = self.ranges
        ratio = optimizer_state_ratio(self.optimizer)
        params = np.where(np.isfinite(r.params), r.params, 0.0)
        part = replicas if shard is not None else 1  # a sharded replica's share of weights, gradients, state
        weights = 2 * np.round(params / part) + np.round(ratio * params / part) + np.round((versions - 1) * params)
        working = np.round(backward_working(r.grad_working, r.grad_temps, chunks))
        if self.device == "cuda":  # foreach: the temporaries of all the stage's parameters at once; cuBLAS's workspaces
            update = np.round(FOREACH_TEMPORARIES[self.optimizer] * params / part)
            weights = weights + cublas_workspace_bytes(self.cuda_capability)
        else:
            update = np.round(OPTIMIZER_TEMPORARIES[self.optimizer] * r.largest / part)
        if shard is None and replicas > 1:  # the all-reduce's flat copy of the gradients
            update = np.maximum(update, np.round(params))
        # sharded, within a step: whole gradients and gathered weights (plan.shards), without and with recompute (whose
        # replay gathers the whole stage)
        unsharded: np.ndarray | float = 0.0
        unsharded_rc: np.ndarray | float = 0.0
        if shard is not None:
            whole = np.round(params if chunks > 1 or splits_backward else r.largest_layer)
            credit = np.maximum(0.0, whole - np.round(params / part))
            stage = np.round(params + r.largest_layer)  # plan.shards.gathered_bytes: the whole stage and a flat buffer
            kept = keeps_stage_gathered(shard, held.forward_after_backward, splits_backward=splits_backward)
            unsharded = credit + (stage if kept else np.round(r.two_largest_layers))
            unsharded_rc = credit + stage
        per_mb, per_mb_rc = (r.input + r.acts) / chunks, (r.input + r.output) / chunks
        first_stage = np.arange(r.n)[:, None] == 0  # its split backward's input half computes nothing
        per_pending = np.where(first_stage, r.output, r.pending) / chunks
        pending = held.most_pending * per_pending if held.most_pending else 0.0  # (0 x an empty range's inf)
        at_update = held.count_at_update
        in_update = np.round(at_update * per_mb if at_update else 0.0) + update
        plain = np.maximum(np.round(held.count * per_mb + pending) + working + unsharded, in_update)
        if from_first:  # gradients from the step's first backward on (plan.memory._gradients_from_first)
            plain = self._from_first(held, per_mb, per_pending, working, chunks, in_update, params, splits_backward,
                                     first_stage)
        replay = np.round(np.maximum(0.0, (r.acts - r.output) / chunks))
        pending_rc = held.most_pending * r.output / chunks if held.most_pending else 0.0
        again = np.maximum(np.round(held.count * per_mb_rc + pending_rc) + replay + working + unsharded_rc,
                           np.round(at_update * per_mb_rc if at_update else 0.0) + update)
        bad = ~np.isfinite(r.params) | r.idle
        return np.where(bad, _INF, weights + plain), np.where(bad, _INF, weights + again)

    def _from_first(self, held: Held, per_mb: np.ndarray, per_pending: np.ndarray, working: np.ndarray, chunks: int,
                    in_update: np.ndarray, params: np.ndarray, splits_backward: bool, first_stage: np.ndarray
                    ) -> np.ndarray:
        """What ``_memory_tables`` adds to the weights (gradients included) when the gradients are counted from the
        step's first backward on: the same terms as ``plan.memory._gradients_from_first``, over every range."""
        def held_bytes(count: int, waiting: int) -> np.ndarray | float:
            return (count * per_mb if count else 0.0) + (waiting * per_pending if waiting else 0.0)

        with_gradients = held_bytes(*held.with_gradients)
        before = np.round(held_bytes(*held.before_gradients)) + working
        first_count, first_waiting = held.first
        if first_count:
            sweep = np.round(held_bytes(first_count - 1, first_waiting) + self.ranges.first_backward(chunks))
            sweeps = first_stage | (not splits_backward)
            before = np.where(sweeps, np.maximum(before, sweep), before)
            # another stage's first weight half: all its gradients, less what it releases as it makes them
            weight_half = self.ranges.weight_half(chunks) - params
            with_gradients = np.where(sweeps, with_gradients,
                                      np.maximum(with_gradients, held_bytes(first_count, first_waiting) + weight_half))
        gradients = np.round(params)
        return np.maximum(np.maximum(np.round(with_gradients) + working, in_update), before - gradients)

    def time_tables(self, replicas: int, allreduce_bw: float, chunks: int, shard: str | None = None,
                    splits_backward: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Seconds per minibatch of a stage over layers i..j with ``replicas``: without and with recompute."""
        key = ("time", replicas, allreduce_bw, chunks, shard, splits_backward)
        if key not in self.tables:
            self.tables[key] = self._time_tables(replicas, allreduce_bw, chunks, shard, splits_backward)
        return self.tables[key]

    def _time_tables(self, replicas: int, allreduce_bw: float, chunks: int, shard: str | None,
                     splits_backward: bool) -> tuple[np.ndarray, np.ndarray]:
        r = self.ranges
        params = np.where(np.isfinite(r.params), r.params, 0.0)
        sync = _sync_seconds(params, replicas, allreduce_bw, chunks, shard, splits_backward)
        extra = 2 * chunks * self.overhead
        plain = (r.forward + r.backward + extra + sync) / replicas
        again = (2 * r.forward + r.backward + extra + sync) / replicas
        return np.where(r.idle, _INF, plain), np.where(r.idle, _INF, again)

    # -- one candidate
    def from_first(self, schedule: str, replicas: tuple[int, ...], shard: str | None) -> bool:
        """Whether gradients count from the step's first backward on (one stage per worker)."""
        return gradients_from_first_backward(schedule, 1, shard, len(set(replicas)) > 1, self.gradients_carried)

    def versions(self, schedule: str, held: Held) -> int:
        spec = spec_of(schedule)
        return max(1, held.count) if spec.weight_versions is None else spec.weight_versions

    def split(self, schedule: str, replicas: tuple[int, ...], chunks: int, fixed: list[int] | None,
              shard: str | None = None) -> tuple[list[int], list[bool]] | None:
        """The fastest split (bottleneck stage) within the limit, recompute only where a stage needs it."""
        p = len(replicas)
        flight = self.flight(schedule, p, chunks, replicas, 1)
        held = self.held(flight, p)
        ranks = self.ranks_of(replicas)
        split = spec_of(schedule).splits_backward
        from_first = self.from_first(schedule, replicas, shard)
        costs, flags = [], []
        for s in range(p):
            mem_plain, mem_rc = self.memory_tables(held[s], self.versions(schedule, held[s]), chunks, replicas[s],
                                                   shard, split, from_first)
            t_plain, t_rc = self.time_tables(replicas[s], self.group_bandwidth(ranks[s]), chunks, shard, split)
            needs = mem_plain > self.limit
            cost = np.where(needs, np.where(mem_rc <= self.limit, t_rc, _INF), t_plain)
            if s < p - 1 and fixed is None:
                cost = np.where(self.ranges.cuttable[None, :], cost, _INF)
            costs.append(cost)
            flags.append(needs)
        if fixed is not None and not all(math.isfinite(c) for c in stage_entries(costs, fixed)):
            return None  # the given split does not fit the limit
        balance = self.balance_of(costs, fixed)
        if balance is None:
            return None
        return balance, [bool(needs) for needs in stage_entries(flags, balance)]

    def least_memory(self, schedule: str, replicas: tuple[int, ...], chunks: int, fixed: list[int] | None,
                     shard: str | None = None) -> tuple[list[int], list[bool]] | None:
        """The split (recompute everywhere it helps) whose fullest worker needs the least memory."""
        p = len(replicas)
        held = self.held(self.flight(schedule, p, chunks, replicas, 1), p)
        split = spec_of(schedule).splits_backward
        from_first = self.from_first(schedule, replicas, shard)
        tables = [self.memory_tables(held[s], self.versions(schedule, held[s]), chunks, replicas[s], shard, split,
                                     from_first) for s in range(p)]
        balance = self.balance_of([np.minimum(plain, rc) for plain, rc in tables], fixed)
        if balance is None:
            return None
        plain = stage_entries([t[0] for t in tables], balance)
        recomputed = stage_entries([t[1] for t in tables], balance)
        return balance, [bool(rc < mem) for mem, rc in zip(plain, recomputed)]

    def balance_of(self, costs: list[np.ndarray], fixed: list[int] | None) -> list[int] | None:
        """``fixed`` (layers per stage, as given) or else the split whose costliest stage costs least, by each stage's
        ``costs`` (a table by first and last layer); None where every split has a stage of infinite cost."""
        if fixed is not None:
            return fixed
        found = minmax_split(costs, self.ranges.cuttable)
        return None if found is None else found[1]

    def interleaved_splits(self, replicas: tuple[int, ...], chunks: int, v: int, least: bool = False,
                           shard: str | None = None, schedule: str = "interleaved"
                           ) -> list[tuple[list[int], list[bool]]]:
        """Splits into ``ranks x v`` model chunks to try: the one minimising the slowest chunk, chunks cut at equal
        shares of the time, and equal layer counts with the remainder on the earlier chunks (which evens out each
        rank's sum). Recompute on every chunk of a rank that needs it (``least``: of a rank it lowers the peak of).
        ``schedule`` places the chunks (interleaved: stage s on rank s % ranks; zb-v, dualpipev: in a V)."""
        p = len(replicas)
        ranks = self.ranks_of(replicas)
        rank_of = [stage_rank(schedule, p, s) for s in range(p * v)]
        t_plain = [self.time_tables(replicas[rank_of[s]], self.group_bandwidth(ranks[rank_of[s]]), chunks, shard)[0]
                   for s in range(p * v)]
        found = minmax_split(t_plain, self.ranges.cuttable)
        if found is None:
            return []
        balances = [found[1]]
        shares = equal_shares(self.ranges.forward[0] + self.ranges.backward[0], p * v, self.ranges.cuttable)
        if shares is not None and shares not in balances and self.trains(shares):
            balances.append(shares)
        base, extra = divmod(self.ranges.n, p * v)  # earlier chunks take the remainder: each rank's sum evens out
        even = [base + (c < extra) for c in range(p * v)]
        if base and all(self.ranges.cuttable[np.cumsum(even)[:-1] - 1]) and even not in balances and self.trains(even):
            balances.append(even)
        out = []
        for balance in balances:
            sizes = self.sizes(balance)
            if least:  # recompute where it lowers the rank's peak (sharded, its replay gathers the whole chunk)
                plain, again = (self.memory_of(schedule, sizes, replicas, chunks, v, [rc] * (p * v), shard)
                                for rc in (False, True))
                out.append((balance, [again[rank_of[s]].predicted_peak_bytes < plain[rank_of[s]].predicted_peak_bytes
                                      for s in range(p * v)]))
                continue
            flags = [False] * (p * v)
            for rank, m in enumerate(self.memory_of(schedule, sizes, replicas, chunks, v, flags, shard)):
                if m.predicted_peak_bytes > self.limit:
                    for s in rank_stages(schedule, p, rank, v):
                        flags[s] = True
            out.append((balance, flags))
        return out

    def trains(self, balance: list[int]) -> bool:
        """Whether every stage of ``balance`` has parameters (an optimizer)."""
        bounds = np.cumsum([0] + balance)
        return not any(self.ranges.idle[bounds[s], bounds[s + 1] - 1] for s in range(len(balance)))

    def sizes(self, balance: list[int]) -> list[StageBytes]:
        key = tuple(balance)
        if key not in self.sized:
            self.sized[key] = stage_bytes(self.profile, balance, self.input_bytes, self.device)
        return self.sized[key]

    def memory_of(self, schedule: str, sizes: list[StageBytes], replicas: tuple[int, ...], chunks: int, v: int,
                  recompute: list[bool], shard: str | None = None) -> list[StageMemory]:
        flight = self.flight(schedule, len(replicas), chunks, replicas, v)
        return predict_memory(sizes, schedule, chunks, replicas=list(replicas), virtual_stages=v,
                              recompute=recompute, optimizer=self.optimizer, flight=flight, device=self.device,
                              cuda_capability=self.cuda_capability, shard=shard,
                              gradients_carried=self.gradients_carried)

    def time(self, schedule: str, balance: list[int], replicas: tuple[int, ...], chunks: int, v: int,
             recompute: list[bool], shard: str | None = None) -> float:
        """Seconds per minibatch from the schedule simulator.

        Replicated stages run as the schedule runs them where it can (gpipe, 1f1b and pipedream build 1F1B-RR:
        each replica takes its micro-batches whole and the replicas all-reduce in the schedule); otherwise d equal
        replicas are d copies of the straight pipeline that all-reduce once per step (2bw: per minibatch). Sharded
        replicas reduce-scatter once per step (half an all-reduce) and all-gather the stage's weights in each
        micro-batch's forward (``"full"``: and backward), on the critical path (no overlap is assumed); under a split
        backward (zb-h1) they gather each stage once per step, timed with the reduce-scatter. A rank's model chunks
        (interleaved) each synchronise their own weights: the rank's time is their sum."""
        spec = spec_of(schedule)
        p = len(replicas)
        ranks = self.ranks_of(replicas)
        bounds = np.cumsum([0] + balance)
        r = self.ranges
        fwd, bwd, weight, send, syncs = [], [], [], [], []
        for s in range(p * v):
            i, j = int(bounds[s]), int(bounds[s + 1]) - 1
            rank = stage_rank(schedule, p, s)
            f, b = float(r.forward[i, j]), float(r.backward[i, j])
            fwd.append(f / chunks + self.overhead)
            bwd.append((b + (f if recompute[s] else 0.0)) / chunks + self.overhead)
            weight.append(float(r.weight[i, j]) / chunks)  # zero bubble: the deferred weight-gradient part
            bandwidth = self.group_bandwidth(ranks[rank])
            # bytes as seconds at 1 B/s, as an all-reduce's; sharded: the reduce-scatter, half of one (and under a split
            # backward the step's one gather, the other half), and each micro-batch's gathers
            halves = 1.0 if shard is None else (1.0 + spec.splits_backward) / 2.0
            syncs.append(float(r.params[i, j]) / bandwidth * halves)
            gathers = gathers_per_microbatch(shard, spec.splits_backward)
            gather = float(ring_half_seconds(float(r.params[i, j]), replicas[rank], bandwidth)) if gathers else 0.0
            fwd[-1] += gather
            bwd[-1] += gather * max(0, gathers - 1)
            last = s == p * v - 1
            nxt = rank if last else stage_rank(schedule, p, s + 1)
            send.append(0.0 if last or nxt == rank else float(r.output[0, j]) / chunks / self.link(ranks, rank, nxt))
        d = replicas[0]
        if spec.unequal_replicas and max(replicas) > 1:
            schedule_ir = self.built(schedule, p, chunks, 1, replicas)
            result = simulate(schedule_ir, fwd, bwd, activation_bytes=send, bandwidth=1.0, parameter_bytes=syncs,
                              allreduce_bandwidth=1.0, check=False)
            self.simulated += 1
            return result.step_time / d  # a step admits one minibatch per replica of the input stage
        rounds = [float(ring_allreduce_seconds(a, replicas[stage_rank(schedule, p, s)], 1.0))
                  for s, a in enumerate(syncs)]
        # several chunks per rank: each of them its own
        per_rank = [sum(rounds[s] for s in rank_stages(schedule, p, rank, v)) for rank in range(p)]
        if spec.two_weight_versions:  # 2bw all-reduces each minibatch's coalesced gradients
            bwd = [x + a / chunks for x, a in zip(bwd, rounds)]
        result = simulate(self.built(schedule, p, chunks, v), fwd, bwd, activation_bytes=send, bandwidth=1.0,
                          weight_s=weight if spec.splits_backward else None, check=False)
        self.simulated += 1
        step = result.step_time
        if spec.flushes:
            step += max(per_rank)  # once per step, after the last backward
        return step / d

    def candidate(self, schedule: str, replicas: tuple[int, ...], chunks: int, v: int,
                  fixed: list[int] | None, least: bool = False, shard: str | None = None) -> Candidate | None:
        if chunks < least_chunks(schedule, len(replicas)):
            return None  # dualpipev: at least 2 micro-batches per rank
        self.considered += 1
        if v > 1:
            options = self.interleaved_splits(replicas, chunks, v, least, shard, schedule)
        else:
            found = (self.least_memory if least else self.split)(schedule, replicas, chunks, fixed, shard)
            options = [] if found is None else [found]
        best: Candidate | None = None
        for balance, recompute in options:
            if not self.trains(balance):  # PipeDream's split for unequal replicas may leave a stage without any
                continue
            sizes = self.sizes(balance)
            memory = tuple(self.memory_of(schedule, sizes, replicas, chunks, v, recompute, shard))
            peak = max(m.predicted_peak_bytes for m in memory)
            if least:
                if best is None or peak < best.peak_bytes:
                    best = Candidate(schedule, tuple(balance), replicas, chunks, v, tuple(recompute), _INF, memory,
                                     shard)
                continue
            if peak > self.limit:
                continue
            time = self.time(schedule, balance, replicas, chunks, v, recompute, shard)
            if best is None or time < best.time_per_minibatch:
                best = Candidate(schedule, tuple(balance), replicas, chunks, v, tuple(recompute), time, memory, shard)
        return best


def _sync_seconds(params: np.ndarray, replicas: int, bandwidth: float, chunks: int, shard: str | None,
                  splits_backward: bool = False) -> np.ndarray:
    """A stage's gradient and weight traffic per step: replicas one all-reduce; shards one reduce-scatter and the
    step's all-gathers (plan.shards.gathers_per_step: one per micro-batch, or per forward and backward; one under a
    split backward)."""
    if shard is None:
        return np.asarray(ring_allreduce_seconds(params, replicas, bandwidth))
    gathers = gathers_per_step(shard, chunks, splits_backward)
    return np.asarray(ring_half_seconds(params, replicas, bandwidth)) * (1 + gathers)


_Layout = tuple[tuple[int, ...], "list[int] | None"]  # replicas per stage, and a fixed split (None: the planner's)


def replica_layouts(profile: Profile, topology: Topology, stages_possible: int, replicas: str = "any") -> list[_Layout]:
    """Equal replicas (d data-parallel pipelines of W/d stages for every d dividing W, split by the planner), and
    PipeDream's optimizer's unequal replicas with its split; ``replicas="equal"``: the equal ones only; ``"none"``: one
    pipeline of W stages only."""
    workers = topology.num_workers
    out: list[_Layout] = []
    for d in (1,) if replicas == "none" else range(1, workers + 1):
        if workers % d == 0 and workers // d <= stages_possible:
            out.append(((d,) * (workers // d), None))
    if replicas != "any":
        return out
    try:
        plan = partition(profile, topology, "pipedream")
    except ValueError:
        return out
    unequal = tuple(stage.replicas for stage in plan.stages)
    if len(set(unequal)) > 1 and sum(unequal) == workers:
        out.append((unequal, plan.balance))
    return out


def _chunk_counts(max_chunks: int, batch_size: int | None) -> list[int]:
    top = max_chunks if batch_size is None else min(max_chunks, batch_size)
    counts, m = [], 1
    while m <= top:
        counts.append(m)
        m *= 2
    return counts


def auto_plan(
    profile: Profile,
    topology: Topology,
    memory_limit: float | None = None,
    *,
    exact: bool = False,
    optimizer: str = "adam",
    schedules: Sequence[str] | None = None,
    max_chunks: int = 16,
    microbatch_overhead_s: float = 0.0,
    input_bytes: float | None = None,
    device: str = "cpu",
    cuda_capability: tuple[int, int] = (9, 0),
    shard: str | None = None,
    straight: bool = False,
    replicas: str | None = None,
    gradients_carried: bool = False,
) -> AutoPlan:
    """Choose the stage split, replicas, schedule, micro-batches and per-stage recompute for ``topology``.

    Minimises the simulated time per minibatch (the profile's batch, one data shard) among configurations whose
    every worker's predicted peak memory (:func:`predict_memory`) is within ``memory_limit`` bytes. ``exact``
    admits only schedules equal to one device (gpipe, 1f1b, zb-h1, interleaved); otherwise pipedream and 2bw
    too. ``schedules`` narrows the choice further. ``optimizer`` ("sgd", "momentum", "adam") sizes the optimizer
    state. Micro-batch counts are powers of two up to ``max_chunks`` (and the profile's batch size);
    ``microbatch_overhead_s`` is a fixed cost per micro-batch forward and backward on each stage, which makes
    splitting finer a trade. ``input_bytes``: the batch stage 0 keeps (default: ``profile.extra["input_bytes"]``).
    ``device="cuda"`` predicts memory as a GPU of ``cuda_capability`` counts it (see ``plan.memory.predict_memory``).
    ``shard``: None (default) keeps whole replicas; ``"grad_op"`` or ``"full"`` shards every configuration that can
    be (equal replicas of a flushed schedule: gpipe, 1f1b, interleaved, zb-h1; recompute where a stage needs it)
    and tries only those; ``"auto"`` weighs both: sharding where
    whole replicas do not fit, replicas where both fit (they avoid the all-gathers), the reason in
    :attr:`AutoPlan.shard_note`. ``replicas``: which stage replicas to weigh: ``"any"`` (the default) equal ones (d
    data-parallel pipelines of W/d stages, each d dividing the W workers) and PipeDream's unequal ones (1F1B-RR);
    ``"equal"`` the equal ones only (a straight pipeline among them, d = 1); ``"none"`` one stage per worker, no
    replicas. ``straight=True`` is ``replicas="none"``.
    ``gradients_carried``: steps start with gradients (``accumulate_grad_batches`` > 1; see ``predict_memory``).

    Raises :class:`NoPlanFitsError`, naming the smallest limit that fits, when nothing fits.
    """
    modes = shard_modes(shard)
    which = _replica_choice(replicas, straight)
    if memory_limit is not None and not (isinstance(memory_limit, (int, float)) and memory_limit > 0):
        raise ValueError(f"memory_limit is {memory_limit!r}; give bytes per worker > 0, or None for no limit.")
    optimizer_state_ratio(optimizer)
    if not isinstance(max_chunks, int) or isinstance(max_chunks, bool) or max_chunks < 1:
        raise ValueError(f"max_chunks must be a whole number >= 1, got {max_chunks!r}.")
    if not microbatch_overhead_s >= 0:
        raise ValueError(f"microbatch_overhead_s must be >= 0 seconds, got {microbatch_overhead_s!r}.")
    names = list(SCHEDULES) if schedules is None else [spec_of(name).name for name in schedules]
    if exact:
        refused = [name for name in names if not spec_of(name).exact]
        if schedules is not None and refused:
            raise ValueError(
                f"exact=True admits only schedules equal to one device; {', '.join(refused)} "
                f"{'is' if len(refused) == 1 else 'are'} not. Drop them or drop exact (--exact)."
            )
        names = [name for name in names if spec_of(name).exact]
    if input_bytes is None:
        input_bytes = float(profile.extra.get("input_bytes", 0) or 0)
    search = _Search(profile, topology, memory_limit, optimizer, float(microbatch_overhead_s), float(input_bytes),
                     LayerRanges(profile, float(input_bytes), device), device=device,
                     cuda_capability=tuple(cuda_capability),  # type: ignore[arg-type]
                     gradients_carried=gradients_carried)
    stages_possible = 1 + int(search.ranges.cuttable.sum())
    groups = _groups(profile, topology, names, stages_possible, modes, which)
    if not groups and None not in modes:
        raise ValueError(
            f"shard={shard!r} shards equal replicas (at least 2 per stage) of a flushed schedule (gpipe, 1f1b, "
            f"interleaved, zb-h1), and no configuration of {', '.join(names)} on {topology.num_workers} workers has "
            "them. Allow one of those schedules, give at least 2 workers, or use shard='auto' (or None) to let "
            "replicas keep whole copies."
        )
    chunk_counts = _chunk_counts(max_chunks, profile.batch_size)
    found: list[Candidate] = []
    for schedule, layout, v, fixed, mode in groups:
        counts = chunk_counts if spec_of(schedule).microbatches else [1]
        best = _INF
        for chunks in counts:
            c = search.candidate(schedule, layout, chunks, v, fixed, shard=mode)
            if c is None:
                continue
            found.append(c)
            if c.time_per_minibatch > best * (1 + 1e-9):
                break  # finer micro-batches stopped paying (their overhead, or the transfers)
            best = min(best, c.time_per_minibatch)
    if not found:
        raise _refusal(search, groups, chunk_counts, names, exact)
    chosen = min(found, key=lambda c: _preference(c, found))
    others = [c for c in found if c.shape != chosen.shape]
    runner_up = min(others, key=lambda c: _preference(c, others)) if others else None
    plan = _to_plan(search, chosen, runner_up)
    note = _shard_note(search, chosen, found) if len(modes) > 1 else None
    return AutoPlan(plan, chosen, runner_up, memory_limit, exact, optimizer, search.considered, search.simulated,
                    profile.batch_size, note)


REPLICA_CHOICES = ("any", "equal", "none")


def _replica_choice(replicas: str | None, straight: bool) -> str:
    """``auto_plan``'s ``replicas=`` (default ``"any"``), with ``straight=True`` meaning ``"none"``."""
    if replicas is None:
        return "none" if straight else "any"
    if replicas not in REPLICA_CHOICES:
        raise ValueError(f"replicas={replicas!r} is not a choice: use 'any' (equal and unequal replicas), 'equal' "
                         "(data-parallel pipelines of equal length) or 'none' (one stage per worker).")
    if straight and replicas != "none":
        raise ValueError(f"straight=True plans one stage per worker, which replicas={replicas!r} contradicts. Give "
                         "one of them (straight=True is replicas='none').")
    return replicas


def _shard_note(search: _Search, chosen: Candidate, found: list[Candidate]) -> str:
    """Why the choice shards its replicas or keeps them whole, in words (``shard="auto"``)."""
    if chosen.shard is not None:
        whole = search.memory_of(chosen.schedule, search.sizes(list(chosen.balance)), chosen.replicas, chosen.chunks,
                                 chosen.virtual_stages, list(chosen.recompute))
        peak = max(m.predicted_peak_bytes for m in whole)
        if peak > search.limit:
            return (f"sharded ({chosen.shard}): with whole replicas this configuration needs {bytes_text(peak)} on its "
                    f"fullest worker, over the limit of {bytes_text(search.limit)}; sharded it needs "
                    f"{bytes_text(chosen.peak_bytes)}")
        return (f"sharded ({chosen.shard}): faster than every configuration with whole replicas that fits "
                f"(this one with whole replicas needs {bytes_text(peak)})")
    sharded = [c for c in found if c.shard is not None]
    if not sharded:
        return "whole replicas: no configuration that fits can shard (equal replicas of a flushed schedule)"
    best = min(sharded, key=lambda c: _preference(c, sharded))
    slower = best.time_per_minibatch / chosen.time_per_minibatch - 1 if chosen.time_per_minibatch > 0 else 0.0
    return (f"whole replicas: both fit, and replicas avoid the all-gathers; the best sharded plan, {best.label()}, "
            f"takes {slower:+.1%} and needs {bytes_text(best.peak_bytes)} on its fullest worker")


_Group = tuple[str, tuple[int, ...], int, "list[int] | None", "str | None"]  # + virtual stages, fixed split, shard


def _groups(profile: Profile, topology: Topology, names: list[str], stages_possible: int,
            modes: tuple[str | None, ...] = (None,), replicas: str = "any") -> list[_Group]:
    """(schedule, replicas, virtual stages, fixed split or None, shard) for every configuration shape to try: each
    shape once per sharding mode in ``modes`` it can run (plan.shards.can_shard)."""
    out: list[_Group] = []
    for name, counts, v, fixed in _shapes(profile, topology, names, stages_possible, replicas):
        out += [(name, counts, v, fixed, mode) for mode in modes if mode is None or can_shard(name, counts)]
    return out


def _shapes(profile: Profile, topology: Topology, names: list[str], stages_possible: int,
            which: str = "any") -> list[tuple[str, tuple[int, ...], int, list[int] | None]]:
    out: list[tuple[str, tuple[int, ...], int, list[int] | None]] = []
    for replicas, fixed in replica_layouts(profile, topology, stages_possible, which):
        p, unequal = len(replicas), len(set(replicas)) > 1
        for name in names:
            spec = spec_of(name)
            if unequal and not spec.unequal_replicas:
                continue
            if spec.virtual_stages:
                v = V_CHUNKS if spec.v_shape else INTERLEAVED_VIRTUAL_STAGES
                if p < 2 or p * v > stages_possible or unequal:
                    continue
                out.append((name, replicas, v, None))
            elif spec.splits_backward and p < 2:
                continue  # one stage has nothing to fill its bubbles with: 1f1b is the same
            else:
                out.append((name, replicas, 1, fixed))
    return out


def _preference(c: Candidate, among: list[Candidate]) -> tuple:
    """Fastest first; among times within 1e-6 of the best: exact schedules, less recompute, whole replicas (no
    gathers), less memory, fewer micro-batches, fewer stages, and ``grad_op`` before ``full`` (zb-h1 runs both
    alike, keeping the weights gathered through the step: ``grad_op`` names that)."""
    fastest = min(x.time_per_minibatch for x in among)
    near = c.time_per_minibatch <= fastest * (1 + 1e-6)
    return (not near, c.time_per_minibatch if not near else 0.0, not spec_of(c.schedule).exact, sum(c.recompute),
            c.shard is not None, c.peak_bytes, c.chunks, len(c.replicas), c.schedule, SHARD_ORDER[c.shard])


SHARD_ORDER = {None: 0, "grad_op": 1, "full": 2}  # on a tie: fewer gathers first


def _refusal(
    search: _Search, groups: list[_Group], chunk_counts: list[int], names: list[str], exact: bool
) -> ValueError:
    layers, count = len(search.profile.layers), search.topology.num_workers
    workers = f"{count} worker{'s' if count != 1 else ''}"
    cannot = ValueError(
        f"No configuration of the {layers} layers on {workers} can run {', '.join(names)}: every stage needs "
        "a layer with parameters (its optimizer's), zb-h1 needs 2 stages or more and interleaved 2 model chunks per "
        "worker. Allow other schedules, or change the number of workers."
    )
    if search.memory_limit is None:
        return cannot
    least: Candidate | None = None
    for schedule, replicas, v, fixed, mode in groups:
        counts = chunk_counts if spec_of(schedule).microbatches else [1]
        for chunks in counts:
            c = search.candidate(schedule, replicas, chunks, v, fixed, least=True, shard=mode)
            if c is not None and (least is None or c.peak_bytes < least.peak_bytes):
                least = c
    which = "exact schedule" if exact else "schedule"
    if least is None:
        return cannot
    limit = float(search.memory_limit)
    tried = {mode for *_, mode in groups}
    sharded = sorted(mode for mode in tried if mode is not None)
    replicas_words = ("replicas" if not sharded else "replicas whole or sharded" if None in tried
                      else f"replicas sharded ({', '.join(sharded)})")
    hint = "."
    if not sharded:  # would sharded replicas fit? Say so, with the least they need
        shardable = [c for name, replicas, v, fixed, _ in groups if can_shard(name, replicas)
                     for chunks in chunk_counts
                     if (c := search.candidate(name, replicas, chunks, v, fixed, least=True, shard="full")) is not None]
        fits = min(shardable, key=lambda c: c.peak_bytes, default=None)
        if fits is not None and fits.peak_bytes <= limit:
            hint = (f"; or shard the replicas: {fits.label()} needs {fits.peak_bytes} bytes (shard='auto' lets the "
                    "planner weigh it).")
    return NoPlanFitsError(
        f"No configuration of the {layers} layers on {workers} (any split, {replicas_words}, {which}, micro-batches "
        f"and recompute) keeps every worker within memory_limit={limit:.0f} bytes ({bytes_text(limit)}): the least "
        f"any needs is {least.peak_bytes} bytes ({bytes_text(least.peak_bytes)}) per worker, with {least.label()}. "
        f"Raise the limit to at least {least.peak_bytes} bytes, or add workers"
        + hint,
        least.peak_bytes, least)


def _to_plan(search: _Search, c: Candidate, runner_up: Candidate | None) -> Plan:
    """The chosen candidate as a :class:`Plan` (interleaved: one stage per model chunk)."""
    r, names = search.ranges, search.profile.names
    p = len(c.replicas)
    ranks = search.ranks_of(c.replicas)
    bounds = np.cumsum([0] + list(c.balance))
    stages = []
    for s in range(len(c.balance)):
        i, j = int(bounds[s]), int(bounds[s + 1]) - 1
        rank = stage_rank(c.schedule, p, s)
        rep = c.replicas[rank]
        f, b = float(r.forward[i, j]), float(r.backward[i, j])
        sync = float(_sync_seconds(np.asarray(float(r.params[i, j])), rep, search.group_bandwidth(ranks[rank]),
                                   c.chunks, c.shard, spec_of(c.schedule).splits_backward))
        stages.append(StagePlan(
            layers=names[i : j + 1], replicas=rep, compute_s=(f + b) / rep, forward_s=f / rep, allreduce_s=sync / rep,
            parameter_bytes=int(r.params[i, j]), output_bytes=int(r.output[0, j]),
        ))
    one_worker = float(r.forward[0, r.n - 1] + r.backward[0, r.n - 1])
    extra: dict[str, Any] = {
        "recompute": list(c.recompute),
        "optimizer": search.optimizer,
        "predicted_peak_bytes": [m.predicted_peak_bytes for m in c.memory],
        "memory": [m.to_json() for m in c.memory],
    }
    if c.virtual_stages > 1:  # the stages are the model chunks (interleaved: chunk c of rank r is stage c * ranks + r)
        extra["virtual_stages"] = c.virtual_stages
        extra["chunk_stages"] = True
    if search.memory_limit is not None:
        extra["memory_limit"] = search.memory_limit
    if runner_up is not None:
        extra["runner_up"] = {"label": runner_up.label(), "time_per_minibatch": runner_up.time_per_minibatch,
                              "peak_bytes": runner_up.peak_bytes}
    return Plan(
        stages=stages, schedule=c.schedule, chunks=c.chunks, time_per_minibatch=c.time_per_minibatch,
        speedup_vs_one_worker=one_worker / c.time_per_minibatch if c.time_per_minibatch > 0 else None,
        method="auto", topology=search.topology.to_json(), one_worker_time=one_worker, source=search.profile.source,
        extra=extra, shard=c.shard,
    )


def memory_tables(profile: Profile, schedule: str, stages: int, chunks: int, *, optimizer: str = "adam",
                  input_bytes: float | None = None, gradients_carried: bool = False
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The planner's memory tables for one straight pipeline of ``stages`` under ``schedule``: per stage position,
    the predicted peak bytes of a worker holding layers i..j (``[i, j]``), without and with recompute; inf where no
    stage can be (j < i, or no parameters). The search reads these instead of calling
    :func:`~lightning_pipedream.plan.memory.predict_memory` for every split; for any split they give its figures."""
    if input_bytes is None:
        input_bytes = float(profile.extra.get("input_bytes", 0) or 0)
    search = _Search(profile, Topology.flat(stages, _INF), None, optimizer, 0.0, float(input_bytes),
                     LayerRanges(profile, float(input_bytes)), gradients_carried=gradients_carried)
    replicas = (1,) * stages
    held = search.held(search.flight(schedule, stages, chunks, replicas, 1), stages)
    from_first = search.from_first(schedule, replicas, None)
    return [search.memory_tables(h, search.versions(schedule, h), chunks, 1, None, spec_of(schedule).splits_backward,
                                 from_first) for h in held]
