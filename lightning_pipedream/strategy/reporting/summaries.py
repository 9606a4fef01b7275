"""What the last stage tells every rank after a step: the loss, the step's extra outputs and its logged values."""

from __future__ import annotations

import pickle
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.strategy.reporting.consistency import RECORD_SLOTS, check_records


@dataclass(frozen=True)
class LoggedValue:
    """One ``self.log(name, value, **options)`` call, reduced over a step's micro-batches."""

    name: str
    value: float
    options: dict[str, Any]


@dataclass
class StepSummary:
    """The last stage's view of one step, which rank 0 needs for Lightning's loggers and callbacks."""

    loss: float
    extra: dict[str, Any] = field(default_factory=dict)  # training_step's outputs besides "loss"
    logs: list[LoggedValue] = field(default_factory=list)

    def layout(self) -> tuple:
        """Everything but the numbers: while it stays the same from step to step, only numbers travel."""
        return (self.extra, [(log.name, log.options) for log in self.logs])

    def numbers(self) -> list[float]:
        return [self.loss] + [log.value for log in self.logs]


class SummaryChannel:
    """Sends each step's :class:`StepSummary` from the last stage to every rank.

    A summary is usually the same names and options with new numbers; then it travels as one
    fixed-size float64 tensor (one broadcast). When its layout changes (or it carries extra
    outputs), it travels pickled once and its layout is remembered on every rank.
    """

    SLOTS = 64  # numbers per fast message: [fits?, count, loss, logged values...]

    def __init__(
        self,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        pipeline_group: dist.ProcessGroup | None = None,
        replica_group: dist.ProcessGroup | None = None,
        num_pipelines: int = 1,
        source: int | None = None,
        sources: list[int] | None = None,
    ) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = device
        self.pipeline_group = pipeline_group  # this rank's pipeline (ranks are its stages); None: the world
        self.replica_group = replica_group  # this rank's stage in every pipeline (data parallelism); None: none
        self.num_pipelines = num_pipelines
        self.source = num_stages - 1 if source is None else source  # the last stage, as a rank of the group
        # A replicated last stage (1F1B-RR): each replica has part of a step's summary; the first evaluates.
        self.sources = [self.source] if sources is None else list(sources)
        self._layout: tuple | None = None

    def exchange(self, summary: StepSummary | None, record: Tensor | None = None) -> StepSummary:
        """Call on every rank; ``summary`` is given on the last stage (None elsewhere). Returns it everywhere,
        its numbers averaged over the data-parallel pipelines (as DDP's ``sync_dist=True`` would).

        ``record``: this rank's fingerprint of the step's batch (:func:`~.consistency.batch_record`); the ranks'
        fingerprints travel with the summary (an all-gather in place of its broadcast) and every rank raises
        :class:`~.consistency.DataMismatchError` if they disagree."""
        if self.num_stages == 1:
            assert summary is not None
            return self._averaged(summary)
        if len(self.sources) > 1:  # each replica of the last stage holds a part: each sends its own
            if record is not None:
                self._check_alone(record)
            return combine([self.broadcast_object(summary, source) for source in self.sources])
        message = torch.zeros(self.SLOTS + (RECORD_SLOTS if record is not None else 0), dtype=torch.float64)
        if summary is not None:
            values = summary.numbers()
            fits = not summary.extra and len(values) <= self.SLOTS - 2 and summary.layout() == self._layout
            message[0], message[1] = (1.0 if fits else 0.0), len(values)
            if fits:
                message[2 : 2 + len(values)] = torch.tensor(values, dtype=torch.float64)
        on_device = message.to(self.device)
        if record is None:
            with pipeline_failures(self.stage_index, waiting="the step summary's broadcast from the last stage"):
                dist.broadcast(on_device, group=self.pipeline_group, group_src=self.source)
        else:
            on_device[self.SLOTS:] = record.to(self.device)
            rows = [torch.empty_like(on_device) for _ in range(dist.get_world_size(self.pipeline_group))]
            with pipeline_failures(self.stage_index, waiting="the step summary's exchange with the last stage"):
                dist.all_gather(rows, on_device, group=self.pipeline_group)
                check_records([row[self.SLOTS:] for row in rows])
            on_device = rows[self.source][: self.SLOTS]
        message = on_device.cpu()
        if message[0] == 0.0:  # something new: it travels whole, and every rank remembers its layout
            summary = self.broadcast_object(summary)
            self._layout = summary.layout()
            return self._averaged(summary)
        assert self._layout is not None
        extra, names = self._layout
        values = message[2 : 2 + int(message[1])].tolist()
        logs = [LoggedValue(name, value, options) for (name, options), value in zip(names, values[1:])]
        return self._averaged(StepSummary(values[0], dict(extra), logs))

    def _check_alone(self, record: Tensor) -> None:
        """The fingerprints' own all-gather, where the summary travels as several broadcasts."""
        rows = [torch.empty(RECORD_SLOTS, dtype=torch.float64, device=self.device)
                for _ in range(dist.get_world_size(self.pipeline_group))]
        with pipeline_failures(self.stage_index, waiting="the data check's all-gather"):
            dist.all_gather(rows, record.to(self.device), group=self.pipeline_group)
            check_records(rows)

    def _averaged(self, summary: StepSummary) -> StepSummary:
        if self.num_pipelines == 1:
            return summary
        numbers = torch.tensor(summary.numbers(), dtype=torch.float64, device=self.device)
        with pipeline_failures(self.stage_index, waiting="the step summary's all-reduce over the pipelines"):
            dist.all_reduce(numbers, group=self.replica_group)
        values = (numbers / self.num_pipelines).cpu().tolist()
        logs = [LoggedValue(log.name, value, log.options) for log, value in zip(summary.logs, values[1:])]
        return StepSummary(values[0], summary.extra, logs)

    def averaged_logs(self, logs: list[LoggedValue]) -> list[LoggedValue]:
        """Evaluation logs over the pipelines' shards: each name's value weighted by its batch size."""
        if self.num_pipelines == 1 or not logs:
            return logs
        weights = [float(log.options.get("batch_size", 1)) for log in logs]
        numbers = torch.tensor([v for log, w in zip(logs, weights) for v in (log.value * w, w)],
                               dtype=torch.float64, device=self.device)
        with pipeline_failures(self.stage_index, waiting="the evaluation logs' all-reduce over the pipelines"):
            dist.all_reduce(numbers, group=self.replica_group)
        sums = numbers.cpu().tolist()
        return [
            LoggedValue(log.name, sums[2 * i] / sums[2 * i + 1], {**log.options, "batch_size": int(sums[2 * i + 1])})
            for i, log in enumerate(logs)
        ]

    def broadcast_object(self, value: Any, source: int | None = None) -> Any:
        """A small picklable value from the pipeline's last stage (its first replica, or ``source``) to its other
        ranks (outputs of evaluation steps)."""
        if self.num_stages == 1:
            return value
        box = [value]
        with pipeline_failures(self.stage_index, waiting="a broadcast of evaluation outputs from the last stage"):
            dist.broadcast_object_list(box, group=self.pipeline_group,
                                       group_src=self.source if source is None else source, device=self.device)
        return box[0]


