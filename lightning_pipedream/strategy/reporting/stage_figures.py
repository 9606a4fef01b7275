"""Every stage's measured time, bubble and memory, brought to rank 0 and written through Lightning's loggers.

Each rank's :class:`~lightning_pipedream.runtime.execution.accounts.StepAccounts` splits its steps' time into
compute, waiting for a peer, transfer, update and the rest. Every ``log_every_n_steps`` training steps each rank
sends its figures of those steps to rank 0 (one small ``isend`` on a gloo group of its own, never a collective, so
that it cannot close a circle with the collectives an asynchronous schedule has in flight across steps); rank 0
takes each interval's messages as they arrive (a thread of its own waits for them, since gloo completes a receive
only when waited for; the training thread only looks, until the end of the fit) and logs through the Trainer's
loggers, at the step the interval ended:

- ``pipeline/stage{k}/{compute,wait,transfer,update,other,step}_ms``: mean per step (``stage{k}/replica{j}/...``
  when stages have data-parallel replicas);
- ``pipeline/stage{k}/device_compute_ms`` (CUDA only): the compute actions' time on the GPU, from CUDA events that
  the accounts resolve when an interval's figures are taken here (one synchronization per interval), beside the
  host's parts (which add up to ``step_ms``);
- ``pipeline/stage{k}/peak_memory_mb``: the rank's peak so far (CUDA: allocated tensors; CPU: the process's resident
  set), and ``pipeline/stage{k}/predicted_memory_mb`` where the memory model predicted the stage;
- ``pipeline/stage{k}/peak_live_mb``: with ``trace=``, the peak of the stage's live tensor bytes over the traced
  window so far (``live_memory.py``): what the prediction counts, on any device;
- ``pipeline/bubble``: the share of all ranks' step time spent waiting, and ``pipeline/bubble_simulated``: the
  schedule simulator's for the same schedule and the plan's stage times (equal stages without a plan). The measured
  bubble also goes into the Trainer's progress bar, as ``bubble``, beside the loss.

``PipeDreamStrategy(log_figures=False)`` turns the logging (and the progress bar's figure) off (the accounting
itself stays: it is a few clock reads per action). At the end of the fit rank 0 holds every rank's totals
(:attr:`StageFigures.totals`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import resource
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipedream.runtime.communication.waits import BackgroundWaits, Posted, unprofiled
from lightning_pipedream.runtime.execution.accounts import SLOTS, Figures, StepAccounts
from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.schedule.merged_trace import RankTrace

log = logging.getLogger(__name__)

_HEAD = 6  # rank, stage, replica, the global step the interval ended at, peak memory bytes, live tensor peak bytes
_MESSAGE = _HEAD + SLOTS


@dataclass
class RankFigures:
    """One rank's figures over some steps, as rank 0 received them."""

    rank: int
    stage: int
    replica: int
    step: int
    peak_bytes: float
    figures: Figures
    live_peak_bytes: float = math.nan  # the traced window's peak of live tensor bytes (NaN: not measured)


