"""PipeDreamStrategy: the Lightning strategy that trains a LightningModule's nn.Sequential as a pipeline."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_pipedream.lightning_adapter import (
    Elsewhere,
    LogRecorder,
    OptimizerLayout,
    Replay,
    capture_layers_input,
    find_layers,
    loss_of,
    swap_layers,
)
from lightning_pipedream.plan.balance import check_balance, check_stage_count, even_balance, stage_slice
from lightning_pipedream.runtime.engine import PipelineEngine
from lightning_pipedream.runtime.failures import pipeline_failures
from lightning_pipedream.runtime.microbatch import batch_size, flatten, merge, split
from lightning_pipedream.runtime.transport import Transport
from lightning_pipedream.schedule.builders import SCHEDULES, check_schedule_options, inference

_DEFAULT_TIMEOUT = timedelta(minutes=30)
_SUMMARY_SLOTS = 64
_CPU = torch.device("cpu")  # numbers a training step's loss and logs may use before they travel pickled


class PipeDreamStrategy(DDPStrategy):
    """Train a LightningModule as a pipeline: one stage of its ``nn.Sequential`` per process.

    Args:
        schedule: ``"pipedream"`` (asynchronous 1F1B with weight stashing, each batch one
            minibatch), ``"1f1b"`` (one-forward-one-backward with a flush) or ``"gpipe"``.
        chunks: micro-batches per batch for ``1f1b``/``gpipe`` (``pipedream`` takes 1).
        balance: layers per stage, e.g. ``[3, 2]``; by default the model is profiled on a
            training batch and partitioned with PipeDream's optimizer.
        plan: path of a ``plan.json`` (``python -m lightning_pipedream plan --json``); skips profiling.
        layers: the name of the module's ``nn.Sequential`` attribute, when it has several.
        weight_stashing: ``pipedream`` only; ``False`` is the paper's ablation.
        vertical_sync: ``pipedream`` only; every stage uses the weight version stage 0 used.
        bandwidth: bytes/s between stages, for the partitioner's cost model.
        trace: a directory; each rank writes a Chrome/Perfetto trace of its actions there at the end.
    """

    strategy_name = "pipedream"

    def __init__(
        self,
        schedule: str = "pipedream",
        chunks: int = 1,
        balance: list[int] | None = None,
        plan: str | os.PathLike | None = None,
        layers: str | None = None,
        weight_stashing: bool = True,
        vertical_sync: bool = False,
        bandwidth: float = 1e9,
        trace: str | os.PathLike | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        check_schedule_options(schedule, chunks, vertical_sync)
        if start_method != "popen":
            # spawn/fork launchers copy only rank 0's weights back to the main process: wrong for a pipeline.
            raise ValueError(
                f"PipeDreamStrategy(start_method={start_method!r}) is not supported: those launchers return only "
                "rank 0's weights, which hold one stage. Use the default start_method='popen' (or torchrun)."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",
        )
        self.schedule = schedule
        self.chunks = chunks
        self._balance_arg = list(balance) if balance is not None else None
        self._plan_path = plan
        self._layers_arg = layers
        self.weight_stashing = weight_stashing
        self.vertical_sync = vertical_sync
        self.bandwidth = bandwidth
        self._trace_dir = trace
        self.plan: Any = None  # the Plan used (from plan.json or the partitioner), if any
        self.balance: list[int] | None = None
        self._layers_name = ""
        self._engine: PipelineEngine | None = None
        self._transport: Transport | None = None
        self._optimizer_layouts: list[OptimizerLayout] = []
        self._grads_aside: list[tuple[nn.Parameter, Tensor | None]] = []
        self._local_names: dict[int, str] = {}
        self._full_keys: list[str] = []
        self._module_set_up: Any = None
        self._summary_schema: Any = None

    # ----------------------------------------------------------------------------------- ranks
    @property
    def num_stages(self) -> int:
        return self.world_size

    @property
    def stage_index(self) -> int:
        return self.global_rank

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage must see the same batches: the data-parallel degree is 1, not the world size.
        return {"num_replicas": 1, "rank": 0}

    # ----------------------------------------------------------------------------------- setup
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self._engine is None or module is not self._module_set_up:
            self._layers_name, layers = find_layers(module, self._layers_arg)
            self._full_keys = list(module.state_dict())
            self.balance = self._decide_balance(trainer, module, layers)
            # The full model's optimizer layout maps checkpoints (single-device form) to this rank's stage.
            self._optimizer_layouts = OptimizerLayout.of_module(module, _init_optimizers_and_lr_schedulers)
            self._keep_own_stage(module, layers)
            self._module_set_up = module
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self._build_engine()
        else:  # a later fit/validate/test/predict with the same model: keep its stages
            self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    def _decide_balance(self, trainer: Trainer, module: LightningModule, layers: nn.Sequential) -> list[int]:
        if self._plan_path is not None:
            from lightning_pipedream.plan.partition import Plan

            self.plan = Plan.load(self._plan_path)
            if len(self.plan.stages) != self.num_stages:
                raise ValueError(
                    f"The plan {self._plan_path} has {len(self.plan.stages)} stages but the Trainer runs "
                    f"{self.num_stages} processes. Make a plan for {self.num_stages} workers, or set "
                    f"devices/num_nodes to give {len(self.plan.stages)} processes."
                )
            names = list(layers._modules)
            planned = [name for stage in self.plan.stages for name in stage.layers]
            if planned != names:
                raise ValueError(
                    f"The plan {self._plan_path} lists layers {planned[:6]}... but the model's "
                    f"{self._layers_name} has {names[:6]}...; profile this model to make its plan."
                )
            return check_balance(self.plan.balance, len(layers), self.num_stages)
        if self._balance_arg is not None:
            return check_balance(self._balance_arg, len(layers), self.num_stages)
        check_stage_count(len(layers), self.num_stages)
        if self.num_stages == 1:
            return [len(layers)]
        if trainer.state.fn != TrainerFn.FITTING:
            return even_balance(len(layers), self.num_stages)
        payload = [None]
        if self.is_global_zero:
            payload = [self._profile_and_partition(trainer, module, layers)]
        dist.broadcast_object_list(payload, src=0)
        plan_json, balance = payload[0]  # type: ignore[misc]
        if plan_json is not None:
            from lightning_pipedream.plan.partition import Plan

            self.plan = Plan.from_json(plan_json)
        return check_balance(balance, len(layers), self.num_stages)

    def _profile_and_partition(self, trainer: Trainer, module: LightningModule, layers: nn.Sequential) -> Any:
        """Rank 0: profile the layers on one training batch, partition with PipeDream's optimizer."""
        from lightning_pipedream.plan.partition import partition
        from lightning_pipedream.plan.profile import profile_module
        from lightning_pipedream.plan.topology import Topology

        batch = _first_training_batch(trainer)
        if batch is None:
            return None, even_balance(len(layers), self.num_stages)
        batch = self.batch_to_device(batch)
        sample = capture_layers_input(module, self._layers_name, "training_step", batch, 0)
        profile = profile_module(layers, sample)
        plan = partition(profile, Topology.flat(self.num_stages, self.bandwidth), "pipedream", straight=True)
        if len(plan.stages) != self.num_stages:
            # The optimizer may leave workers idle when that is faster; a pipeline here uses them all.
            plan = partition(profile, Topology.flat(self.num_stages, self.bandwidth), "time")
        plan.schedule, plan.chunks = self.schedule, self.chunks
        rank_zero_info(f"PipeDreamStrategy plan ({self.num_stages} stages, schedule={self.schedule}):\n{plan.describe()}")
        return plan.to_json(), plan.balance

    def _keep_own_stage(self, module: LightningModule, layers: nn.Sequential) -> None:
        """Replace the other stages' layers by placeholders so this rank holds only its own."""
        assert self.balance is not None
        own = stage_slice(layers, self.balance, self.stage_index)
        stage_of = [s for s, count in enumerate(self.balance) for _ in range(count)]
        for i, name in enumerate(list(layers._modules)):
            if name not in own._modules:
                layers._modules[name] = Elsewhere(name, stage_of[i])
        self._stage_module = own
        prefix = f"{self._layers_name}."
        self._local_names = {id(p): prefix + n for n, p in own.named_parameters()}

    def _build_engine(self) -> None:
        group = dist.new_group(backend=self._process_group_backend) if self.num_stages > 1 else None
        self._transport = Transport(group=group, device=self.root_device)
        self._engine = PipelineEngine(
            self._stage_module,
            self.stage_index,
            self.num_stages,
            self._transport,
            schedule=self.schedule,
            chunks=self.chunks,
            weight_stashing=self.weight_stashing,
            vertical_sync=self.vertical_sync,
            trace=self._trace_dir is not None,
        )

    def configure_ddp(self) -> None:  # no DistributedDataParallel wrapper: stages don't share weights
        pass

    # ---------------------------------------------------------------------------- training step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._engine is not None
        module = self.lightning_module
        batch, batch_idx = _batch_args(args, kwargs)
        if batch_idx == 0:
            self._check_same_batch(batch)
        parts = split(batch, self.chunks) if self.chunks > 1 else [batch]
        sizes = [batch_size(p) for p in parts]
        total = sum(sizes)
        recorder = LogRecorder()
        outputs: dict[int, Any] = {}
        flushed = self.schedule != "pipedream"

        def part(mb: int) -> Any:
            return parts[mb if flushed else 0]

        def inputs(mb: int) -> Any:
            return capture_layers_input(module, self._layers_name, "training_step", part(mb), batch_idx)

        def loss(mb: int, output: Any) -> Tensor:
            i = mb if flushed else 0
            with swap_layers(module, self._layers_name, Replay(output)), recorder.capture(module, sizes[i]):
                step_output = module.training_step(part(mb), batch_idx)
            value = loss_of(step_output)
            outputs[mb] = step_output
            return value * (sizes[i] / total) if len(parts) > 1 else value

        params = [p for p in self._stage_module.parameters() if p.requires_grad]
        earlier = [p.grad for p in params]  # accumulated by earlier batches; Lightning decides their fate
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            result = self._engine.train_step(inputs, loss, update=_nothing)
        # Lightning zeroes gradients between training_step and backward: keep the pipeline's aside.
        self._grads_aside = [(p, p.grad) for p in params]
        for p, g in zip(params, earlier):
            p.grad = g

        payload = None
        if self.is_last_stage:
            last_output = outputs[max(outputs)]
            extra = {k: _to_device(v, _CPU) for k, v in last_output.items() if k != "loss"} if isinstance(last_output, Mapping) else {}
            payload = (float(sum(result.losses.values())), extra, recorder.aggregate())
        loss_value, extra, logs = self._step_summary_from_last_stage(payload)
        LogRecorder.replay(module, logs)
        loss_tensor = torch.tensor(loss_value, device=self.root_device, requires_grad=True)
        return {"loss": loss_tensor, **extra} if extra else loss_tensor

    def _check_same_batch(self, batch: Any) -> None:
        """At each epoch's first batch, make sure every stage got the same one (a cheap fingerprint)."""
        if self.num_stages == 1:
            return
        leaves, _ = flatten(batch, "batch")
        mine = torch.tensor([float(t.double().sum()) if t.is_floating_point() or not t.is_complex() else 0.0
                             for t in leaves[:4]] + [float(batch_size(batch))], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(self.num_stages)]
        dist.all_gather(everyone, mine.to(self.root_device) if self.root_device.type != "cpu" else mine)
        if any(not torch.equal(everyone[0].cpu(), other.cpu()) for other in everyone[1:]):
            raise RuntimeError(
                "The pipeline stages received different training batches: every rank must iterate the same data "
                "in the same order (stage 0 reads the inputs, the last stage the targets). Keep Lightning's default "
                "sampler, or with use_distributed_sampler=False seed every rank's shuffling identically."
            )

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The pipeline already back-propagated in ``training_step``: put its gradients in place."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        scale = 1.0 / max(1, self.lightning_module.trainer.accumulate_grad_batches)
        for p, g in self._grads_aside:
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        self._grads_aside = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.schedule == "pipedream" and self._at_end_of_training_data():
            self.drain()
        return output

    def _at_end_of_training_data(self) -> bool:
        trainer = self.lightning_module.trainer
        loop = trainer.fit_loop.epoch_loop
        last_batch = loop.batch_progress.is_last_batch or loop.batch_progress.current.ready >= trainer.num_training_batches
        last_step = trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps
        return bool(last_batch or last_step)

    def drain(self) -> None:
        """Finish every minibatch in flight (``pipedream``): afterwards all stages hold final weights."""
        if self._engine is None or self._engine.schedule != "pipedream":
            return
        # Every rank must take part; ranks agree because they run the same steps.
        self._engine.drain(self._update_now)

    def _update_now(self) -> None:
        """An optimizer step outside Lightning's loop (the drain's updates)."""
        trainer = self.lightning_module.trainer
        for optimizer in self.optimizers:
            if trainer.gradient_clip_val:
                self._clip_grad_by_global_norm(optimizer, trainer.gradient_clip_val)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def _clip_grad_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the norm over the whole model: every stage's gradients, summed across ranks.

        Under ``pipedream`` the stages hold gradients of different minibatches at any moment (and
        the drain updates stages a different number of times), so there each stage clips by its own
        norm, as PipeDream's runtime did.
        """
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        square = torch.zeros(1, device=self.root_device, dtype=torch.float32)
        for g in grads:
            square += g.detach().float().pow(2).sum()
        if self.num_stages > 1 and self.schedule != "pipedream":
            dist.all_reduce(square)
        norm = square.sqrt()
        factor = torch.clamp(clip_val / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(factor.to(g.dtype))

    # ------------------------------------------------------------------------------ evaluation
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._evaluate("validation_step", args, kwargs, send_output=False)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._evaluate("test_step", args, kwargs, send_output=False)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._evaluate("predict_step", args, kwargs, send_output=True)

    def _evaluate(self, hook: str, args: tuple, kwargs: dict, send_output: bool) -> Any:
        assert self._engine is not None
        module = self.lightning_module
        batch, batch_idx = _batch_args(args, kwargs)
        extra_args = args[2:]
        step = getattr(module, hook)
        parts = split(batch, self.chunks) if self.chunks > 1 else [batch]
        sizes = [batch_size(p) for p in parts]
        recorder = LogRecorder()

        def inputs(mb: int) -> Any:
            return capture_layers_input(module, self._layers_name, hook, parts[mb], batch_idx, *extra_args, **kwargs)

        def output_of(mb: int, output: Any) -> Any:
            with swap_layers(module, self._layers_name, Replay(output)), recorder.capture(module, sizes[mb]):
                return step(parts[mb], batch_idx, *extra_args, **kwargs)

        actions = inference(self.num_stages, len(parts)).actions[self.stage_index]
        outputs = self._engine.executor.run(
            actions, inputs=inputs, loss=output_of, optimizer_step=lambda a: None, train=False
        )
        # No wait_all() here: under pipedream a training gradient may still be on its way to a stage
        # that only receives it in the next training step; waiting for it now would deadlock.
        payload = None
        if self.is_last_stage:
            merged = None
            if send_output:
                values = [outputs[mb] for mb in sorted(outputs)]
                merged = values[0] if len(values) == 1 else _merge_outputs(values)
                merged = _to_device(merged, _CPU)
            payload = (merged, recorder.aggregate())
        merged, logs = self._from_last_stage(payload)
        LogRecorder.replay(module, logs)
        if send_output:
            return _to_device(merged, self.root_device)
        return None

    def _step_summary_from_last_stage(self, payload: Any) -> Any:
        """Broadcast (loss, extra outputs, logs) from the last stage, in one small tensor when it can.

        The names and options of what is logged rarely change between steps: while they don't,
        only the numbers travel (one broadcast of a fixed-size tensor instead of pickled objects).
        """
        if self.num_stages == 1:
            return payload
        numbers = torch.zeros(_SUMMARY_SLOTS, dtype=torch.float64)
        if payload is not None:
            loss_value, extra, logs = payload
            schema = (extra, [(name, options) for name, _, options in logs])
            values = [loss_value] + [value for _, value, _ in logs]
            fits = not extra and len(values) <= _SUMMARY_SLOTS - 2 and schema == self._summary_schema
            numbers[0], numbers[1] = (1.0 if fits else 0.0), len(values)
            if fits:
                numbers[2 : 2 + len(values)] = torch.tensor(values, dtype=torch.float64)
        device_numbers = numbers.to(self.root_device)
        with pipeline_failures(self.stage_index):
            dist.broadcast(device_numbers, src=self.num_stages - 1)
        numbers = device_numbers.cpu()
        if numbers[0] == 0.0:  # something new: send it whole, and remember its shape
            payload = self._from_last_stage(payload)
            _, extra, logs = payload
            self._summary_schema = (extra, [(name, options) for name, _, options in logs])
            return payload
        extra, shape = self._summary_schema
        values = numbers[2 : 2 + int(numbers[1])].tolist()
        return values[0], {}, [(name, value, options) for (name, options), value in zip(shape, values[1:])]

    def _from_last_stage(self, payload: Any) -> Any:
        """Broadcast a small Python object from the last stage to every rank (loss, logs, outputs)."""
        if self.num_stages == 1:
            return payload
        box = [payload]
        with pipeline_failures(self.stage_index):
            dist.broadcast_object_list(box, src=self.num_stages - 1)
        return box[0]

    # ----------------------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict, keyed by the module's own names, gathered on rank 0."""
        self.drain()
        module = self.lightning_module
        local = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        if self.num_stages == 1:
            return local
        gathered: list[Any] = [None] * self.num_stages if self.is_global_zero else []  # type: ignore[list-item]
        dist.gather_object(local, gathered if self.is_global_zero else None, dst=0)
        if not self.is_global_zero:
            return {}
        full: dict[str, Any] = {}
        for part in gathered:
            full.update(part)
        # Keep the model's own key order, so the file looks like a single-device checkpoint.
        return {k: full[k] for k in self._full_keys if k in full}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state in single-device form (indices over the whole model), on rank 0."""
        index = self.optimizers.index(optimizer) if optimizer in self.optimizers else 0
        raw = getattr(optimizer, "_optimizer", optimizer)
        layout = self._optimizer_layouts[index]
        local = layout.named_state(raw, self._local_names)
        if self.num_stages == 1:
            return layout.to_full(raw, [local])
        gathered: list[Any] = [None] * self.num_stages if self.is_global_zero else []  # type: ignore[list-item]
        dist.gather_object(local, gathered if self.is_global_zero else None, dst=0)
        return layout.to_full(raw, gathered) if self.is_global_zero else {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        state = checkpoint["state_dict"]
        own = module.state_dict()
        missing = [k for k in own if k not in state]
        if strict and missing:
            raise KeyError(f"The checkpoint lacks {missing[:5]} of this model's keys; is it from another model?")
        module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        for i, optimizer in enumerate(self.optimizers):
            raw = getattr(optimizer, "_optimizer", optimizer)
            raw.load_state_dict(self._optimizer_layouts[i].to_local(raw, states[i], self._local_names))

    # ------------------------------------------------------------------------------------- end
    def on_train_end(self) -> None:
        self.drain()
        self._write_trace()
        super().on_train_end()

    def _write_trace(self) -> None:
        if self._trace_dir is None or self._engine is None:
            return
        from lightning_pipedream.schedule.timeline import to_chrome_trace

        os.makedirs(self._trace_dir, exist_ok=True)
        events = self._engine.executor.events(self.stage_index)
        path = os.path.join(self._trace_dir, f"trace_rank{self.stage_index}.json")
        with open(path, "w") as f:
            json.dump(to_chrome_trace(events), f)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "pipedream", cls, description="Pipeline parallelism, PipeDream's asynchronous 1F1B", schedule="pipedream"
        )
        strategy_registry.register(
            "pipedream_1f1b", cls, description="Pipeline parallelism, 1F1B with flush", schedule="1f1b", chunks=4
        )
        strategy_registry.register(
            "pipedream_gpipe", cls, description="Pipeline parallelism, GPipe", schedule="gpipe", chunks=4
        )


def _first_training_batch(trainer: Trainer) -> Any:
    source = getattr(trainer.fit_loop, "_data_source", None)
    if source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    try:
        return next(iter(loader))
    except (StopIteration, TypeError):
        return None


def _batch_args(args: tuple, kwargs: dict) -> tuple[Any, int]:
    batch = args[0] if args else kwargs.get("batch")
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    return batch, batch_idx


def _merge_outputs(values: list[Any]) -> Any:
    try:
        return merge(values)
    except Exception:
        return values


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _nothing() -> None:
    pass


PipeDreamStrategy.register_strategies(StrategyRegistry)

__all__ = ["PipeDreamStrategy", "SCHEDULES"]
