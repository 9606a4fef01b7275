"""Split a captured graph into stage programs whose inputs and outputs are tensor trees, and the stage modules."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from lightning_pipedream.graph.capture import CapturedGraph, call_signature


class SplitError(ValueError):
    """The split points (or plan) do not describe a valid split of the captured graph."""


@dataclass
class StageProgram:
    """One stage's share of one capture: a GraphModule called as ``program(*state, *inputs)``.

    It returns the new values of the buffers it updates, then its outputs. Stage 0 takes the call's
    flattened arguments; a later stage takes the values named ``input_names`` of the dict the
    previous stage sends. Every stage but the last returns a dict of the values any later stage needs
    (values only a stage after the next one uses pass through); the last returns the call's outputs.
    """

    index: int
    num_stages: int
    training: bool
    module: GraphModule
    state: list[tuple[str, str]]  # (kind, canonical name) of each leading argument
    input_names: list[str]
    output_names: list[str]
    mutations: list[str]  # buffers whose new values lead the results
    signature: tuple  # the input this program serves (see :func:`input_signature`)
    out_spec: Any = None  # the last stage's output structure
    constant_outputs: dict[int, Any] = field(default_factory=dict)  # last stage: outputs that are not computed
    constants: dict[str, Tensor] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)
    input_vals: list[Any] = field(default_factory=list)  # the capture's fake inputs: shapes and strides
    rebuild_output: Any = None  # last stage: makes the call's own output type (a dataclass) from the plain tree

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass
class GraphSplit:
    """A captured graph cut into stages: one program per stage and which stage holds which state."""

    split_points: list[str]  # as given: layer or module names where stages 1.. begin
    starts: list[int]  # the layer index each stage 1.. begins at
    programs: list[StageProgram]
    owners: dict[str, list[int]]  # canonical parameter/buffer name -> the stages that hold it
    captured: CapturedGraph

    @property
    def num_stages(self) -> int:
        return len(self.programs)

    @property
    def ties(self) -> dict[str, list[int]]:
        """Parameters held by more than one stage: their copies' gradients are summed before each update."""
        kinds = {name: kind for p in self.programs for kind, name in p.state}
        return {name: stages for name, stages in self.owners.items()
                if len(stages) > 1 and kinds.get(name) == "parameter"}



def input_signature(tree: Any, first: bool) -> tuple:
    """The key a stage program is chosen by: the input tree's structure, shapes and dtypes."""
    if first:
        args, kwargs = tree
        return call_signature(args, kwargs)
    return tuple((key, tuple(value.shape), str(value.dtype)) for key, value in tree.items())


def _value_signature(name: str, node: Node) -> tuple:
    val = node.meta["val"]
    return (name, tuple(int(s) for s in val.shape), str(val.dtype))


def resolve_split_points(captured: CapturedGraph, split_points: Sequence[str]) -> list[int]:
    """Layer indices where stages 1.. begin: each point is a layer name or a module name (its first layer)."""
    layers = captured.layers
    by_name = {layer.name: i for i, layer in enumerate(layers)}
    starts = []
    for point in split_points:
        if not isinstance(point, str):
            raise SplitError(f"split_points must be module names (strings), got {point!r}.")
        # A module name: where that module begins (its first layer or its first child's); "name#k" and
        # "(forward)..." are layer names, as plans write them.
        index = next((i for i, layer in enumerate(layers)
                      if layer.module == point or layer.module.startswith(point + ".")), None)
        if index is None or "#" in point:
            index = by_name.get(point, index)
        if index is None:
            known = captured.module_names()
            shown = ", ".join(known[:30]) + (", ..." if len(known) > 30 else "")
            raise SplitError(f"split_points names {point!r}, which is not a module that runs in forward. "
                             f"Modules in the order they run: {shown}.")
        if index == 0:
            raise SplitError(f"split point {point!r} is where the forward starts: it would leave stage 0 empty. "
                             "Name the modules where stages 1, 2, ... begin.")
        if starts and index <= starts[-1]:
            previous = split_points[len(starts) - 1]
            raise SplitError(f"split_points must follow the order the modules run in: {point!r} (layer {index}) does "
                             f"not come after {previous!r} (layer {starts[-1]}).")
        starts.append(index)
    return starts


