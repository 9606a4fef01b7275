"""Which layers each stage holds: a plan file, ``balance=``, or PipeDream's optimizer on rank 0's profile."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_pipedream.plan.balance import check_balance, check_chunk_count, check_stage_count, even_balance
from lightning_pipedream.plan.partition import every_stage_trains_or_repartition
from lightning_pipedream.runtime.faults.failures import from_rank_zero
from lightning_pipedream.runtime.stages.materialize import balance_by_parameters, has_meta_tensors
from lightning_pipedream.strategy.setup.batches import first_batch
from lightning_pipedream.strategy.setup.calls import SequentialCall
from lightning_pipedream.strategy.setup.options import PipelineOptions

log = logging.getLogger("lightning_pipedream.strategy")


class LayerPlanner:
    """Decides the layers per stage of a module whose layers are one ``nn.Sequential``.

    Every rank calls the same methods at the same point of ``setup``; profiling happens on rank 0, whose
    plan (or error) is broadcast (:func:`from_rank_zero`), so that every rank splits the model alike, or stops with
    rank 0's reason.
    """

    def __init__(self, options: PipelineOptions, trainer: Trainer, module: LightningModule, call: SequentialCall,
                 is_global_zero: bool, batch_to_device: Callable[[Any], Any]) -> None:
        self.options = options
        self.trainer = trainer
        self.module = module
        self.call = call
        self.is_global_zero = is_global_zero
        self.batch_to_device = batch_to_device

    def balance(self, layers: nn.Sequential, num_stages: int, plan: Any) -> tuple[list[int], Any]:
        """Layers per stage for ``num_stages`` stages (per process; interleaved: processes x virtual stages), and
        the Plan behind it (the given one, the partitioner's, or None)."""
        options = self.options
        if options.virtual_stages > 1:  # interleaved: processes x virtual_stages stages, evenly unless balance= says
            total = num_stages * options.virtual_stages
            check_chunk_count(len(layers), num_stages, options.virtual_stages, options.schedule)
            if options.balance is not None:
                return check_balance(options.balance, len(layers), total), plan
            return even_balance(len(layers), total), plan
        if options.plan_path is not None:
            return self._balance_from_plan_file(layers, num_stages, plan), plan
        if options.balance is not None:
            check_fixed_stages(options.balance, num_stages)
            return check_balance(options.balance, len(layers), num_stages), plan
        if not options.straight and plan is not None:  # the replicating planner's choice
            return check_balance(plan.balance, len(layers), num_stages), plan
        check_stage_count(len(layers), num_stages)
        if num_stages == 1:
            return [len(layers)], plan
        if self.trainer.state.fn != TrainerFn.FITTING:
            return even_balance(len(layers), num_stages), plan
        if has_meta_tensors(layers):  # nothing to run yet: balance the weights, which decide the memory
            return balance_by_parameters(layers, num_stages), plan
        plan_json, balance = from_rank_zero("profile the layers to plan the stages",
                                            lambda: self._profile_and_partition(layers, num_stages))
        if plan_json is not None:
            from lightning_pipedream.plan.partition import Plan

            plan = Plan.from_json(plan_json)
        return check_balance(balance, len(layers), num_stages), plan

    def _balance_from_plan_file(self, layers: nn.Sequential, num_stages: int, plan: Any) -> list[int]:
        path = self.options.plan_path
        if len(plan.stages) != num_stages:
            raise ValueError(
                f"The plan {path} has {len(plan.stages)} stages but the Trainer runs {num_stages} processes. Make a "
                f"plan for {num_stages} workers, or set devices/num_nodes to give {len(plan.stages)} processes."
            )
        names = list(layers._modules)
        planned = [name for stage in plan.stages for name in stage.layers]
        if planned != names:
            raise ValueError(plan_mismatch_words(str(path), planned, names, self.call.name))
        return check_balance(plan.balance, len(layers), num_stages)

    def _profile_and_partition(self, layers: nn.Sequential, num_stages: int) -> tuple[dict | None, list[int]]:
        """Rank 0: profile the layers on one training batch, partition with PipeDream's optimizer."""
        from lightning_pipedream.plan.partition import partition
        from lightning_pipedream.plan.topology import Topology

        profile = self._profile_layers(layers)
        if profile is None:
            return None, even_balance(len(layers), num_stages)
        topology = Topology.flat(num_stages, self.options.link_bandwidth)
        plan = partition(profile, topology, "pipedream", straight=True)
        if len(plan.stages) != num_stages:
            # The optimizer may leave workers idle when that is faster; a pipeline here uses them all.
            plan = partition(profile, topology, "time")
        plan = every_stage_trains_or_repartition(plan, profile, topology)
        plan.schedule, plan.chunks = self.options.schedule, self.options.chunks
        plan.extra["profile"] = profile.to_json()  # what a rerun plans again from, with the measured times
        log.info("PipeDreamStrategy plan (%d stages, schedule=%s):\n%s", num_stages, self.options.schedule,
                 plan.describe())
        return plan.to_json(), plan.balance

    def _profile_layers(self, layers: nn.Sequential, working_sets: bool = False) -> Any:
        """Rank 0: the layers' Profile on the first training batch (None without a batch); ``working_sets`` for the
        memory model (``profile_module``)."""
        from lightning_pipedream.plan.profile import profile_module

        batch = first_batch(self.trainer.fit_loop)
        if batch is None:
            return None
        sample = self.call.input_of(self.module, "training_step", self.batch_to_device(batch), 0)
        if has_meta_tensors(layers):  # built on the meta device: no process holds the whole model
            return profile_block_by_block(layers, sample, working_sets=working_sets)
        return profile_module(layers, sample, working_sets=working_sets)

    def auto_plan(self, layers: nn.Sequential, processes_per_node: int, num_nodes: int,
                  optimizer: str, device: torch.device | None = None) -> tuple[dict[str, Any], Any]:
        """``schedule='auto'``: rank 0 profiles the layers and the auto planner chooses the split, replicas,
        schedule, micro-batches and recompute within ``memory_limit`` (see :func:`~lightning_pipedream.plan.auto.
        auto_plan`), and with ``shard=`` whether the replicas shard; every rank gets the strategy arguments that run
        the choice (``shard`` always among them), and its Plan. A refusal (nothing fits) is raised on every rank. On a
        GPU ``device``, the memory model counts what CUDA adds."""
        from lightning_pipedream.plan.auto import auto_plan
        from lightning_pipedream.plan.partition import Plan
        from lightning_pipedream.plan.topology import Topology

        options = self.options

        def choose() -> tuple[dict[str, Any] | None, dict | None, str | None]:
            profile = self._profile_layers(layers, working_sets=True)
            try:
                if profile is None:
                    raise ValueError(
                        "PipeDreamStrategy(schedule='auto') profiles the layers on the first training batch, but the "
                        "dataloader gave none. Give a dataloader with at least one batch, or name a schedule."
                    )
                topology = Topology.of_cluster(processes_per_node, num_nodes, options.bandwidth)
                on_gpu = device is not None and device.type == "cuda"
                gpu = {"device": "cuda", "cuda_capability": tuple(torch.cuda.get_device_capability(device))} \
                    if on_gpu else {}
                chosen = auto_plan(profile, topology, options.memory_limit, exact=options.exact, optimizer=optimizer,
                                   shard=shard_choice(options.shard, layers), **gpu,
                                   gradients_carried=self.trainer.accumulate_grad_batches > 1)
            except ValueError as refused:  # every rank raises the refusal itself, as if it had planned
                return None, None, str(refused)
            log.info("PipeDreamStrategy(schedule='auto') chose (from %s):\n%s", profile.source, chosen.describe())
            # shard= always: the options' "auto" (or a mode) becomes the plan's choice, None when replicas stay whole
            return {**chosen.strategy_arguments(), "shard": chosen.chosen.shard}, chosen.plan.to_json(), None

        arguments, plan_json, refused_words = from_rank_zero("profile the layers and plan the pipeline "
                                                             "(schedule='auto')", choose)
        if refused_words is not None:
            raise ValueError(refused_words)
        return arguments, Plan.from_json(plan_json)

    def replicated_plan(self, layers: nn.Sequential, world_size: int, processes_per_node: int, num_nodes: int) -> Any:
        """``straight=False``: rank 0 profiles the layers and plans for every process with replication allowed, on
        the Trainer's topology; every rank gets that plan (its replicas decide the placement)."""
        from lightning_pipedream.plan.partition import Plan, partition
        from lightning_pipedream.plan.topology import Topology

        options = self.options

        def plan_on_rank_zero() -> dict | None:
            topology = Topology.of_cluster(processes_per_node, num_nodes, options.bandwidth)
            profile = self._profile_layers(layers)
            if profile is None:
                return None
            plan = partition(profile, topology, "pipedream", straight=False)
            flat = Topology.flat(world_size, options.link_bandwidth)
            if sum(stage.replicas for stage in plan.stages) != world_size:  # it left processes idle
                plan = partition(profile, flat, "time")
            plan = every_stage_trains_or_repartition(plan, profile, flat)
            plan.schedule, plan.chunks = options.schedule, options.chunks
            plan.extra["profile"] = profile.to_json()  # its batch size: what a step holds of the plan's minibatches
            log.info("PipeDreamStrategy plan (%d processes, replication allowed, schedule=%s):\n%s",
                     world_size, options.schedule, plan.describe())
            return plan.to_json()

        plan_json = from_rank_zero("profile the layers to plan replicated stages (straight=False)", plan_on_rank_zero)
        return None if plan_json is None else Plan.from_json(plan_json)


def shard_choice(shard: str | None, layers: nn.Sequential) -> str | None:
    """What the planner may shard: ``shard='auto'`` over layers that share a parameter keeps whole replicas (the
    strategy does not shard tied parameters yet); a mode asked for by name stays, and is refused at setup."""
    if shard != "auto":
        return shard
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for param in layer.parameters():
            if owner.setdefault(id(param), index) != index:
                log.info("PipeDreamStrategy(shard='auto'): layers %d and %d share a parameter; the planner keeps whole "
                         "replicas (tied parameters are not sharded yet).", owner[id(param)], index)
                return None
    return shard


def check_fixed_stages(balance: Any, num_stages: int) -> None:
    """A ``balance=`` written for another number of processes than this start of the run has: under torchrun, most
    likely a restart on fewer (or more) processes, which a checkpoint resumes on any layout if the stages are
    planned anew."""
    if len(balance) == num_stages or not any(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "GROUP_RANK")):
        return
    raise ValueError(
        f"balance={list(balance)} lists {len(balance)} stages, but this start of the run has {num_stages} "
        f"{'process' if num_stages == 1 else 'processes'} for the pipeline: torchrun started it on another number "
        "of processes (a restart with --nnodes MIN:MAX after nodes were lost or added, or the job started again "
        "with another --nproc-per-node). Checkpoints resume on any layout: leave balance= unset (and stages=, "
        f"plan=) so that each start plans its own stages, or give a balance of {num_stages} "
        f"{'stage' if num_stages == 1 else 'stages'}.")


