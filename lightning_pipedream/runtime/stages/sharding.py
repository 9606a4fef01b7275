"""Sharded stage replicas (pipeline x FSDP): a stage's replicas shard its weights, gradients and optimizer state.

With ``d`` data-parallel copies of a pipeline, each stage has ``d`` replicas, which by default keep whole copies and
all-reduce their gradients. Sharded, each replica keeps ``1/d`` of every parameter, of its gradient and of its
optimizer state, through torch's FSDP2 (``fully_shard``) over the stage's replica group:

- ``"full"``: parameters gathered for each forward and each backward and freed after (least memory);
- ``"grad_op"``: parameters kept whole from a forward to its backward (one gather per forward, none for the
  backward), gradients and optimizer state sharded.

Every micro-batch's backward adds into whole gradients without communication; the step's last backward on the
stage reduce-scatters their sum once (FSDP2's ``set_requires_gradient_sync``), so the replicas' shards hold the
sum over the union batch, as the replicated path's all-reduce does: the flushed schedules equal one process. (So
within a step the gradients are whole; they are sharded from the reduce-scatter to the next step.)
A split backward (``zb-h1``) keeps the weights gathered through the step and reduce-scatters after the last weight
half (:class:`ShardedStep`). Weight stashing would need every version's gather: the asynchronous schedules are
refused with words.

Mixed precision (``param_dtype=torch.bfloat16``, which the strategy passes under ``precision="bf16-mixed"``) is
FSDP2's policy as torchtitan sets it: the shards stay float32 (master weights, and the optimizer state beside them);
each is cast to bfloat16 before its all-gather (half the traffic and half the gathered copy), the forward and
backward compute with the bfloat16 parameters, and their gradients are added in float32 from micro-batch to
micro-batch and reduce-scattered in float32. Under autocast as well, this equals one process that computes each
micro-batch at bfloat16-rounded weights and adds its gradients in float32.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

SHARD_MODES = (None, "full", "grad_op")


def check_shard(shard: str | None, schedule: str, *, asynchronous: bool,
                replicas: Sequence[int] | None, param_dtype: torch.dtype | None = None) -> None:
    """Refuse, with the way out, what sharding cannot run."""
    if shard not in SHARD_MODES:
        raise ValueError(f"shard={shard!r} is not a sharding mode: use 'full' (parameters, gradients and optimizer "
                         "state sharded), 'grad_op' (gradients and optimizer state sharded) or None (replicas keep "
                         "whole copies).")
    if shard is None:
        if param_dtype is not None:
            raise ValueError(f"param_dtype={param_dtype} is the dtype sharded stages gather their parameters in, but "
                             "shard=None keeps whole parameters as they are. Pass shard='full' or 'grad_op' with it, "
                             "or drop param_dtype and run step() under torch.autocast for mixed precision.")
        return
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise ValueError(f"param_dtype={param_dtype} is not a floating-point dtype: sharded stages gather their "
                         "parameters in it for compute. Use torch.bfloat16 (mixed precision) or None (as they are).")
    if replicas is None or len(set(replicas)) != 1 or replicas[0] < 2:
        raise ValueError(f"shard={shard!r} shards each stage over its replicas: give every stage the same number of "
                         f"replicas, at least 2 (replicas=[2, 2] for two copies of a 2-stage pipeline), not "
                         f"{None if replicas is None else list(replicas)}.")
    if asynchronous:
        raise ValueError(f"shard={shard!r} with schedule={schedule!r}: weight stashing keeps several versions of every "
                         "weight, and each forward would gather the whole of its version, which takes back what "
                         "sharding saves. Use 1f1b or gpipe, or shard=None.")


def mixed_precision(param_dtype: torch.dtype | None) -> Any:
    """FSDP2's policy for sharded stages: with ``param_dtype`` (bfloat16 under ``bf16-mixed``), each shard is cast
    to it before the all-gather, so the gathered working copy, the forward and the backward use it (the parameters'
    gradients come out in it too), while the shards, their gradients and the optimizer state stay float32: each
    micro-batch's gradient is added in float32 and the step's sum reduce-scattered in float32 (torchtitan's
    policy; ``reduce_dtype`` left None would reduce in bfloat16). Forward inputs are cast to ``param_dtype`` on
    entry. Without ``param_dtype``, everything stays in the parameters' dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard_stage(module: nn.Module, group: dist.ProcessGroup, shard: str, device: torch.device,
                param_dtype: torch.dtype | None = None) -> nn.Module:
    """Wrap ``module`` (a stage, or one model chunk) with ``fully_shard`` over ``group``: each child with parameters
    a unit of its own (gathered and freed one at a time), then the stage; gradients reduce by their sum. With
    ``param_dtype``, parameters are gathered and used in that dtype (see :func:`mixed_precision`)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise RuntimeError(f"shard={shard!r} needs FSDP2's plain-sum gradient reduction, which torch "
                           f"{torch.__version__} lacks; install the torch that lightning_pipedream pins, or use "
                           "shard=None.")
    mesh = DeviceMesh.from_group(group, device.type)
    keep = shard == "grad_op"  # parameters stay gathered from a forward to its backward
    policy = mixed_precision(param_dtype)
    for child in module.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh, reshard_after_forward=not keep, mp_policy=policy)
    units = sharded_units(module)
    for i, unit in enumerate(units):
        # A backward gathers the unit before it ahead, within the micro-batch. FSDP2's default follows the order of
        # every forward since the last backward, which under 1F1B reaches into another micro-batch's units that the
        # next forward frees unused (measured: one wasted all-gather per step on stage 0). The first unit names
        # itself, a no-op: an empty list would mean the default.
        unit.set_modules_to_backward_prefetch([units[i - 1] if i else unit])
    fully_shard(module, mesh=mesh, reshard_after_forward=not keep, mp_policy=policy)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            # The replicas' gradients add up (each micro-batch's loss already counts its share of the union batch),
            # by a plain sum, which every backend has (gloo has no pre-multiplied sum).
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return module


def sharded_units(module: nn.Module) -> list[nn.Module]:
    """The units :func:`shard_stage` made of ``module``'s children, in forward order."""
    from torch.distributed.fsdp import FSDPModule

    return [c for c in module.children() if isinstance(c, FSDPModule)]


