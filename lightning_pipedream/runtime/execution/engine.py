"""One rank's pipeline across training steps: builds each step's actions and runs them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_pipedream.runtime.communication.transport import Transport
from lightning_pipedream.runtime.execution.accounts import StepAccounts, clock
from lightning_pipedream.runtime.execution.executor import Executor, InputFn, LossFn
from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.runtime.faults.flight import recorder
from lightning_pipedream.runtime.stages.sharding import ShardedStep
from lightning_pipedream.runtime.stages.stage import Stage
from lightning_pipedream.runtime.stages.weights import WeightVersions
from lightning_pipedream.schedule.actions import Action, Layout, Op
from lightning_pipedream.schedule.builders import (
    build_schedule,
    check_schedule_options,
    pipedream_drain,
    pipedream_step,
    rank_stages,
    replicated_pipedream_drain,
    replicated_pipedream_step,
    step_schedule,
    two_bw_drain,
    two_bw_step,
    v_virtual_stages,
)
from lightning_pipedream.schedule.specs import spec_of

# Applies the gradients now in the parameters' .grad; receives the minibatch they belong to (for
# ``pipedream`` the minibatch whose backward just ran, for flushed schedules the step's minibatch).
UpdateFn = Callable[[int], None]
# The gradient all-reduce among a replicated stage's replicas; ``average`` asks for the mean over
# the replicas that contributed (pipedream) rather than the sum (flushed schedules).
AllReduceFn = Callable[..., object]


@dataclass
class StepResult:
    """What one training step did on this rank."""

    losses: dict[int, Tensor] = field(default_factory=dict)  # micro-batch -> loss, on the last stage


class PipelineEngine:
    """Runs the schedule's actions for one stage, one training step at a time.

    ``gpipe``, ``1f1b``, ``zb-h1`` and ``interleaved`` run a whole flushed schedule per step.
    ``pipedream`` admits one minibatch per step and keeps the pipeline full across steps until
    :meth:`drain`; its stage keeps weight versions (stashing, and vertical sync if asked) in a
    :class:`WeightVersions`. ``2bw`` admits a minibatch of ``chunks`` micro-batches per step, runs
    them on the version before the stage's newest (two versions kept) and updates once per
    minibatch, also without a flush until :meth:`drain`.

    ``interleaved``: ``stage_index`` is this rank, ``num_stages`` the number of ranks, and ``module``
    a sequence of ``virtual_stages`` model chunks: chunk c is stage ``c * num_stages + stage_index``.
    ``zb-v``, ``dualpipev``: the same with two chunks, stages ``stage_index`` and ``2 * num_stages - 1 - stage_index``
    (a V: the loss is computed on rank 0).
    ``recompute=True`` keeps only each stage's inputs between forward and backward (see :class:`Stage`); one flag
    per model stage recomputes on those stages only.

    Replicated stages: ``replicas`` (one count per stage, see :class:`Layout`) and ``rank`` (this
    process's position in the layout) run the replicated schedules (1F1B-RR); ``allreduce`` (e.g.
    ``GradientReducer.reduce``) is called at every ALLREDUCE_GRAD with ``average=False`` for
    flushed schedules (the sum: scale each micro-batch's loss to its share of the step's union of
    shards) and ``average=True`` for ``pipedream`` (the mean of the round's minibatches). Micro-batch
    and minibatch numbers then count over all shards: number m comes from shard ``m % replicas[0]``;
    a flushed step has ``chunks * replicas[0]`` of them, a pipedream step admits ``replicas[0]``
    (step t: ``t * replicas[0] + shard``).
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        transport: Transport,
        *,
        schedule: str = "1f1b",
        chunks: int = 1,
        weight_stashing: bool = True,
        vertical_sync: bool = False,
        record: bool = False,
        replicas: Sequence[int] | None = None,
        rank: int | None = None,
        allreduce: AllReduceFn | None = None,
        recompute: bool | Sequence[bool] = False,
        virtual_stages: int = 1,
        sharded_step: ShardedStep | None = None,
    ) -> None:
        virtual_stages = v_virtual_stages(schedule, virtual_stages)  # a V schedule's default: its two chunks
        check_schedule_options(schedule, chunks, vertical_sync, virtual_stages=virtual_stages, recompute=recompute)
        layout = Layout.of(replicas, num_stages) if replicas is not None else None
        self.layout = layout if layout is not None and layout.is_replicated else None
        if self.layout is not None:
            if rank is None or self.layout.stage_of(rank) != stage_index:
                raise ValueError(
                    f"rank={rank!r} does not hold stage {stage_index} under replicas {list(self.layout.replicas)}; "
                    "give the process's rank in the layout (stage s's replicas are ranks sum(replicas[:s]) ...)."
                )
            if allreduce is None:
                raise ValueError("Replicated stages need allreduce= (e.g. ReplicaGroups(...).reducer(params).reduce).")
            if vertical_sync:
                raise ValueError("vertical_sync=True is not supported with replicated stages yet; use replicas=None.")
            if not spec_of(schedule).unequal_replicas:
                raise ValueError(
                    f"schedule={schedule!r} does not support replicated stages yet; use gpipe, 1f1b or pipedream."
                )
        self.rank = stage_index if rank is None else rank
        self.allreduce = allreduce
        # Sharded stages (runtime/stages/sharding.py): their reduce-scatters and all-gathers around a step's actions.
        self.sharded_step = sharded_step
        self.schedule = schedule
        self.spec = spec_of(schedule)
        self.num_stages = num_stages
        self.chunks = chunks
        self.virtual_stages = virtual_stages
        self.asynchronous = self.spec.asynchronous
        if self.spec.virtual_stages:
            chunk_modules = list(module) if isinstance(module, (list, tuple, nn.ModuleList)) else [module]
            if len(chunk_modules) != virtual_stages:
                raise ValueError(
                    f"schedule={schedule!r} with virtual_stages={virtual_stages} needs that many model chunks on "
                    f"each rank, got {len(chunk_modules)}; give a list of chunks, one per stage of "
                    f"{rank_stages(schedule, num_stages, stage_index, virtual_stages)}."
                )
        else:
            chunk_modules = [module]
        # The last stage of a straight pipeline runs each minibatch's forward and backward before the update that
        # follows them: it never needs a second version (WeightVersions says when it may run on its parameters).
        self.weights = (
            WeightVersions(module, stashing=weight_stashing, vertical_sync=vertical_sync,
                           two_versions=self.spec.two_weight_versions,
                           direct=self.layout is None and stage_index == num_stages - 1)
            if self.asynchronous
            else None
        )
        total = num_stages * virtual_stages
        flags = recompute_flags(recompute, total)
        indices = rank_stages(schedule, num_stages, stage_index, len(chunk_modules))
        self.stages = {
            i: Stage(m, i, total, self.weights, recompute=flags[i]) for i, m in zip(indices, chunk_modules)
        }
        self.stage = self.stages[stage_index]
        self.executor = Executor(self.stages, transport, record=record, rank=self.rank)
        self.transport = transport
        replicated = None if self.layout is None else self.layout.replicas
        self._flushed = (
            None
            if self.asynchronous
            else build_schedule(schedule, num_stages, chunks, replicas=replicated, virtual_stages=virtual_stages)
        )
        self._shorter: dict[int, Any] = {}  # flushed schedules of fewer micro-batches (a batch smaller than chunks)
        self._admitted = 0  # pipedream: minibatches admitted since the last drain
        self._steps = 0  # flushed schedules: training steps run so far
        self._train_steps = 0  # every schedule: training steps run so far (the flight recorder's step)
        self._base_version = 0  # pipedream: updates every stage had made at the last drain

    @property
    def in_flight(self) -> int:
        """Micro-batches (minibatches for pipedream) admitted but not yet fully back-propagated on this rank."""
        return sum(stage.in_flight() for stage in self.stages.values())

    @property
    def next_minibatch(self) -> int:
        """The number the next :meth:`train_step` gives its minibatch (what ``update`` will receive for it);
        with replicated stages under pipedream, that of the step's first shard."""
        shards = 1 if self.layout is None else self.layout.input_replicas
        return self._admitted * shards if self._flushed is None else self._steps

    @property
    def activation_bytes(self) -> int:
        """Peak bytes this rank's stages kept between forwards and backwards (set ``track_activations``)."""
        return sum(stage.peak_activation_bytes for stage in self.stages.values())

    def track_activations(self, on: bool = True) -> None:
        """Count the bytes each micro-batch keeps for its backward (see :class:`Stage`); a hook per saved tensor."""
        for stage in self.stages.values():
            stage.track_activations = on

    def step_actions(self, micro_batches: int | None = None, minibatches: int = 1) -> list[Action]:
        """This rank's actions for the next training step; ``micro_batches`` fewer than ``chunks``: a flushed step
        of that many (a batch with fewer samples than ``chunks``, such as an epoch's last). ``minibatches``
        (``pipedream`` on a straight pipeline): admit that many minibatches in one step, each with its own update;
        the actions are exactly those of as many one-minibatch steps, one after another."""
        if minibatches != 1:
            self._check_minibatches(minibatches)
            return [a for t in range(self._admitted, self._admitted + minibatches)
                    for a in pipedream_step(self.num_stages, self.stage.index, t)]
        if self._flushed is not None:
            schedule = self._flushed
            if micro_batches is not None and micro_batches != self.chunks:
                if micro_batches not in self._shorter:  # (dualpipev below 2 per rank: zb-v's order, same V)
                    name = step_schedule(self.schedule, self.num_stages, micro_batches)
                    self._shorter[micro_batches] = build_schedule(
                        name, self.num_stages, micro_batches, virtual_stages=self.virtual_stages,
                        replicas=None if self.layout is None else self.layout.replicas)
                schedule = self._shorter[micro_batches]
            return list(schedule.actions[self.rank if self.layout is not None else self.stage.index])
        if micro_batches is not None and micro_batches != self.chunks:
            raise ValueError(
                f"schedule={self.schedule!r} keeps the pipeline full across steps, each admitting chunks={self.chunks} "
                f"micro-batches, so a step of {micro_batches} (a batch with fewer samples) cannot run. Drop the "
                "smaller last batch (DataLoader(drop_last=True)), or use a synchronous schedule (1f1b, gpipe, "
                "zb-h1, interleaved)."
            )
        if self.spec.two_weight_versions:
            return two_bw_step(self.num_stages, self.stage.index, self.chunks, self._admitted)
        if self.layout is not None:
            return replicated_pipedream_step(self.layout, self.rank, self._admitted)
        return pipedream_step(self.num_stages, self.stage.index, self._admitted)

    def train_step(self, inputs: InputFn, loss: LossFn, update: UpdateFn,
                   micro_batches: int | None = None, minibatches: int = 1) -> StepResult:
        """Run one training step. ``inputs``/``loss`` receive the micro-batch number (for
        ``pipedream``: the minibatch number since the last drain; for
        ``2bw``: ``step * chunks + i`` for the step's i-th micro-batch, counted since the last drain).
        ``micro_batches``: this step's count when it has fewer than ``chunks`` (flushed schedules only).
        ``minibatches``: ``pipedream`` on a straight pipeline only: minibatches admitted in this step (numbers
        :attr:`next_minibatch` on), each with its own update, as that many one-minibatch steps would."""
        flight = recorder()
        flight.step, flight.unit = self._train_steps, "micro-batch" if self._flushed is not None else "minibatch"
        result = self._run(self.step_actions(micro_batches, minibatches), inputs, loss, update, self.next_minibatch)
        self._train_steps += 1
        if self._flushed is None:
            self._admitted += minibatches
        else:
            self._steps += 1
            self._wait_for_sends()
        return result

    def _check_minibatches(self, minibatches: int) -> None:
        if isinstance(minibatches, bool) or not isinstance(minibatches, int) or minibatches < 1:
            raise ValueError(f"minibatches must be an integer >= 1 (minibatches admitted in one step), "
                             f"got {minibatches!r}.")
        if not self.spec.several_minibatches_per_step or self.layout is not None:
            where = f"schedule={self.schedule!r}" if self.layout is None else "replicated stages (1F1B-RR)"
            raise ValueError(
                f"Several minibatches per step (minibatches={minibatches}) run under schedule='pipedream' on a "
                f"straight pipeline only, not with {where}: there a step is one update of chunks micro-batches "
                "(or the replicas' round). Give minibatches=1."
            )

    def drain(self, update: UpdateFn) -> StepResult:
        """Finish every minibatch in flight (pipedream), so that all weights are final."""
        if self._flushed is not None or self._admitted == 0:
            return StepResult()
        if self.spec.two_weight_versions:
            actions = two_bw_drain(self.num_stages, self.stage.index, self.chunks, self._admitted)
        elif self.layout is not None:
            actions = replicated_pipedream_drain(self.layout, self.rank, self._admitted)
        else:
            actions = pipedream_drain(self.num_stages, self.stage.index, self._admitted)
        result = self._run(actions, _no_inputs, _no_loss, update, self._admitted)
        self._wait_for_sends()
        self._admitted = 0
        assert self.weights is not None
        self.weights.clear()
        self._base_version = self.weights.num_updates
        return result

    def take_staleness(self) -> list[int]:
        """The weight staleness of each micro-batch whose gradients were collected since the last call (updates
        between its forward's weights and the live ones; none under the flushed schedules, which keep no versions)."""
        if self.weights is None:
            return []
        taken, self.weights.staleness = self.weights.staleness, []
        return taken

    @property
    def accounts(self) -> StepAccounts:
        """Where this rank's step time went (see :mod:`.accounts`)."""
        return self.executor.accounts

    def _wait_for_sends(self) -> None:
        start = clock()
        with pipeline_failures(self.stage.index, waiting="waiting for this step's sends to be received"):
            self.transport.wait_all()
        self.executor.accounts.transfer(clock() - start)  # the sends that were not hidden behind the step's work

    def version_for(self, minibatch: int) -> int:
        """Vertical sync: the version stage 0 used for ``minibatch`` (it has made ``t - stages + 1`` updates).
        2BW: the version before the newest when micro-batch ``minibatch``'s minibatch t starts, t - 1."""
        if self.spec.two_weight_versions:
            return self._base_version + max(0, minibatch // self.chunks - 1)
        return self._base_version + max(0, minibatch - self.num_stages + 1)

    def _run(
        self, actions: list[Action], inputs: InputFn, loss: LossFn, update: UpdateFn, step_minibatch: int
    ) -> StepResult:
        result = StepResult()
        weights = self.weights
        # Which minibatch each optimizer step applies: pipedream's follows that minibatch's backward,
        # 2bw's the backwards of a minibatch's micro-batches.
        per = self.chunks if self.spec.two_weight_versions else 1
        applies = iter([mb // per for mb in _minibatch_of_each_update(actions)] if self._flushed is None else [])
        # A rank with several stages (interleaved) has one OPTIMIZER_STEP per stage; its one optimizer
        # steps at the last of them, when every stage's gradients are in.
        steps_left = [sum(a.op is Op.OPTIMIZER_STEP for a in actions)]

        def optimizer_step(action: Action) -> None:
            if self._flushed is not None:
                steps_left[0] -= 1
                if steps_left[0] == 0:
                    update(step_minibatch)
                return
            minibatch = next(applies)
            if weights is not None:
                weights.before_update()
            update(minibatch)
            if weights is not None:
                # The next forward here admits minibatch step+1; vertical sync needs versions from its one on.
                keep = None if self.spec.two_weight_versions else self.version_for(action.step + 1)
                weights.after_update(keep_from=keep)

        def allreduce(action: Action) -> None:
            assert self.allreduce is not None
            self.allreduce(average=self._flushed is None)

        vertical = weights is not None and (weights.vertical_sync or weights.two_versions)
        before_backward = after_gradients = before_receive = None
        if self.sharded_step is not None:
            sharded = self.sharded_step
            # Each stage's last action of the step that adds weight gradients (a whole backward or a weight half).
            last = {a.stage: a for a in actions if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT)}
            for stage_index in self.stages:
                sharded.begin(stage_index)

            def before_backward(action: Action) -> None:
                sharded.before_backward(action.stage, last=last.get(action.stage) == action)

            def after_gradients(action: Action) -> None:
                sharded.after_gradients(action.stage, last=last.get(action.stage) == action)

            def before_receive(action: Action) -> None:
                sharded.prefetch(action.stage, forward=action.op is Op.RECV_ACT)

        with pipeline_failures(self.stage.index):
            result.losses = self.executor.run(
                actions,
                inputs=inputs,
                loss=loss,
                optimizer_step=optimizer_step,
                version=self.version_for if vertical else None,
                allreduce=allreduce if self.allreduce is not None else None,
                before_backward=before_backward,
                after_gradients=after_gradients,
                before_receive=before_receive,
            )
        if self.sharded_step is not None:
            self.sharded_step.end_step()
        return result


def _minibatch_of_each_update(actions: list[Action]) -> list[int]:
    """For each OPTIMIZER_STEP in ``actions``: the micro-batch of the last BACKWARD before it (a replica
    that only joins a final all-reduce round gets its own last backward's, -1 if none in ``actions``)."""
    out, last = [], -1
    for action in actions:
        if action.op is Op.BACKWARD:
            last = action.microbatch
        elif action.op is Op.OPTIMIZER_STEP:
            out.append(last)
    return out


def _no_inputs(mb: int) -> Any:
    raise RuntimeError(f"The drain ran a forward (micro-batch {mb}); the schedule is broken.")


def _no_loss(mb: int, output: Any) -> Tensor:
    raise RuntimeError(f"The drain computed a loss (micro-batch {mb}); the schedule is broken.")


__all__ = ["PipelineEngine", "StepResult", "Op"]


def recompute_flags(recompute: bool | Sequence[bool], stages: int) -> list[bool]:
    """One recompute flag per model stage, from one bool for all or a list with one per stage."""
    if isinstance(recompute, bool):
        return [recompute] * stages
    flags = list(recompute)
    if len(flags) != stages:
        raise ValueError(f"recompute lists {len(flags)} flags for {stages} model stages; give one per stage "
                         f"([True, False]: stage 0 only), or one bool for all.")
    return flags