def split_graph(captured: CapturedGraph, split_points: Sequence[str]) -> GraphSplit:
    """Cut ``captured`` before each of ``split_points`` (layer or module names): ``len(split_points) + 1`` stages."""
    starts = resolve_split_points(captured, split_points)
    num_stages = len(starts) + 1
    graph = captured.graph
    compute = [n for n in graph.nodes if n.op == "call_function"]
    stage_of: dict[Node, int] = {n: bisect.bisect_right(starts, captured.layer_of[n]) for n in compute}
    for node in captured.inputs:
        stage_of[node] = 0

    # Where each value is last needed: its users' stages; the call's outputs are needed by the last stage.
    last_use: dict[Node, int] = {}
    for node in list(captured.inputs) + compute:
        uses = [stage_of[u] for u in node.users if u in stage_of]
        last_use[node] = max(uses, default=stage_of[node])
    for value in captured.outputs:
        if isinstance(value, Node):
            if value not in stage_of:
                raise SplitError(f"The call returns {value.name}, a parameter or buffer itself; return a computed "
                                 "value, or use an nn.Sequential.")
            last_use[value] = num_stages - 1

    crossing: list[list[Node]] = [[] for _ in range(num_stages)]  # crossing[b]: values sent from b-1 to b
    for node, last in last_use.items():
        for b in range(stage_of[node] + 1, last + 1):
            crossing[b].append(node)
    for b in range(1, num_stages):
        for node in crossing[b]:
            if not isinstance(node.meta.get("val"), Tensor):
                raise SplitError(
                    f"{node.name} ({node.target}, in module {_module_text(node)}) would cross from stage {b - 1} to "
                    f"stage {b}, but it is a {type(node.meta.get('val')).__name__}, not a tensor. Choose other "
                    "split_points."
                )

    # State: every stage holds the parameters and buffers its nodes read; unused state goes to stage 0.
    owners: dict[str, list[int]] = {}
    for placeholder, (kind, name) in captured.state.items():
        stages = sorted({stage_of[u] for u in placeholder.users if u in stage_of})
        if kind != "constant":
            owners.setdefault(name, [])
            owners[name] = sorted(set(owners[name]) | set(stages))
    for name in list(owners):
        owners[name] = owners[name] or [0]
    mutation_stage: dict[str, int] = {}
    for name, node in captured.mutations.items():
        if node not in stage_of:
            continue  # unchanged
        mutation_stage[name] = stage_of[node]
        if owners.get(name, [stage_of[node]]) != [stage_of[node]]:
            raise SplitError(
                f"Buffer {name} is updated on stage {stage_of[node]} but read on stages {owners[name]}; its copies "
                "would drift apart. Choose split_points that keep its users in one stage."
            )

    programs = []
    for s in range(num_stages):
        nodes = [n for n in compute if stage_of[n] == s]
        if s == 0:
            inputs, input_names = list(captured.inputs), []
        else:
            inputs = crossing[s]
            input_names = [n.name for n in inputs]
        is_last = s == num_stages - 1
        outputs: list[Any] = list(captured.outputs) if is_last else crossing[s + 1]
        mutations = [name for name, stage in mutation_stage.items() if stage == s]
        program = stage_program(captured, nodes, inputs, outputs, [captured.mutations[m] for m in mutations])
        state_nodes = [p for p in captured.state if any(stage_of.get(u) == s for u in p.users)]
        signature = (call_signature(*_example_call(captured)) if s == 0
                     else tuple(_value_signature(n.name, n) for n in inputs))
        constants = {captured.state[p][1]: captured.constants[captured.state[p][1]]
                     for p in state_nodes if captured.state[p][0] == "constant"}
        first_layer = starts[s - 1] if s > 0 else 0
        end_layer = starts[s] if s < len(starts) else len(captured.layers)
        programs.append(StageProgram(
            index=s, num_stages=num_stages, training=captured.training, module=program,
            state=[captured.state[p] for p in state_nodes], input_names=input_names,
            output_names=[] if is_last else [n.name for n in outputs], mutations=mutations, signature=signature,
            out_spec=captured.out_spec if is_last else None,
            constant_outputs={i: v for i, v in enumerate(outputs) if not isinstance(v, Node)} if is_last else {},
            constants=constants, layers=captured.layer_names[first_layer:end_layer],
            input_vals=[n.meta.get("val") for n in inputs],
            rebuild_output=captured.rebuild_output if is_last else None,
        ))
    return GraphSplit(list(split_points), starts, programs, owners, captured)