def combine(parts: list[StepSummary]) -> StepSummary:
    """One step's summary from the parts of a replicated last stage: the losses (each already its micro-batches'
    share of the batch's mean) add up; a logged value is the mean of the parts' weighted by their batch sizes."""
    if len(parts) == 1:
        return parts[0]
    sums: dict[str, list[Any]] = {}  # name -> [value x weight, weight, options], in order of first appearance
    for part in parts:
        for log in part.logs:
            weight = float(log.options.get("batch_size", 1))
            entry = sums.setdefault(log.name, [0.0, 0.0, log.options])
            entry[0] += log.value * weight
            entry[1] += weight
    logs = [LoggedValue(name, total / weight, {**options, "batch_size": int(weight)})
            for name, (total, weight, options) in sums.items() if weight > 0]
    extra = next((part.extra for part in reversed(parts) if part.extra), {})
    return StepSummary(sum(part.loss for part in parts), dict(extra), logs)


class LaggedFromSources:
    """:class:`LaggedSummaries` from each replica of a replicated last stage, combined step by step."""

    def __init__(self, channels: list[LaggedSummaries]) -> None:
        self.channels = channels
        # The data check's fingerprints go to the first source, from the ranks that are no source: a source sends
        # its own summaries to the others, which a fingerprint on the same link could be taken for.
        sources = {channel.source for channel in channels}
        channels[0].record_peers = [r for r in channels[0].receivers if r not in sources]
        self._sends_records = channels[0].is_source or not any(channel.is_source for channel in channels)

    def step(self, summary: StepSummary | None, record: Tensor | None = None) -> list[StepSummary]:
        record = record if self._sends_records else None
        taken = [channel.step(summary if channel.is_source else None, record if i == 0 else None)
                 for i, channel in enumerate(self.channels)]
        return [combine(list(parts)) for parts in zip(*taken)]

    def take_all(self) -> list[StepSummary]:
        taken = [channel.take_all() for channel in self.channels]
        return [combine(list(parts)) for parts in zip(*taken)]

    def forget(self) -> None:
        for channel in self.channels:
            channel.forget()


