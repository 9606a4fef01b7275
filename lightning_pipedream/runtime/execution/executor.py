"""Runs one rank's list of actions with its stage and transport, and records what it did."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pipedream.runtime.communication.microbatch import flatten, unflatten
from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution.accounts import StepAccounts, device_events
from lightning_pipedream.runtime.faults.flight import recorder
from lightning_pipedream.runtime.stages.stage import Stage
from lightning_pipedream.schedule.actions import Action, Op

InputFn = Callable[[int], Any]  # micro-batch -> the first stage's input
LossFn = Callable[[int, Any], Tensor]  # micro-batch, last stage's output -> loss to back-propagate
StepFn = Callable[[Action], None]  # called at OPTIMIZER_STEP
VersionFn = Callable[[int], "int | None"]  # micro-batch -> weight version its forward must use


class Executor:
    """Executes actions in order: receives block, sends don't, compute runs on the stage.

    With ``record=True`` every action is appended to :attr:`records` as ``(action, start, end)``
    (``perf_counter`` seconds); a blocking receive's time is the time spent waiting for the peer.
    Whatever ``record`` says, the process's flight recorder (:mod:`~lightning_pipedream.runtime.faults.flight`)
    keeps the last few hundred actions and the one in progress, for the words and the file of a failure, and
    :attr:`accounts` adds each action's time to its part of the step (compute, waiting, transfer, update); on a CUDA
    transport's device each compute action is also timed on the device (a pair of CUDA events, read later). Under
    an active torch profiler (``Trainer(profiler="pytorch")``) each action is a ``record_function`` range named
    ``pipeline/<action>`` (e.g. ``pipeline/F3``, ``pipeline/RA3@0``).

    ``stage`` is this rank's stage, or (interleaved schedules) a mapping from stage index to each of
    the rank's model chunks; ``rank`` is this rank's number, so that a message between two chunks on
    the same rank stays in memory. A BACKWARD followed in the list by a BACKWARD_WEIGHT of the same
    micro-batch runs only the input-gradient half (zero bubble).
    """

    # Post each receive ahead (see Transport.post_recv). Measured on 2 CPU ranks over gloo (the
    # benchmark of docs/benchmarks.md): gpipe +4%, 1f1b +3%, pipedream +-0%. False restores
    # receive-when-reached, e.g. to compare.
    post_receives = True

    def __init__(
        self, stage: Stage | Mapping[int, Stage], transport: Transport, record: bool = False, rank: int | None = None
    ) -> None:
        self.stages: dict[int, Stage] = dict(stage) if isinstance(stage, Mapping) else {stage.index: stage}
        self.stage = next(iter(self.stages.values()))  # the rank's first (usually only) stage
        self.transport = transport
        self.record = record
        self.rank = rank
        self.records: list[tuple[Action, float, float]] = []
        self.accounts = StepAccounts(device_events(getattr(transport, "device", None)))
        # For the merged trace: each received message's send start, beside the receive in records (this rank's clock).
        self.sent_at: list[float | None] = []
        # Keyed by (stage, micro-batch): several stages may live here (interleaved).
        self._inputs: dict[tuple[int, int], Any] = {}
        self._grads: dict[tuple[int, int], Any] = {}
        self._outputs: dict[tuple[int, int], Any] = {}
        self._input_grads: dict[tuple[int, int], list] = {}
        self._local: deque[Any] = deque()  # messages from one of this rank's stages to another

    def run(
        self,
        actions: Sequence[Action],
        *,
        inputs: InputFn,
        loss: LossFn,
        optimizer_step: StepFn,
        version: VersionFn | None = None,
        train: bool = True,
        allreduce: StepFn | None = None,
        before_backward: StepFn | None = None,
        after_gradients: StepFn | None = None,
        before_receive: StepFn | None = None,
    ) -> dict[int, Any]:
        """Run ``actions``; returns the losses (detached) of the micro-batches whose forward ended here.

        ``allreduce`` runs at ALLREDUCE_GRAD (replicated stages): the gradient all-reduce among the
        stage's replicas. ``before_backward`` runs before each BACKWARD and ``after_gradients`` after each BACKWARD and
        BACKWARD_WEIGHT (sharded stages: when their gradients are reduce-scattered); ``before_receive`` before each
        receive from another rank blocks (sharded stages: start an all-gather while waiting).

        With ``train=False`` forwards run without autograd and keep nothing, and the values
        ``loss`` returns on the last stage (any step output) are returned as they are.
        """
        losses: dict[int, Tensor] = {}
        transport = self.transport
        local = self.rank
        split = {(a.stage, a.microbatch) for a in actions if a.op is Op.BACKWARD_WEIGHT}
        # Every receive is posted ahead, one per peer at a time: the first from each peer now, the
        # next one as soon as the previous one from that peer has arrived. Only receives of these
        # actions are posted, so none is left waiting when the list is done.
        first, post_next = _receive_chains(actions)
        if not self.post_receives:
            first, post_next = {}, [None] * len(actions)
        for peer, a in first.items():
            if peer != local:
                transport.post_recv(peer, channel_of(a))
        flight = recorder()
        accounts = self.accounts
        labelled = torch._C._autograd._profiler_enabled()  # one look per run: a profiler records now
        timed = accounts.timing and accounts.active  # CUDA, in a training step: compute is timed on the device too
        mark = None
        for i, action in enumerate(actions):
            op, mb = action.op, action.microbatch
            key = (action.stage, mb)
            stage = self.stages[action.stage]
            remote = action.peer is not None and action.peer != local
            flight.begin(action, transport.global_rank(action.peer) if op.is_recv and remote else None)
            label = torch.profiler.record_function(f"pipeline/{action}") if labelled else None
            if label is not None:
                label.__enter__()
            start = time.perf_counter()
            if timed and (op is Op.FORWARD or op is Op.BACKWARD or op is Op.BACKWARD_WEIGHT):
                mark = accounts.device_begin()
            if op is Op.RECV_ACT or op is Op.RECV_GRAD:
                if remote:
                    if before_receive is not None:
                        before_receive(action)
                    value = transport.recv(action.peer, channel_of(action))
                    following = post_next[i]
                    if following is not None:
                        transport.post_recv(action.peer, channel_of(following))
                else:
                    value = self._local.popleft()
                (self._inputs if op is Op.RECV_ACT else self._grads)[key] = value
            elif op is Op.FORWARD:
                x = inputs(mb) if stage.is_first else self._inputs.pop(key)
                if not train:
                    out = stage.infer(x)
                    if stage.is_last:
                        losses[mb] = loss(mb, out)
                elif stage.is_last:
                    out = stage.forward(mb, x, None if version is None else version(mb))
                    value = loss(mb, out)
                    stage.keep_loss(mb, value)
                    losses[mb] = value.detach()
                else:
                    out = stage.forward(mb, x, None if version is None else version(mb))
                if not stage.is_last:
                    self._outputs[key] = out
            elif op is Op.SEND_ACT:
                self._send(self._outputs.pop(key), action, f"output of stage {stage.index}")
            elif op is Op.BACKWARD:
                output_grads = self._grads.pop(key, None)
                if before_backward is not None:
                    before_backward(action)
                if key in split:
                    grads = stage.backward_input(mb, output_grads)
                else:
                    grads = stage.backward(mb, output_grads)
                if not stage.is_first:
                    self._input_grads[key] = grads
                del grads
                if after_gradients is not None:
                    after_gradients(action)
            elif op is Op.BACKWARD_WEIGHT:
                stage.backward_weight(mb)
                if after_gradients is not None:
                    after_gradients(action)
            elif op is Op.SEND_GRAD:
                self._send(self._input_grads.pop(key), action, "input gradients")
            elif op is Op.OPTIMIZER_STEP:
                optimizer_step(action)
            elif op is Op.ALLREDUCE_GRAD:
                if allreduce is None:
                    raise RuntimeError(
                        f"The schedule all-reduces stage {action.stage}'s gradients but the executor got no "
                        "allreduce function; build the engine with the replicas' ReplicaGroups."
                    )
                allreduce(action)
            if mark is not None:
                accounts.device_end(mark)
                mark = None
            end = time.perf_counter()
            if label is not None:
                label.__exit__(None, None, None)
            flight.end(action, start, end)
            # (a transport of one's own without send stamps: every receive counts as transfer)
            sent_at = getattr(transport, "last_sent_at", None) if remote and op.is_recv else None
            accounts.action(op, start, end, sent_at)
            if self.record:
                self.records.append((action, start, end))
                self.sent_at.append(sent_at)
        return losses

    def _send(self, tree: Any, action: Action, where: str) -> None:
        if action.peer == self.rank:
            # The other stage lives here too: no copy and no message, but a graph of its own (detached
            # leaves, as a received tree), so each stage's backward stops at its inputs.
            leaves, spec = flatten(tree, where)
            self._local.append(unflatten([t.detach().requires_grad_(t.requires_grad) for t in leaves], spec))
        else:
            self.transport.send(tree, action.peer, where, channel_of(action))

    def events(self, rank: int, origin: float = 0.0) -> list:
        """The :attr:`records` as ``TimedAction`` events (seconds from ``origin``)."""
        from lightning_pipedream.schedule.timeline import TimedAction

        return [TimedAction(rank, a, s - origin, e - origin) for a, s, e in self.records]


def channel_of(action: Action) -> tuple[str, int]:
    """The transport channel of a send or receive: the model edge it crosses, named by what it
    carries and the stage it goes into. Each edge keeps its own message layout, so a link that
    carries two edges (interleaved chunks) does not re-describe its trees at every switch."""
    op = action.op
    if op is Op.SEND_ACT:
        return ("act", action.stage + 1)
    if op is Op.SEND_GRAD:
        return ("grad", action.stage - 1)
    return ("act" if op is Op.RECV_ACT else "grad", action.stage)


def _receive_chains(actions: Sequence[Action]) -> tuple[dict[int | None, Action], list[Action | None]]:
    """Each peer's first receive in ``actions``, and for each receive the next one from the same peer
    (None if none). (A receive from this rank itself is never posted: the caller skips it.)"""
    later: dict[int | None, Action] = {}
    out: list[Action | None] = [None] * len(actions)
    for i in range(len(actions) - 1, -1, -1):
        a = actions[i]
        if a.op.is_recv:
            out[i] = later.get(a.peer)
            later[a.peer] = a
    return later, out