def peak_memory_bytes(device: torch.device) -> float:
    """This rank's peak memory so far: CUDA's allocated tensors, or on the CPU the process's peak resident set."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0  # Linux reports kilobytes


def simulated_bubble(schedule: str, num_stages: int, chunks: int, virtual_stages: int = 1,
                     plan: Any = None) -> float | None:
    """The schedule simulator's bubble (idle share of rank-time) for one step of ``schedule``: with the plan's stage
    times when it has one per stage, else equal stages (backward twice the forward). None where it cannot say."""
    from lightning_pipedream.schedule.builders import build_schedule
    from lightning_pipedream.schedule.simulate import simulate
    from lightning_pipedream.schedule.specs import spec_of

    try:
        spec = spec_of(schedule)
        v = virtual_stages if spec.virtual_stages else 1
        n = num_stages * v
        forward, backward = [1.0] * n, [2.0] * n
        stages = getattr(plan, "stages", None)
        if stages is not None and len(stages) == n and all(s.compute_s > 0 for s in stages):
            forward = [s.forward_s or s.compute_s / 3 for s in stages]
            backward = [s.compute_s - f for s, f in zip(stages, forward)]
        if spec.asynchronous:
            built = build_schedule(schedule, num_stages, chunks, minibatches=32)
        else:
            built = build_schedule(schedule, num_stages, chunks, virtual_stages=v)
        per = max(1, chunks) if spec.microbatches else 1
        return simulate(built, [f / per for f in forward], [b / per for b in backward], check=False).bubble_fraction
    except Exception as err:  # a layout the simulator does not take (replicas): say nothing rather than stop
        log.debug("no simulated bubble for %s: %s", schedule, err)
        return None


class StageFigures:
    """Sends this rank's figures every ``every`` steps; on rank 0 receives everyone's and logs them (module text).

    ``replicas``: whether stages have data-parallel replicas (the keys then name them); ``predicted_bytes``: the
    memory model's peak per stage, where known; ``simulated``: the simulator's bubble.
    """

    def __init__(self, accounts: StepAccounts, *, rank: int, world_size: int, stage: int, replica: int,
                 every: int, device: torch.device, replicas: bool, enabled: bool = True,
                 predicted_bytes: list[float] | None = None, simulated: float | None = None,
                 timeout: timedelta | None = None) -> None:
        self.accounts = accounts
        self.rank, self.world_size, self.stage, self.replica = rank, world_size, stage, replica
        self.every = max(1, int(every))
        self.device = device
        self.replicas = replicas
        self.enabled = enabled
        self.predicted_bytes = predicted_bytes
        self.simulated = simulated
        self.group: Any = None
        self.offset = 0.0  # seconds to add to this rank's clock to read rank 0's
        if world_size > 1 and dist.is_initialized():
            # Every rank makes it (new_group is collective, at setup), with the strategy's timeout; gloo: CPU tensors,
            # no device synchronization.
            self.group = dist.new_group(backend="gloo", timeout=timeout)
            with pipeline_failures(stage, waiting="the clocks' round trips with rank 0 (setup)",
                                   peers=(0,) if rank else tuple(range(1, world_size))):
                self.offset = clock_offset(self.group, rank, world_size)
        self._steps = 0
        self._waiter = BackgroundWaits()
        self._sends: deque[tuple[Posted, torch.Tensor]] = deque()
        self._receives: deque[tuple[Posted, list[torch.Tensor]]] = deque()  # rank 0: per interval, every other rank's
        self._own: deque[RankFigures] = deque()  # rank 0's own figures, waiting for the others' of the interval
        self.received: list[list[RankFigures]] = []  # rank 0: every interval's figures, all ranks, in order
        self._bad_loggers: set[int] = set()
        self.loggers: list[Any] = []  # rank 0: the Trainer's loggers (set by the strategy)
        # rank 0: puts a figure in the Trainer's progress bar (set by the strategy): the measured bubble, as `bubble`
        self.progress_bar: Callable[[str, float], None] | None = None
        # The traced window's peak of live tensor bytes so far (``live_memory.py``), where a meter runs; NaN before.
        self.live_peak: Callable[[], float] = lambda: math.nan

    # -- every training step ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.accounts.begin_step()

    def end_step(self, global_step: int) -> None:
        """After this rank's step: every ``every`` steps, the figures go to rank 0; rank 0 logs what has arrived."""
        self.accounts.end_step()
        self._steps += 1
        if self._steps % self.every == 0:
            self._share(global_step)
        if self.rank == 0:
            self._log_arrived(wait=False)

    def finish(self, global_step: int) -> None:
        """The fit's end (every rank, after the drain): the last steps' figures; rank 0 waits for all and logs."""
        self.accounts.finish()
        self._share(global_step)
        peers = tuple(range(1, self.world_size)) if self.rank == 0 else (0,)
        with pipeline_failures(self.stage, waiting="the stage figures' delivery (end of the fit)", peers=peers):
            if self.rank == 0:
                self._log_arrived(wait=True)
            while self._sends:
                self._sends.popleft()[0].result()
        self._waiter.stop()

    def forget(self) -> None:
        """After a failure: nothing more is exchanged."""
        self._sends.clear()
        self._receives.clear()
        self._own.clear()
        self._waiter.stop()

    # -- what travels ---------------------------------------------------------------------------------------------
    def _share(self, global_step: int) -> None:
        figures = self.accounts.take()  # (at the end, maybe of no step: rank 0 expects one message from every rank)
        message = torch.tensor([self.rank, self.stage, self.replica, global_step, peak_memory_bytes(self.device),
                                self.live_peak()] + figures.values(), dtype=torch.float64)
        if self.rank == 0:
            self._own.append(_parse(message))
            if self.group is not None:
                buffers = [torch.empty(_MESSAGE, dtype=torch.float64) for _ in range(1, self.world_size)]
                with unprofiled():  # the waiter thread ends them (waits.py)
                    works = [dist.irecv(buffer, src=peer, group=self.group) for peer, buffer in enumerate(buffers, 1)]
                self._receives.append((self._waiter.post(works), buffers))
            return
        if self.group is not None:
            with unprofiled():
                work = dist.isend(message, dst=0, group=self.group)
            self._sends.append((self._waiter.post([work]), message))
            while self._sends and self._sends[0][0].done.is_set() and self._sends[0][0].error is None:
                self._sends.popleft()  # sent: its buffer can go (a failed one stays, for finish to raise)

    def _log_arrived(self, wait: bool) -> None:
        while self._own:
            buffers: list[torch.Tensor] = []
            if self.group is not None:
                posted, buffers = self._receives[0]
                if not wait and (not posted.done.is_set() or posted.error is not None):
                    return  # not all here yet (or failed: raised at the fit's end, where a failure names the peer)
                posted.result()
                self._receives.popleft()
            interval = [self._own.popleft()] + [_parse(buffer) for buffer in buffers]
            self.received.append(interval)
            if self.enabled and any(r.figures.steps for r in interval):
                self._log(interval)

    def gather_traces(self, mine: RankTrace) -> list[RankTrace] | None:
        """At the fit's end (every rank): each rank's recorded actions to rank 0 (point to point), which returns
        them all; None elsewhere."""
        payload = torch.frombuffer(bytearray(json.dumps(mine.to_json()).encode()), dtype=torch.uint8)
        if self.rank != 0:
            if self.group is not None:
                size = torch.tensor([payload.numel()], dtype=torch.int64)
                with pipeline_failures(self.stage, waiting="the trace's delivery to rank 0", peers=(0,)):
                    dist.send(size, dst=0, group=self.group)
                    dist.send(payload, dst=0, group=self.group)
            return None
        out = [mine]
        for peer in range(1, self.world_size if self.group is not None else 1):
            size = torch.empty(1, dtype=torch.int64)
            with pipeline_failures(self.stage, waiting=f"rank {peer}'s trace", peers=(peer,)):
                dist.recv(size, src=peer, group=self.group)
                buffer = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(buffer, src=peer, group=self.group)
            out.append(RankTrace.from_json(json.loads(bytes(buffer.numpy()).decode())))
        return out

    # -- rank 0 -------------------------------------------------------------------------------------------------
    def metrics(self, interval: list[RankFigures]) -> dict[str, float]:
        """The logger keys and values of one interval's figures (all ranks)."""
        out: dict[str, float] = {}
        waited = stepped = 0.0
        for r in sorted(interval, key=lambda r: (r.stage, r.replica)):
            if r.figures.steps == 0:
                continue
            prefix = f"pipeline/stage{r.stage}/" + (f"replica{r.replica}/" if self.replicas else "")
            for part, ms in r.figures.per_step_ms().items():
                out[f"{prefix}{part}_ms"] = ms
            out[f"{prefix}peak_memory_mb"] = r.peak_bytes / 2**20
            if math.isfinite(r.live_peak_bytes):
                out[f"{prefix}peak_live_mb"] = r.live_peak_bytes / 2**20
            if self.predicted_bytes is not None and r.stage < len(self.predicted_bytes):
                out[f"{prefix}predicted_memory_mb"] = self.predicted_bytes[r.stage] / 2**20
            waited += r.figures.wait
            stepped += r.figures.step
        if stepped > 0:
            out["pipeline/bubble"] = waited / stepped
        if self.simulated is not None and math.isfinite(self.simulated):
            out["pipeline/bubble_simulated"] = self.simulated
        return out

    def _log(self, interval: list[RankFigures]) -> None:
        step = max(r.step for r in interval)
        metrics = self.metrics(interval)
        if self.progress_bar is not None and "pipeline/bubble" in metrics:
            self.progress_bar("bubble", metrics["pipeline/bubble"])
        for logger in self.loggers:
            if id(logger) in self._bad_loggers:
                continue
            try:
                logger.log_metrics(metrics, step=step)
            except Exception as err:  # a logger that cannot take these names must not stop training
                self._bad_loggers.add(id(logger))
                log.warning(
                    "PipeDreamStrategy: the logger %s refused the pipeline's figures (%s: %s); they are no longer "
                    "sent to it. Training goes on. PipeDreamStrategy(log_figures=False) stops logging them.",
                    type(logger).__name__, type(err).__name__, err)

    @property
    def totals(self) -> dict[int, RankFigures]:
        """Rank 0: each rank's figures over every step received so far (the whole fit, after :meth:`finish`)."""
        out: dict[int, RankFigures] = {}
        for interval in self.received:
            for r in interval:
                if r.rank in out:
                    seen = out[r.rank]
                    out[r.rank] = RankFigures(r.rank, r.stage, r.replica, max(seen.step, r.step),
                                              max(seen.peak_bytes, r.peak_bytes), seen.figures + r.figures,
                                              _most(seen.live_peak_bytes, r.live_peak_bytes))
                else:
                    out[r.rank] = r
        return out


