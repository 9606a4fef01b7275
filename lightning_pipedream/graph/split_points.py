"""Profile a captured graph layer by layer into the partitioner's Profile (a DAG), and turn a Plan into split points."""

from __future__ import annotations

import dataclasses
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


def _fastest(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls: the least disturbed by other processes, so the steadiest figure."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def profile_graph(captured: CapturedGraph, module: nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None,
                  *, warmup: int = 1, repeats: int = 5) -> Profile:
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
            forward_s = _fastest(lambda: program(*state_args, *in_args), warmup, repeats)
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
    return min(samples)


def plan_split_points(plan: Plan) -> list[str]:
    """The layer names where stages 1.. of a straight plan begin (what :func:`split_graph` takes)."""
    replicated = [i for i, stage in enumerate(plan.stages) if stage.replicas != 1]
    if replicated:
        raise ValueError(f"Stages {replicated} of the plan are replicated; splitting a graph takes one worker per "
                         "stage: partition with straight=True.")
    return [stage.layers[0] for stage in plan.stages[1:]]


def choose_split_points(captured: CapturedGraph, module: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                        num_stages: int, *, bandwidth: float = 10e9, method: str = "pipedream",
                        profile: Profile | None = None, tolerance: float = 0.1) -> tuple[list[str], Plan]:
    """Profile the graph (unless ``profile`` is given) and partition it into ``num_stages`` straight stages with
    the existing partitioner; returns the split points (layer names) and the plan.

    The same model and settings get the same split points: a capture of the same module structure reuses its
    profile in this process, and the measured times are made steady before partitioning (layers that run the
    same ops on the same shapes, such as a model's repeated blocks, share their median time; every time is
    rounded to 1/256 of the total). Cuts go between the model's largest modules that still give a plan within
    ``tolerance`` of the best one (between blocks, not inside one), so timing noise does not move them.
    """
    if profile is None:
        cache_key = (captured.key, id(type(module))) if captured.key is not None else None
        profile = _PROFILES.get(cache_key) if cache_key is not None else None
        if profile is None:
            profile = profile_graph(captured, module, args, kwargs)
            if cache_key is not None:
                _PROFILES[cache_key] = profile
                while len(_PROFILES) > 16:
                    _PROFILES.pop(next(iter(_PROFILES)))
    if num_stages > len(profile.layers):
        raise ValueError(f"The captured graph has {len(profile.layers)} layers, fewer than the {num_stages} stages "
                         "asked for; use fewer processes.")
    topology = Topology.flat(num_stages, bandwidth)

    def plan_of(steady: Profile) -> Plan:
        return (partition(steady, topology, method, straight=True) if method == "pipedream"
                else partition(steady, topology, method))

    steady = steady_profile(profile, captured)
    best = plan_of(steady)
    for depth in range(1, _max_depth(module, captured) + 1):
        allowed = unit_starts(module, captured, depth)
        if len(allowed) < num_stages - 1:
            continue
        barred = sorted(set(steady.no_cut_after) | {i for i in range(len(steady.layers) - 1) if i + 1 not in allowed})
        coarse = plan_of(dataclasses.replace(steady, no_cut_after=barred))
        if coarse.time_per_minibatch <= best.time_per_minibatch * (1 + tolerance):
            return module_names(module, captured, plan_split_points(coarse)), coarse
    return module_names(module, captured, plan_split_points(best)), best


def module_names(module: nn.Module, captured: CapturedGraph, points: list[str]) -> list[str]:
    """Each split point as the outermost module that begins there ("blocks.2" rather than "blocks.2.ln1"), which
    names the same cut (see resolve_split_points), else as the layer name."""
    index_of = {layer.name: i for i, layer in enumerate(captured.layers)}
    named = []
    for point in points:
        index = index_of[point]
        path = captured.layers[index].module
        parts = path.split(".") if path and "#" not in point else []
        name = point
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if isinstance(module.get_submodule(prefix), _CONTAINERS):
                continue
            first = next(i for i, layer in enumerate(captured.layers)
                         if layer.module == prefix or layer.module.startswith(prefix + "."))
            if first == index:
                name = prefix
                break
        named.append(name)
    return named


_PROFILES: dict[Any, Profile] = {}  # per capture structure: a second fit of the same model profiles nothing


def steady_profile(profile: Profile, captured: CapturedGraph, steps: int = 256) -> Profile:
    """``profile`` with times that noise moves less: layers running the same ops on the same shapes take their
    median time, and every time is rounded to ``1/steps`` of the total compute."""
    if len(profile.layers) != len(captured.layers):
        return profile  # not this capture's profile (given by the caller): leave it as it is
    groups: dict[tuple, list[int]] = {}
    for index, layer in enumerate(captured.layers):
        groups.setdefault(_layer_signature(layer.nodes), []).append(index)
    forward = [layer.forward_s for layer in profile.layers]
    backward = [layer.backward_s for layer in profile.layers]
    for members in groups.values():
        f, b = statistics.median(forward[i] for i in members), statistics.median(backward[i] for i in members)
        for i in members:
            forward[i], backward[i] = f, b
    quantum = (sum(forward) + sum(backward)) / steps or 1.0
    layers = [dataclasses.replace(layer, forward_s=round(f / quantum) * quantum,
                                  backward_s=round(b / quantum) * quantum)
              for layer, f, b in zip(profile.layers, forward, backward)]
    return dataclasses.replace(profile, layers=layers)


def _layer_signature(nodes: list[Node]) -> tuple:
    """The ops of a layer and the shapes they produce: equal for a model's repeated blocks."""
    def shape(node: Node) -> Any:
        val = node.meta.get("val")
        return tuple(val.shape) if isinstance(val, Tensor) else None

    return tuple((str(n.target), shape(n)) for n in nodes)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _unit(module: nn.Module, path: str, depth: int) -> str:
    """The module at ``depth`` that ``path`` runs in (containers such as ModuleList do not count as a level)."""
    if not path:
        return ""
    parts, level, current = path.split("."), 0, module
    for k, part in enumerate(parts):
        current = getattr(current, part, None) if current is not None else None
        if not isinstance(current, _CONTAINERS):
            level += 1
        if level == depth:
            return ".".join(parts[: k + 1])
    return path


def _max_depth(module: nn.Module, captured: CapturedGraph) -> int:
    return max((len(layer.module.split(".")) for layer in captured.layers if layer.module), default=1)


def unit_starts(module: nn.Module, captured: CapturedGraph, depth: int) -> set[int]:
    """Layers where a new module at ``depth`` begins (a cut may go before them)."""
    units = [(_unit(module, layer.module, depth), layer.module == "") for layer in captured.layers]
    return {i for i in range(1, len(units)) if units[i] != units[i - 1] or units[i][1]}