def plan_mismatch_words(path: str, planned: list[str], names: list[str], where: str) -> str:
    """A plan made for another model: the layer counts and the first layer that differs."""
    first = next((i for i, (a, b) in enumerate(zip(planned, names)) if a != b), min(len(planned), len(names)))
    theirs = repr(planned[first]) if first < len(planned) else f"absent (the plan ends at layer {len(planned) - 1})"
    ours = repr(names[first]) if first < len(names) else f"absent (the model ends at layer {len(names) - 1})"
    return (f"The plan {path} was made for another model: it plans {len(planned)} layers and the model's "
            f"nn.Sequential ({where}) has {len(names)}; the first that differs is layer {first}: {theirs} in the "
            f"plan, {ours} in the model. Profile this model to make its plan (python -m lightning_pipedream plan), "
            "or drop plan= to plan at the first batch.")


def profile_block_by_block(layers: nn.Sequential, sample: Any, working_sets: bool = False) -> Any:
    """Profile a Sequential built on the meta device one layer at a time: each layer is materialized alone on the
    sample's device with random weights of its shapes (a layer's time does not depend on its values), profiled on
    the previous layer's output, and freed, so the peak is the largest layer, not the model. The profile's
    ``source`` says so (the plan's printout shows it)."""
    import copy
    from collections import OrderedDict

    from lightning_pipedream.plan.profile import Profile, profile_module
    from lightning_pipedream.runtime.stages.materialize import materialize
    from lightning_pipedream.tree import tensors

    started = time.perf_counter()
    found = tensors(sample)
    device = found[0].device if found else torch.device("cpu")
    results, extra, inputs = [], {}, sample
    for name, layer in layers.named_children():
        real = copy.deepcopy(layer)  # still on meta: its own storage from here
        try:
            materialize(real, device, 0)
        except ValueError:  # no reset_parameters(): any values of the right shapes time alike
            real.to_empty(device=device)
            with torch.no_grad():
                for tensor in itertools.chain(real.parameters(), real.buffers()):
                    tensor.normal_(0.0, 0.02) if tensor.is_floating_point() else tensor.zero_()
        part = profile_module(nn.Sequential(OrderedDict([(name, real)])), inputs, working_sets=working_sets)
        extra = extra or part.extra  # the first layer's input is the batch
        results.extend(part.layers)
        with torch.no_grad():
            inputs = real(inputs)  # a layer takes its predecessor's output as one argument, as profile_module calls it
        del real
    return Profile(results, batch_size=None if not found or found[0].dim() == 0 else int(found[0].shape[0]),
                   source="profile_module, one block at a time with random weights (a model on the meta device)",
                   profiling_s=time.perf_counter() - started, extra=extra)
