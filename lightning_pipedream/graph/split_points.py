"""Profile a captured graph layer by layer into the partitioner's Profile (a DAG), and turn a Plan into split points."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import Node
from torch.utils import _pytree as pytree

from lightning_pipedream.graph.capture import CapturedGraph
from lightning_pipedream.graph.split import get_path, stage_program
from lightning_pipedream.plan.partition import Plan, partition
from lightning_pipedream.plan.profile import LayerProfile, Profile
from lightning_pipedream.plan.topology import Topology


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, Tensor))


def _median(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def profile_graph(captured: CapturedGraph, module: nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None,
                  *, warmup: int = 1, repeats: int = 3) -> Profile:
    """Time each layer of ``captured`` on the example call (forward, and backward of its outputs to its inputs
    and parameters), with the bytes of the values it hands to later layers and of the parameters it reads.

    The layers keep the graph's order (a topological one) and ``edges`` list which layer feeds which, as in
    PipeDream's graph.txt, so the partitioner counts a skip connection on every cut it spans. ``module``
    supplies the parameter and buffer values; nothing in it changes (no ``.grad``, buffers untouched).
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"profile_graph needs warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}.")
    started = time.perf_counter()
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    if len(leaves) != len(captured.inputs):
        raise ValueError(f"The call has {len(leaves)} inputs but the capture took {len(captured.inputs)}; profile "
                         "with the arguments the graph was captured with.")
    # value, and whether it requires grad in a real run (kernels choose by it: SDPA with a mask that requires grad
    # takes another path, whose output has other strides)
    env: dict[Node, tuple[Any, bool]] = {
        node: (x.detach() if isinstance(x, Tensor) else x, False) for node, x in zip(captured.inputs, leaves)
    }
    state: dict[Node, Tensor] = {}
    for node, (kind, name) in captured.state.items():
        value = captured.constants[name] if kind == "constant" else get_path(module, name)
        state[node] = value.detach().requires_grad_(value.requires_grad) if kind == "parameter" else value.detach()
    layer_of = captured.layer_of
    outputs = {v for v in captured.outputs if isinstance(v, Node)}
    results, edges = [], set()
    with torch.random.fork_rng():
        for index, layer in enumerate(captured.layers):
            members = set(layer.nodes)
            inputs = list(dict.fromkeys(a for n in layer.nodes for a in n.all_input_nodes
                                        if a not in members and a not in captured.state))
            edges |= {(layer_of[a], index) for a in inputs if a in layer_of}
            produced = [n for n in layer.nodes if n in outputs or any(u not in members and u.op != "output"
                                                                        for u in n.users)]
            program = stage_program(captured, layer.nodes, inputs, produced, [])
            used_state = [p for p in captured.state if any(u in members for u in p.users)]
            state_args = [state[p] for p in used_state]
            in_args = [_fresh(*env[a]) for a in inputs]
            forward_s = _median(lambda: program(*state_args, *in_args), warmup, repeats)
            values = program(*state_args, *in_args)
            backward_s = _backward_time(program, state_args, in_args, warmup, repeats)
            for node, value in zip(produced, values):
                env[node] = (value.detach(), value.requires_grad) if isinstance(value, Tensor) else (value, False)
            params = {id(state[p]): state[p] for p in used_state if captured.state[p][0] == "parameter"}
            results.append(LayerProfile(
                layer.name, forward_s, backward_s, _nbytes(list(values)),
                sum(t.numel() * t.element_size() for t in params.values()), f"{len(layer.nodes)} ops",
            ))
    batch = [t for t in leaves if isinstance(t, Tensor) and t.dim() > 0]
    return Profile(results, edges=sorted(edges), batch_size=int(batch[0].shape[0]) if batch else None,
                   source="profile_graph", profiling_s=time.perf_counter() - started)


def _fresh(value: Any, requires_grad: bool) -> Any:
    """A detached leaf that requires grad if the value did, as a later stage's input does."""
    if isinstance(value, Tensor):
        return value.detach().requires_grad_(requires_grad)
    return value


def _backward_time(program: Callable, state_args: list, in_args: list, warmup: int, repeats: int) -> float:
    wrt = [t for t in state_args + in_args if isinstance(t, Tensor) and t.requires_grad]
    if not wrt:
        return 0.0
    samples = []
    for attempt in range(warmup + repeats):
        outs = [t for t in pytree.tree_leaves(list(program(*state_args, *in_args)))
                if isinstance(t, Tensor) and t.requires_grad]
        if not outs:
            return 0.0
        grads = [torch.ones_like(t) for t in outs]
        start = time.perf_counter()
        torch.autograd.grad(outs, wrt, grad_outputs=grads, allow_unused=True)
        if attempt >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def plan_split_points(plan: Plan) -> list[str]:
    """The layer names where stages 1.. of a straight plan begin (what :func:`split_graph` takes)."""
    replicated = [i for i, stage in enumerate(plan.stages) if stage.replicas != 1]
    if replicated:
        raise ValueError(f"Stages {replicated} of the plan are replicated; splitting a graph takes one worker per "
                         "stage: partition with straight=True.")
    return [stage.layers[0] for stage in plan.stages[1:]]


def choose_split_points(captured: CapturedGraph, module: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                        num_stages: int, *, bandwidth: float = 10e9, method: str = "pipedream",
                        profile: Profile | None = None) -> tuple[list[str], Plan]:
    """Profile the graph (unless ``profile`` is given) and partition it into ``num_stages`` straight stages with
    the existing partitioner; returns the split points (layer names) and the plan."""
    profile = profile if profile is not None else profile_graph(captured, module, args, kwargs)
    if num_stages > len(profile.layers):
        raise ValueError(f"The captured graph has {len(profile.layers)} layers, fewer than the {num_stages} stages "
                         "asked for; use fewer processes.")
    topology = Topology.flat(num_stages, bandwidth)
    plan = (partition(profile, topology, method, straight=True) if method == "pipedream"
            else partition(profile, topology, method))
    return plan_split_points(plan), plan