def clock_offset(group: Any, rank: int, world_size: int, rounds: int = 8) -> float:
    """Seconds to add to this rank's clock (``perf_counter``) to read rank 0's, estimated at setup by a few
    round trips with rank 0 (the one with the shortest round trip; error at most half of it). Ranks on rank 0's
    machine share its clock (Linux's monotonic clock is one per machine): 0 exactly."""
    from lightning_pipedream.runtime.execution.accounts import clock
    from lightning_pipedream.runtime.faults.mailbox import machine_id

    here = float(int(hashlib.sha1(machine_id().encode()).hexdigest()[:12], 16))
    if rank == 0:
        for peer in range(1, world_size):
            for _ in range(rounds):
                ping = torch.empty(2, dtype=torch.float64)
                dist.recv(ping, src=peer, group=group)
                dist.send(torch.tensor([clock(), here], dtype=torch.float64), dst=peer, group=group)
        return 0.0
    best = (math.inf, 0.0)
    same = False
    for _ in range(rounds):
        sent = clock()
        dist.send(torch.tensor([sent, here], dtype=torch.float64), dst=0, group=group)
        pong = torch.empty(2, dtype=torch.float64)
        dist.recv(pong, src=0, group=group)
        back = clock()
        same = float(pong[1]) == here
        best = min(best, (back - sent, float(pong[0]) - (sent + back) / 2))
    return 0.0 if same else best[1]