def _module_text(node: Node) -> str:
    from lightning_pipedream.graph.capture import module_of

    return module_of(node) or "the model's forward"


def _example_call(captured: CapturedGraph) -> tuple[tuple, dict]:
    """Fake tensors shaped like the example call, to recompute its signature."""
    leaves = [n.meta["val"] for n in captured.inputs]
    args, kwargs = pytree.tree_unflatten(leaves, captured.in_spec)
    return args, kwargs


def stage_program(captured: CapturedGraph, nodes: list[Node], inputs: list[Node], outputs: list[Any],
             mutations: list[Node]) -> GraphModule:
    """A GraphModule running ``nodes``: arguments are the state they read, then ``inputs``; it returns
    ``mutations`` then ``outputs`` (nodes, or constants returned as they are)."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    members = set(nodes)
    for placeholder in captured.state:
        if any(u in members for u in placeholder.users):
            env[placeholder] = graph.placeholder(placeholder.name)
    for node in inputs:
        env[node] = graph.placeholder(node.name)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    results = [env[n] for n in mutations] + [env[v] if isinstance(v, Node) else v for v in outputs]
    graph.output(tuple(results))
    graph.lint()
    return GraphModule(nn.Module(), graph)


def get_path(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class GraphStage(nn.Module):
    """One pipeline stage of a captured model: its own copies of the parameters and buffers it uses,
    registered under the model's own names (so its ``state_dict`` keys are the model's), and the stage
    programs of every capture (input signature and train/eval mode) it was given.

    ``forward`` takes one tensor tree, as the runtime's Stage calls it: stage 0 takes ``(args, kwargs)`` of
    the model's call, a later stage the dict the previous one returns; the last returns what the model returns.
    """

    def __init__(self, module: nn.Module, split: GraphSplit, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_stages = split.num_stages
        self.owned = sorted(name for name, stages in split.owners.items() if index in stages)
        self.ties = {name: stages for name, stages in split.ties.items() if index in stages}
        self._aliases = split.captured.aliases
        self._programs: dict[tuple[bool, tuple], StageProgram] = {}
        # Register in the model's own order, so that containers, state_dict keys and the first name of a tied
        # parameter come out as in the model.
        order = {key: i for i, key in enumerate(module.state_dict(keep_vars=True))}
        entries = [(alias, name) for name in self.owned for alias in self._aliases.get(name, [name])]
        entries.sort(key=lambda entry: order.get(entry[0], len(order)))
        values: dict[str, Tensor] = {}
        for alias, name in entries:
            if name not in values:
                tensor = get_path(module, name)
                # A tied parameter gets a copy per stage, as separate ranks would hold; the rest stay shared.
                if isinstance(tensor, nn.Parameter) and name in split.ties:
                    tensor = nn.Parameter(tensor.detach().clone(), tensor.requires_grad)
                values[name] = tensor
            value = values[name]
            container, leaf = self._container(alias), alias.rsplit(".", 1)[-1]
            if isinstance(value, nn.Parameter):
                container.register_parameter(leaf, value)
            else:
                container.register_buffer(leaf, value, persistent=alias in split.captured.persistent)
        self.add_split(split)

    def _container(self, name: str) -> nn.Module:
        module: nn.Module = self
        for part in name.split(".")[:-1]:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        return module

    def canonical_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters under their canonical names (a tied parameter's first name in the model)."""
        return {name: get_path(self, name) for name in self.owned if isinstance(get_path(self, name), nn.Parameter)}

    def add_split(self, split: GraphSplit) -> None:
        """Add this stage's program of another capture (another input signature or mode) of the same model."""
        if split.num_stages != self.num_stages:
            raise SplitError(f"This stage belongs to a {self.num_stages}-stage split; the new capture was split "
                             f"into {split.num_stages} stages. Use the same split_points.")
        program = split.programs[self.index]
        # The stage can run the new program if it holds everything the program reads. (Ownership of state a
        # capture does not read may differ: BatchNorm's counters are read in training and not in evaluation.)
        missing = sorted({name for kind, name in program.state if kind != "constant"} - set(self.owned))
        if missing:
            raise SplitError(f"The new capture needs parameters or buffers on stage {self.index} that it does not "
                             f"hold ({missing[:5]}); capture it with the same split_points.")
        self._programs[(program.training, program.signature)] = program

    def forward(self, inputs: Any) -> Any:
        signature = input_signature(inputs, self.index == 0)
        program = self._programs.get((self.training, signature))
        if program is None:
            mode = "training" if self.training else "evaluation"
            raise KeyError(
                f"Stage {self.index} has no captured graph for this input in {mode} mode (signature {signature}); "
                f"it knows {len(self._programs)} other(s). Capture the model for this batch shape and mode "
                "(capture + split_graph with the same split_points) and add it with add_split."
            )
        state = [program.constants[name] if kind == "constant" else get_path(self, name)
                 for kind, name in program.state]
        if program.is_first:
            args, kwargs = inputs
            flat = pytree.tree_leaves((tuple(args), dict(kwargs)))
        else:
            flat = [inputs[name] for name in program.input_names]
        flat = [_as_captured(value, val) for value, val in zip(flat, program.input_vals)]
        results = program.module(*state, *flat)
        count = len(program.mutations)
        # Write new buffer values (BatchNorm statistics) as eager BatchNorm does, in place; through .data, whose
        # version counter is not the one autograd checks: the op's backward saved the old buffer but never reads it.
        with torch.no_grad():
            for name, value in zip(program.mutations, results[:count]):
                get_path(self, name).data.copy_(value)
        outputs = list(results[count:])
        if program.is_last:
            tree = pytree.tree_unflatten(outputs, program.out_spec)
            return tree if program.rebuild_output is None else program.rebuild_output(tree)
        return dict(zip(program.output_names, outputs))