class ShardedStep:
    """What this rank's sharded model chunks do around a flushed step's actions: when they reduce-scatter their
    gradients, and which all-gathers they start ahead.

    ``chunks[c]`` is the FSDP2 root of model chunk ``c``, which runs stage ``c * num_stages + rank`` (one chunk unless
    interleaved). Whole backwards leave it to FSDP2's hooks: every backward only adds into whole gradients, and the
    stage's last backward of the step reduce-scatters their sum (``set_requires_gradient_sync``).

    A split backward (zero bubble) runs the input half and the weight half as separate autograd calls, and FSDP2's
    post-backward fires in the input half, before any weight gradient exists; the weight half also reads the graph
    the forward saved, gathered weights included. So for a split schedule the chunk keeps its weights gathered from
    its first forward of the step to its last weight half (no reshard after forward or backward, in both modes: one
    all-gather per step), the weight halves add into whole gradients, and after the stage's last gradient action of
    the step this object runs FSDP2's post-backward itself: one reduce-scatter, then the weights are freed.

    Before a blocking receive, :meth:`prefetch` starts the all-gather of the unit the next compute needs first (the
    first unit for a forward, the last for a backward), so that it runs while the stage waits for its peer instead
    of after the message arrives; FSDP2 waits for it in that unit's pre-forward (pre-backward) hook. Within a forward
    FSDP2 gathers unit by unit as each starts, and within a backward it gathers the next unit ahead by itself.
    """

    # Start a unit's all-gather before a blocking receive (see the class's text). False gathers when the compute
    # starts, e.g. to compare.
    prefetch_ahead = True

    def __init__(self, chunks: Sequence[nn.Module], num_stages: int, shard: str, *, split_backward: bool) -> None:
        self.chunks = list(chunks)
        self.num_stages = num_stages
        self.shard = shard
        self.split_backward = split_backward
        self._set_up = False  # prefetching waits for the first step: FSDP2 sets its roots up in their first forward
        # each chunk's first and last unit to gather ahead of a forward and of a backward (the chunk if it has none)
        self._ends = [(units[0], units[-1]) if (units := sharded_units(c)) else (c, c) for c in self.chunks]

    def chunk(self, stage: int) -> nn.Module:
        return self.chunks[stage // self.num_stages]

    def begin(self, stage: int) -> None:
        """Before the step: backwards only add up gradients (a split schedule's also keep the weights gathered)."""
        module = self.chunk(stage)
        _fsdp(module).set_requires_gradient_sync(False)
        if self.split_backward:
            _fsdp(module).set_is_last_backward(False)
            _fsdp(module).set_reshard_after_forward(False)
            _fsdp(module).set_reshard_after_backward(False)

    def before_backward(self, stage: int, last: bool) -> None:
        """Before a BACKWARD: the stage's last of the step (whole backwards) reduce-scatters in FSDP2's hooks."""
        if last and not self.split_backward:
            _fsdp(self.chunk(stage)).set_requires_gradient_sync(True)

    def after_gradients(self, stage: int, last: bool) -> None:
        """After an action that added weight gradients (split schedules): FSDP2's post-backward folds them into its
        accumulated gradients (the reduce dtype's, under mixed precision); after the stage's last of the step it
        reduce-scatters them and frees the gathered weights."""
        if not self.split_backward:
            return
        module = _fsdp(self.chunk(stage))
        if last:
            module.set_requires_gradient_sync(True)
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
        _run_post_backward(module)
        if last:
            module.set_reshard_after_forward(self.shard == "full")

    def end_step(self) -> None:
        """After the step's actions: from the next step on, FSDP2's roots are set up and gathers may start ahead."""
        self._set_up = True

    def prefetch(self, stage: int, forward: bool) -> None:
        """Start the all-gather of the unit that ``stage``'s next forward (or backward) needs first, without waiting:
        FSDP2 waits in that unit's hook. A no-op when its weights are gathered already, or still being gathered."""
        if not self._set_up or not self.prefetch_ahead:
            return
        first, last = self._ends[stage // self.num_stages]
        _fsdp(first if forward else last).unshard(async_op=True)


def _fsdp(module: nn.Module) -> Any:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not sharded (fully_shard): ShardedStep needs sharded chunks.")
    return module


def _run_post_backward(module: Any) -> None:
    """FSDP2's post-backward for every unit under the root ``module``, then its end-of-backward callback, as if an
    autograd call over all of them had just ended (torch.distributed.pipelining does the same for its split
    backwards). Private FSDP2 state: its name for the units' parameter groups changed in torch 2.9."""
    state = module._get_fsdp_state()
    for unit in state._state_ctx.all_states:
        groups = getattr(unit, "_fsdp_param_groups", None)
        if groups is None:  # torch <= 2.8: one group per unit, or None
            groups = [g] if (g := unit._fsdp_param_group) is not None else []
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def full_state(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s state dict with every sharded tensor gathered whole (a collective over its replicas)."""
    return whole_state(module.state_dict())


def whole_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with every sharded tensor gathered whole (a collective over the replicas that hold them)."""
    return {k: _whole(v) for k, v in state.items()}


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the storages these tensors (this rank's shards, for sharded ones) hold here, each storage once."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def training_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Measured bytes of a stage's parameters, gradients and optimizer state on this rank."""
    params = list(module.parameters())
    state = [v for s in (optimizer.state.values() if optimizer is not None else []) for v in s.values()
             if isinstance(v, Tensor)]
    return local_bytes(params) + local_bytes(p.grad for p in params) + local_bytes(state)


def _whole(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


class WholeOptimizerState:
    """An optimizer seen with its sharded state gathered whole, for a consolidated checkpoint (a collective over the
    replicas: every replica of the stage reads it at once)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        whole = {i: {k: _whole(v) for k, v in s.items()} for i, s in state["state"].items()}
        return {**state, "state": whole}


def shard_like(value: Tensor, like: Any) -> Any:
    """``value`` (a whole tensor, from a consolidated checkpoint) as ``like``'s shard when ``like`` is sharded; every
    replica holds the whole value, so each takes its own shard without communicating."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor) or isinstance(value, DTensor) or value.shape != like.shape:
        return value
    return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def sharded_model_state(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A consolidated state dict with the entries of ``module``'s sharded tensors cut to this rank's shards."""
    own = module.state_dict()
    return {k: shard_like(v, own[k]) if k in own and isinstance(v, Tensor) else v for k, v in state.items()}


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict of whole tensors (this rank's parameters, by local index) cut to the shards of the
    parameters they belong to, as the optimizer keeps them."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cut = {i: {k: shard_like(v, params[int(i)]) if isinstance(v, Tensor) else v for k, v in s.items()}
           for i, s in state["state"].items()}
    return {**state, "state": cut}


def local_square_norm(grads: Iterable[Tensor], device: torch.device) -> Tensor:
    """The sum of squares of the gradients' entries held here (a sharded gradient's shard only)."""
    from torch.distributed.tensor import DTensor

    square = torch.zeros(1, device=device, dtype=torch.float32)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        square += local.detach().float().pow(2).sum()
    return square


def scale_gradient(grad: Tensor, factor: Tensor) -> None:
    """``grad *= factor`` in place, on this rank's shard when ``grad`` is sharded."""
    from torch.distributed.tensor import DTensor

    local = grad.to_local() if isinstance(grad, DTensor) else grad
    local.mul_(factor.to(local.dtype))