def _parse(message: torch.Tensor) -> RankFigures:
    values = message.tolist()
    return RankFigures(int(values[0]), int(values[1]), int(values[2]), int(values[3]), values[4],
                       Figures.of(values[_HEAD:]), values[5])


def _most(a: float, b: float) -> float:
    """The larger of two peaks, either of which may be NaN (not measured)."""
    return a if not math.isfinite(b) else b if not math.isfinite(a) else max(a, b)


TRACE_FILE = "pipeline_trace.json"


def check_trace_dir(trace_dir: str | os.PathLike) -> None:
    """Refuse, before training, a trace directory that cannot be written (rank 0 writes the merged trace there)."""
    try:
        os.makedirs(trace_dir, exist_ok=True)
        probe = os.path.join(trace_dir, f".{TRACE_FILE}.probe")
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as err:
        raise ValueError(
            f"PipeDreamStrategy(trace={os.fspath(trace_dir)!r}): rank 0 cannot write there ({err.strerror or err}); "
            "the merged trace is written there at the end of the fit. Give a directory this process may create and "
            "write, or trace=None.") from err


def rank_trace(records: list, sent_at: list, rank: int, stage: int, replica: int, offset: float,
               global_rank: Any, layers: dict[str, float] | None = None) -> RankTrace:
    """This rank's recorded actions on rank 0's clock; ``global_rank`` turns a peer of the pipeline's group into a
    global rank; ``layers``: each layer's forward seconds per traced step, where they were timed."""
    rows = []
    for (action, start, end), sent in zip(records, sent_at):
        peer = global_rank(action.peer) if action.peer is not None else None
        rows.append([action.op.value, action.stage, action.microbatch, peer, action.step, start + offset,
                     end + offset, None if sent is None else sent + offset])
    return RankTrace(rank, stage, replica, offset, rows, dict(layers or {}))