class LaggedSummaries:
    """``pipedream``: step summaries travel point to point, and every rank uses step t's at step t + lag.

    A broadcast from the last stage at every step would make every stage wait for the last one to
    finish the step, which re-synchronizes the asynchronous schedule each step (it cost most of the
    gap between the strategy and its engine). Here the last stage sends step t's summary to the
    pipeline's other ranks when its step ends and goes on; each rank (the last stage too, so that all
    ranks log the same values at the same step and callbacks decide alike) takes step t's summary at
    the end of step ``t + lag``, ``lag = stages - 1``. By then it has arrived without waiting: stage
    s's backward of minibatch t runs in step ``t + lag - s`` at the latest and needs the last stage's
    backward of t, which precedes its summary. :meth:`take_all` collects what is pending at a drain.

    The data check's fingerprints (``record``) travel the other way, from every rank to the last stage,
    which compares step t's at the end of step ``t + lag``: by then every stage has ended step t (the
    last stage's step ``t + lag`` needs stage s's forward of minibatch ``t + lag``, which comes after),
    so the last stage does not wait for them either. A mismatch stops the last stage, and every rank
    with it, with the words of :func:`~.consistency.mismatch_words`.

    The summaries travel on their own process group, so that they never interleave with the
    pipeline's activations (NCCL matches point-to-point messages by order, not by tag), and messages to a
    lower rank of it on ``reverse_group`` (same ranks), so that under NCCL a link's two directions (summaries
    one way, fingerprints the other) never share a stream, where each would wait behind the other. A receiver
    posts the receive of the next summary it expects as soon as it knows one will come (one at a
    time, so the order of the messages stays that of the calls): gloo holds a send until its
    receive is posted, and a receive posted only when the summary is needed cost rank 0 about
    2.5 ms per step, waiting for the last stage's busy process to answer.
    """

    def __init__(self, channel: SummaryChannel, group: dist.ProcessGroup, source: int, receivers: list[int],
                 lag: int, is_source: bool, reverse_group: dist.ProcessGroup | None = None) -> None:
        self.channel = channel
        self.group = group
        self.reverse_group = reverse_group
        self.source = source  # the last stage, a rank of ``group``
        self.receivers = receivers  # the other ranks of ``group``
        self.record_peers = list(receivers)  # the ranks whose fingerprints the last stage receives
        self.lag = lag
        self.is_source = is_source
        self._pending: deque[StepSummary | None] = deque()  # oldest first; None: still on its way here
        self._sends: deque[tuple[int, list[Any]]] = deque()  # (step, the sends' works) on the last stage
        self._steps = 0
        self._layout: tuple | None = None  # sender and receivers each follow the message order
        self._posted: tuple[Any, Tensor] | None = None  # the next summary's header, being received
        # The data check: on the last stage (step, its own fingerprint, [(receive, buffer) per other rank]); on the
        # others (step, the send, the fingerprint sent).
        self._records: deque[tuple[int, Tensor, list[tuple[Any, Tensor]]]] = deque()
        self._record_sends: deque[tuple[int, Any, Tensor]] = deque()

    def step(self, summary: StepSummary | None, record: Tensor | None = None) -> list[StepSummary]:
        """Call at the end of every training step (``summary`` given on the last stage; ``record``: this rank's
        fingerprint of the step's batch, on the steps that check the data). Returns the summaries to log now: the
        one from ``lag`` steps ago, or none while the pipeline fills."""
        if record is not None:
            self._exchange_record(record)
        if self.is_source:
            assert summary is not None
            self._send(summary)
            self._pending.append(summary)
        else:
            self._pending.append(None)
            self._post_next()
        self._steps += 1
        if self.is_source:
            self._check_records(self._steps - 1 - self.lag)
        out = []
        while len(self._pending) > self.lag:
            out.append(self._take_oldest())
        return out

    def take_all(self) -> list[StepSummary]:
        """Every pending summary, oldest first (at a drain: the last stage has sent them all)."""
        out = [self._take_oldest() for _ in range(len(self._pending))]
        while self._sends:
            self._wait(self._sends.popleft()[1])
        self._check_records(self._steps)
        while self._record_sends:
            self._wait([self._record_sends.popleft()[1:]])
        return out

    def forget(self) -> None:
        """After a failure: nothing pending will arrive or be logged."""
        self._pending.clear()
        self._sends.clear()
        self._posted = None
        self._records.clear()
        self._record_sends.clear()

    def _exchange_record(self, record: Tensor) -> None:
        record = record.to(self.channel.device)
        if self.is_source:
            receives = []
            with self._posting("the data check's fingerprints", self.record_peers):
                for peer in self.record_peers:
                    buffer = torch.empty(RECORD_SLOTS, dtype=torch.float64, device=self.channel.device)
                    receives.append((dist.irecv(buffer, group=self._group(peer, False), group_src=peer), buffer))
            self._records.append((self._steps, record, receives))
            return
        with self._posting("the data check's fingerprint", [self.source]):
            send = dist.isend(record, group=self._group(self.source, True), group_dst=self.source)
        self._record_sends.append((self._steps, send, record))
        while self._record_sends and self._record_sends[0][0] < self._steps - self.lag:  # received by now
            self._wait([self._record_sends.popleft()[1:]])

    def _check_records(self, last_step: float) -> None:
        """On the last stage: compare the fingerprints of the steps up to ``last_step`` (they have arrived)."""
        while self._records and self._records[0][0] <= last_step:
            _, own, receives = self._records.popleft()
            peers = tuple(dist.get_global_rank(self.group, r) for r in self.record_peers)
            with pipeline_failures(self.channel.stage_index, waiting="the data check's fingerprints from the other "
                                   "stages", peers=peers):
                for work, _ in receives:
                    work.wait()
                check_records([own] + [buffer for _, buffer in receives])

    def _take_oldest(self) -> StepSummary:
        summary = self._pending.popleft()
        if summary is None:
            summary = self._receive()
            self._post_next()
        return self.channel._averaged(summary)

    def _post_next(self) -> None:
        """Post the receive of the oldest summary still on its way, unless one is posted already."""
        if self._posted is None and None in self._pending:
            header = torch.zeros(SummaryChannel.SLOTS, dtype=torch.float64, device=self.channel.device)
            with self._posting("a step summary", [self.source]):
                self._posted = (dist.irecv(header, group=self._group(self.source, False), group_src=self.source),
                                header)

    def _posting(self, what: str, peers: list[int]) -> Any:
        """Around posting a send or receive: gloo raises at once when the peer's connection has closed (the peer
        failed), which must reach the user as that peer's error, as a failed wait does."""
        ranks = tuple(dist.get_global_rank(self.group, r) for r in peers)
        return pipeline_failures(self.channel.stage_index, waiting=f"posting {what} (to or from rank {list(ranks)})",
                                 peers=ranks)

    def _send(self, summary: StepSummary) -> None:
        values = summary.numbers()
        fits = not summary.extra and len(values) <= SummaryChannel.SLOTS - 3 and summary.layout() == self._layout
        header = torch.zeros(SummaryChannel.SLOTS, dtype=torch.float64)
        payload = None
        if fits:
            header[0], header[1] = 1.0, len(values)
            header[3 : 3 + len(values)] = torch.tensor(values, dtype=torch.float64)
        else:
            payload = torch.frombuffer(bytearray(pickle.dumps(summary)), dtype=torch.uint8)
            header[2] = payload.numel()
            self._layout = summary.layout()
        works = []
        with self._posting("a step summary", self.receivers):
            for tensor in [header] + ([payload] if payload is not None else []):
                on_device = tensor.to(self.channel.device)
                for peer in self.receivers:
                    works.append((dist.isend(on_device, group=self._group(peer, True), group_dst=peer), on_device))
        self._sends.append((self._steps, works))
        # Sends older than lag + 1 steps were received (their receivers finished the step that takes them).
        while self._sends and self._sends[0][0] < self._steps - self.lag:
            self._wait(self._sends.popleft()[1])

    def _group(self, peer: int, sending: bool) -> dist.ProcessGroup:
        """The group of a message to (``sending``) or from ``peer`` (a rank of ``group``): see the class's text."""
        if self.reverse_group is None:
            return self.group
        me = dist.get_rank(self.group)
        return self.group if (me < peer if sending else peer < me) else self.reverse_group

    def _wait(self, works: list[Any]) -> None:
        with pipeline_failures(self.channel.stage_index, waiting="a step summary's delivery to the other stages"):
            for work, _ in works:
                work.wait()

    def _receive(self) -> StepSummary:
        device = self.channel.device
        assert self._posted is not None  # posted when the step that sends it began here
        work, header = self._posted
        self._posted = None
        source = (dist.get_global_rank(self.group, self.source),)
        with pipeline_failures(self.channel.stage_index, waiting="a step summary from the last stage", peers=source):
            work.wait()
            header = header.cpu()
            if header[0] == 0.0:  # something new: it travels pickled, and its layout is remembered
                payload = torch.empty(int(header[2]), dtype=torch.uint8, device=device)
                dist.recv(payload, group=self._group(self.source, False), group_src=self.source)
                summary = pickle.loads(payload.cpu().numpy().tobytes())
                self._layout = summary.layout()
                return summary
        assert self._layout is not None
        extra, names = self._layout
        values = header[3 : 3 + int(header[1])].tolist()
        logs = [LoggedValue(name, value, options) for (name, options), value in zip(names, values[1:])]
        return StepSummary(values[0], dict(extra), logs)