def _as_captured(value: Any, val: Any) -> Any:
    """``value`` laid out in memory as in the capture: the graph's views assume those strides, and a tensor that
    crossed processes arrives contiguous. (Expanded layouts, with stride 0, are left contiguous.)"""
    if not isinstance(value, Tensor) or not isinstance(val, Tensor):
        return value
    stride = tuple(int(s) for s in val.stride())
    if value.stride() == stride or value.shape != val.shape or 0 in stride or value.numel() <= 1:
        return value
    laid_out = torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device)
    return laid_out.copy_(value)  # differentiable: the gradient reaches ``value``


def build_stages(module: nn.Module, split: GraphSplit, indices: Sequence[int] | None = None) -> list[GraphStage]:
    """The stage modules of ``split`` (all, or those in ``indices``), holding ``module``'s parameters and buffers."""
    wanted = range(split.num_stages) if indices is None else indices
    return [GraphStage(module, split, index) for index in wanted]


def consolidate_state_dict(parts: Sequence[dict[str, Tensor]], reference_keys: Sequence[str]) -> dict[str, Tensor]:
    """Merge the stages' state dicts (their keys are already the model's names) into the model's own
    ``state_dict`` order; a tied parameter appears once per name, and its copies must agree."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key in merged and not torch.equal(merged[key], value):
                raise ValueError(f"The stages hold different values of {key}: its tied copies drifted apart.")
            merged.setdefault(key, value)
    missing = [k for k in reference_keys if k not in merged]
    extra = [k for k in merged if k not in set(reference_keys)]
    if missing or extra:
        raise ValueError(f"The stages' state does not match the model's: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}.")
    return {key: merged[key] for key in reference_keys}