def predicted_events(schedule: str, num_stages: int, chunks: int, virtual_stages: int, steps: int,
                     traces: list[RankTrace], plan: Any, per_step: float = 1.0) -> tuple[list[Any], str]:
    """The schedule simulator's timeline of ``steps`` training steps (flushed schedules: one after another), with
    the plan's stage times, or without a plan the measured mean forward and backward of each stage; and which.
    ``per_step``: how many of the plan's minibatches a flushed step holds (``minibatches_per_step``; a traced graph's
    plan is of one micro-batch: ``chunks``), so that its ``chunks`` micro-batches share ``per_step`` times the plan's
    figures."""
    from lightning_pipedream.schedule.builders import build_schedule
    from lightning_pipedream.schedule.simulate import simulate
    from lightning_pipedream.schedule.specs import spec_of
    from lightning_pipedream.schedule.timeline import TimedAction

    spec = spec_of(schedule)
    v = virtual_stages if spec.virtual_stages else 1
    n = num_stages * v
    per = max(1, chunks) if spec.microbatches else 1
    stages = getattr(plan, "stages", None)
    if stages is not None and len(stages) == n and all(s.compute_s > 0 for s in stages):
        scale = per_step if not spec.asynchronous and per_step > 0 else 1.0
        forward = [(s.forward_s or s.compute_s / 3) * scale / per for s in stages]
        backward = [s.compute_s * scale / per - f for s, f in zip(stages, forward)]
        source = "the plan's stage times"
    else:
        spans: dict[tuple[int, str], list[float]] = {}
        for t in traces:
            for row in t.events:
                if row[0] in ("F", "B", "W"):
                    spans.setdefault((row[1], row[0]), []).append(row[6] - row[5])
        mean = {k: sum(v) / len(v) for k, v in spans.items()}
        forward = [mean.get((s, "F"), 0.0) for s in range(n)]
        backward = [mean.get((s, "B"), 0.0) + mean.get((s, "W"), 0.0) for s in range(n)]
        source = "the measured mean forward and backward of each stage (no plan with stage times)"
    if spec.asynchronous:
        sim = simulate(build_schedule(schedule, num_stages, chunks, minibatches=max(1, steps)), forward, backward,
                       check=False)
        return sim.events, source
    sim = simulate(build_schedule(schedule, num_stages, chunks, virtual_stages=v), forward, backward, check=False)
    events = [TimedAction(e.rank, e.action, e.start + k * sim.makespan, e.end + k * sim.makespan)
              for k in range(max(1, steps)) for e in sim.events]
    return events, source
