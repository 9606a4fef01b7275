"""Where the stages live: replicas per stage, layers per stage (a plan, a balance, or profiling and PipeDream's
optimizer), and the process groups that join them. A part of :class:`~lightning_pipedream.PipeDreamStrategy`."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_pipedream.plan.balance import check_balance, check_stage_count, even_balance
from lightning_pipedream.runtime.materialize import balance_by_parameters, has_meta_tensors
from lightning_pipedream.schedule.actions import Layout
from lightning_pipedream.strategy.batches import first_batch
from lightning_pipedream.strategy.calls import SequentialCall

log = logging.getLogger("lightning_pipedream.strategy")


class StagePlacement:
    """PipeDreamStrategy's decisions of layout, balance and process groups (made in its ``setup``)."""

    def _last_stage_ranks(self) -> list[int]:
        """The last stage's ranks in the pipeline's group (those that compute the loss): its replicas under 1F1B-RR,
        the first of which evaluates."""
        if self._layout is not None:  # the pipeline's group is the world
            return list(self._layout.ranks_of(self._layout.num_stages - 1))
        return [self.num_stages - 1]

    def _decide_layout(self) -> None:
        """Replicas per stage from ``replicas=`` or the plan: equal counts are data parallelism (``stages=``),
        unequal ones PipeDream's 1F1B-RR."""
        replicas = self._replicas_arg
        if replicas is None and self._plan_path is not None:
            from lightning_pipedream.plan.partition import Plan

            replicas = [stage.replicas for stage in Plan.load(self._plan_path).stages]
        if replicas is None and not self.straight and self.plan is not None:  # the planner's choice
            replicas = [stage.replicas for stage in self.plan.stages]
        if replicas is None or all(r == 1 for r in replicas):
            return
        layout = Layout(tuple(replicas))
        if layout.num_ranks != self.world_size:
            raise ValueError(
                f"replicas {list(replicas)} need {layout.num_ranks} processes but the Trainer runs {self.world_size}; "
                f"set devices x num_nodes to {layout.num_ranks}, or change the replicas."
            )
        if layout.is_uniform:
            self._stages_arg = layout.num_stages
            return
        if self.schedule not in ("pipedream", "gpipe", "1f1b"):
            raise ValueError(
                f"Stages with unequal replica counts ({list(replicas)}) run with schedule='pipedream', 'gpipe' or "
                f"'1f1b' under PipeDreamStrategy, not {self.schedule!r}. Use one of those, or equal replicas "
                "(data-parallel pipelines)."
            )
        self._layout = layout

    def _make_groups(self) -> None:
        """The process groups: each pipeline's (its point-to-point traffic) and each stage's replicas'."""
        options = {"backend": self._process_group_backend, "timeout": self._timeout}
        if self._layout is not None:  # 1F1B-RR: ranks talk across the world; each stage's replicas all-reduce
            self._pipeline_group = dist.new_group(**options)
            self._summary_group = dist.new_group(**options) if self.asynchronous else None
            for s in range(self._layout.num_stages):
                ranks = list(self._layout.ranks_of(s))
                group = dist.new_group(ranks, **options) if len(ranks) > 1 else None
                if s == self.stage_index:
                    self._replica_group = group
            return
        p, world = self.num_stages, self.world_size
        if world % p != 0:
            raise ValueError(
                f"PipeDreamStrategy(stages={p}) runs on {world} processes: the processes must be a multiple of the "
                f"stages (d data-parallel pipelines of {p} stages). Use devices x num_nodes = {p} x d, or stages "
                f"dividing {world}."
            )
        d = self.num_pipelines
        # Groups made here carry the strategy's timeout (a DeviceMesh's would wait torch's default 30 minutes).
        lagged = self.asynchronous and p > 1  # summaries travel on a group of their own
        if d == 1:
            self._pipeline_group = dist.new_group(**options) if p > 1 else None
            self._summary_group = dist.new_group(**options) if lagged else None
            return
        # The rows and columns of a (p, d) mesh of stage-major ranks (see ReplicaGroups). new_group is collective:
        # every rank makes every group, in the same order.
        for k in range(d):
            ranks = [s * d + k for s in range(p)]
            group = dist.new_group(ranks, **options)
            summaries = dist.new_group(ranks, **options) if lagged else None
            if k == self.pipeline_index:
                self._pipeline_group, self._summary_group = group, summaries
        for s in range(p):
            group = dist.new_group([s * d + k for k in range(d)], **options)
            if s == self.stage_index:
                self._replica_group = group

    def _decide_balance(self, trainer: Trainer, module: LightningModule, layers: nn.Sequential) -> list[int]:
        if self.virtual_stages > 1:  # interleaved: processes x virtual_stages stages, evenly unless balance= says
            total = self.num_stages * self.virtual_stages
            if self._balance_arg is not None:
                return check_balance(self._balance_arg, len(layers), total)
            return even_balance(len(layers), total)
        if self._plan_path is not None:
            return self._balance_from_plan_file(layers)
        if self._balance_arg is not None:
            return check_balance(self._balance_arg, len(layers), self.num_stages)
        if not self.straight and self.plan is not None:
            return check_balance(self.plan.balance, len(layers), self.num_stages)
        check_stage_count(len(layers), self.num_stages)
        if self.num_stages == 1:
            return [len(layers)]
        if trainer.state.fn != TrainerFn.FITTING:
            return even_balance(len(layers), self.num_stages)
        if has_meta_tensors(layers):  # nothing to run yet: balance the weights, which decide the memory
            return balance_by_parameters(layers, self.num_stages)
        payload: list[Any] = [None]
        if self.is_global_zero:
            payload = [self._profile_and_partition(trainer, module, layers)]
        dist.broadcast_object_list(payload, src=0)
        plan_json, balance = payload[0]
        if plan_json is not None:
            from lightning_pipedream.plan.partition import Plan

            self.plan = Plan.from_json(plan_json)
        return check_balance(balance, len(layers), self.num_stages)

    def _balance_from_plan_file(self, layers: nn.Sequential) -> list[int]:
        from lightning_pipedream.plan.partition import Plan

        assert self._plan_path is not None
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

    def _profile_and_partition(
        self, trainer: Trainer, module: LightningModule, layers: nn.Sequential
    ) -> tuple[dict | None, list[int]]:
        """Rank 0: profile the layers on one training batch, partition with PipeDream's optimizer."""
        from lightning_pipedream.plan.partition import partition
        from lightning_pipedream.plan.topology import Topology

        profile = self._profile_layers(trainer, module, layers)
        if profile is None:
            return None, even_balance(len(layers), self.num_stages)
        topology = Topology.flat(self.num_stages, self._link_bandwidth)
        plan = partition(profile, topology, "pipedream", straight=True)
        if len(plan.stages) != self.num_stages:
            # The optimizer may leave workers idle when that is faster; a pipeline here uses them all.
            plan = partition(profile, topology, "time")
        for method in ("time", "parameters"):
            if _every_stage_trains(profile, plan.balance):
                break
            # A stage of parameter-free layers (an activation alone: noisy timings can make it look worth a
            # stage) cannot have an optimizer.
            plan = partition(profile, topology, method)
        plan.schedule, plan.chunks = self.schedule, self.chunks
        log.info("PipeDreamStrategy plan (%d stages, schedule=%s):\n%s", self.num_stages, self.schedule,
                 plan.describe())
        return plan.to_json(), plan.balance

    @property
    def _link_bandwidth(self) -> float:
        """The bandwidth between two stages of one pipeline (within a node when two are given)."""
        return float(self.bandwidth[0] if isinstance(self.bandwidth, (list, tuple)) else self.bandwidth)

    def _profile_layers(self, trainer: Trainer, module: LightningModule, layers: nn.Sequential) -> Any:
        """Rank 0: the layers' Profile on the first training batch (None without a batch)."""
        from lightning_pipedream.plan.profile import profile_module

        batch = first_batch(trainer.fit_loop)
        if batch is None:
            return None
        sample = self._call.input_of(module, "training_step", self.batch_to_device(batch), 0)
        return profile_module(layers, sample)

    def _plan_with_replication(self, trainer: Trainer, module: LightningModule) -> None:
        """``straight=False``: rank 0 profiles the layers and plans for every process with replication allowed,
        on the Trainer's topology; every rank then runs that plan (its replicas decide the layout)."""
        from lightning_pipedream.plan.partition import Plan, partition
        from lightning_pipedream.plan.topology import Topology

        layers = self._sequential_layers(module)
        if layers is None:
            raise ValueError(
                f"PipeDreamStrategy(straight=False) plans replicated stages for a module whose layers are one "
                f"nn.Sequential; {type(module).__name__}'s are not. Use straight=True (the default) for the graph "
                "path, or put the layers in one nn.Sequential."
            )
        self._call = SequentialCall(self._layers_name)
        payload: list[Any] = [None]
        if self.is_global_zero:
            topology = Topology.of_cluster(len(self.parallel_devices or [None]), self.num_nodes, self.bandwidth)
            profile = self._profile_layers(trainer, module, layers)
            plan = None
            if profile is not None:
                plan = partition(profile, topology, "pipedream", straight=False)
                flat = Topology.flat(self.world_size, self._link_bandwidth)
                if sum(stage.replicas for stage in plan.stages) != self.world_size:  # it left processes idle
                    plan = partition(profile, flat, "time")
                for method in ("time", "parameters"):
                    if _every_stage_trains(profile, plan.balance):
                        break
                    plan = partition(profile, flat, method)  # a parameter-free stage cannot have an optimizer
                plan.schedule, plan.chunks = self.schedule, self.chunks
                log.info("PipeDreamStrategy plan (%d processes, replication allowed, schedule=%s):\n%s",
                         self.world_size, self.schedule, plan.describe())
            payload = [None if plan is None else plan.to_json()]
        dist.broadcast_object_list(payload, src=0)
        self.plan = None if payload[0] is None else Plan.from_json(payload[0])


def _every_stage_trains(profile: Any, balance: list[int]) -> bool:
    """Whether each stage of ``balance`` holds a layer with parameters, by ``profile``'s parameter bytes."""
    start = 0
    for count in balance:
        if not any(layer.parameter_bytes for layer in profile.layers[start : start + count]):
            return False
        start += count
    return True
