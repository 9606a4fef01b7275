"""Capture a module's forward call into a functional ATen graph (torch.export), grouped into layers by module."""

from __future__ import annotations

import operator
import os
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node

ROOT = "(forward)"  # the layer name of nodes that run in the model's own forward, outside any child module

# Where torch's own sources live: a failing trace is reported at the first frame outside them.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN_DIR = os.path.join(os.path.dirname(torch.__file__), "nn") + os.sep


class GraphCaptureError(RuntimeError):
    """The model's forward call could not be captured into a graph."""


@dataclass
class Layer:
    """Consecutive graph nodes that run in one module (its innermost module's name), the unit of profiling and cuts."""

    name: str
    module: str  # dotted module name, "" for the model's own forward
    nodes: list[Node] = field(default_factory=list)


@dataclass
class CapturedGraph:
    """One capture of ``module(*args, **kwargs)``: a functional ATen graph specialised to the example's shapes.

    Placeholders are the model's parameters, buffers and lifted constants, then the flattened call
    arguments; the output holds the new values of mutated buffers (BatchNorm statistics) and then the
    call's outputs. ``layers`` groups the compute nodes by the module they run in, in graph order.
    """

    program: torch.export.ExportedProgram
    training: bool
    signature: tuple  # the call's tree structure, shapes and dtypes: which inputs this capture serves
    state: dict[Node, tuple[str, str]]  # placeholder -> ("parameter"|"buffer"|"constant", canonical name)
    inputs: list[Node]  # placeholders of the flattened call arguments, in pytree order
    outputs: list[Any]  # the call's flattened outputs: nodes or constants
    mutations: dict[str, Node]  # buffer name -> node computing its new value
    layers: list[Layer]
    layer_of: dict[Node, int]
    aliases: dict[str, list[str]]  # canonical parameter/buffer name -> every name the module's state_dict uses
    persistent: set[str]  # buffers that belong in the state dict
    constants: dict[str, torch.Tensor]
    method: str  # "export" or "draft_export"

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph

    @property
    def in_spec(self) -> Any:
        return self.program.call_spec.in_spec

    @property
    def out_spec(self) -> Any:
        return self.program.call_spec.out_spec

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def module_names(self) -> list[str]:
        """The modules whose code appears in the graph, in the order they first run."""
        names: dict[str, None] = {}
        for layer in self.layers:
            parts = layer.module.split(".") if layer.module else []
            for k in range(1, len(parts) + 1):
                names.setdefault(".".join(parts[:k]))
        return list(names)


def call_signature(args: tuple, kwargs: dict[str, Any] | None = None) -> tuple:
    """What a capture is specialised to: the call's tree structure and each tensor's shape and dtype."""
    leaves, spec = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    described = tuple(
        (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else ("const", repr(x)) for x in leaves
    )
    return (str(spec), described)


def capture(module: nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None,
            through: str | None = None) -> CapturedGraph:
    """Trace ``module(*args, **kwargs)`` into a functional graph, in the module's current train/eval mode.

    ``through``: trace the call of that submodule instead of ``module.forward`` (whose own code may not
    trace); names in the graph stay relative to ``module``.

    torch.export (non-strict) first; when only a data-dependent check inside torch itself stops it
    (nn.Transformer's test whether a mask is causal), torch.export.draft_export, which keeps the
    example's branch and asserts it at run time. The graph is specialised to the example's shapes:
    capture once per input signature (see :func:`call_signature`) and per mode.
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    method = "export"
    with warnings.catch_warnings(), _forward_through(module, through):
        warnings.simplefilter("ignore")  # export's advice on LSTM flat weights and the like is not the user's concern
        try:
            program = torch.export.export(module, args, kwargs, strict=False)
        except Exception as err:  # noqa: BLE001 - every failure gets the same way out
            where = _user_frame(err)
            if where is not None:
                raise GraphCaptureError(_capture_message(module, err, where)) from err
            # The failing check is torch's own (e.g. nn.Transformer's causal-mask test): keep the example's branch.
            try:
                program = torch.export.draft_export(module, args, kwargs, strict=False)
            except Exception as err2:  # noqa: BLE001
                raise GraphCaptureError(_capture_message(module, err2, _user_frame(err2))) from err2
            method = "draft_export"
            _check_draft_report(module, program)
        # Out-of-place ops only: a value that crosses stages must not be changed in place on either side.
        program = program.run_decompositions({})
    return _describe(module, program, args, kwargs, method)


@contextmanager
def _forward_through(module: nn.Module, name: str | None) -> Iterator[None]:
    """While tracing, ``module``'s forward only calls its submodule ``name`` (an instance attribute shadows it)."""
    if name is None:
        yield
        return
    submodule = module.get_submodule(name)
    module.forward = lambda *args, **kwargs: submodule(*args, **kwargs)
    try:
        yield
    finally:
        del module.forward


def _failing_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The deepest frame of model code (the user's files, or torch.nn's modules) where tracing failed."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:  # export re-raises; the root cause holds the model frames
        chain.append(current)
        current = current.__cause__ or current.__context__
    for exc in reversed(chain):
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_model_code(f.filename)]
        if frames:
            return frames[-1]
    return None


def _is_model_code(filename: str) -> bool:
    if "lightning_pipedream" in filename:
        return False
    return not filename.startswith(_TORCH_DIR) or filename.startswith(_TORCH_NN_DIR)


def _user_frame(err: BaseException) -> str | None:
    """Where tracing failed, as 'file:line in fn: code', when that is the user's code (None when it is torch's)."""
    frame = _failing_frame(err)
    if frame is None or frame.filename.startswith(_TORCH_DIR):
        return None
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _capture_message(module: nn.Module, err: BaseException, where: str | None) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    at = f" at {where}" if where else ""
    return (
        f"Could not trace {type(module).__name__}.forward into a graph{at} ({type(err).__name__}: {first}). "
        "Data-dependent Python control flow (an `if` on a tensor's value, .item(), .tolist()) and some ops cannot "
        "be traced. Move the branch out of forward (into training_step, say); or name where stages begin, "
        "PipeDreamStrategy(split_points=['model.layers.4', ...]): then only the innermost module holding them "
        "that the step calls is traced, and the code around it runs as it is on the first and last stages; "
        "or put the layers in one nn.Sequential attribute: PipeDreamStrategy splits that without tracing."
    )


def _check_draft_report(module: nn.Module, program: torch.export.ExportedProgram) -> None:
    """draft_export turns a data-dependent branch into the example's branch plus a run-time assert (a different
    branch later fails loudly); any other problem it papered over (an op's fake kernel disagreeing) is refused."""
    report = getattr(program, "_report", None)
    for failure in getattr(report, "failures", []) or []:
        kind = getattr(failure.failure_type, "name", str(failure.failure_type))
        if kind != "DATA_DEPENDENT_ERROR":
            raise GraphCaptureError(_capture_message(module, RuntimeError(f"draft_export reported {kind}"),
                                                     _report_location(failure)))


def _report_location(failure: Any) -> str | None:
    """The last user frame draft_export recorded for a failure (file names are interned in torch's log table)."""
    stack = (getattr(failure, "data", None) or {}).get("user_stack") or []
    if not stack or not isinstance(stack[-1], dict):
        return None
    frame = stack[-1]
    filename = frame.get("filename")
    if isinstance(filename, int):
        try:
            from torch._logging import structured

            filename = {v: k for k, v in structured.INTERN_TABLE.items()}.get(filename, filename)
        except Exception:  # noqa: BLE001 - a private table; the line number still helps
            pass
    return f"{filename}:{frame.get('line')} in {frame.get('name')}: {frame.get('loc', '')}"


def _describe(module: nn.Module, program: torch.export.ExportedProgram, args: tuple, kwargs: dict,
              method: str) -> CapturedGraph:
    signature = program.graph_signature
    canonical: dict[str, str] = {}  # any name -> the first name of the same tensor
    aliases: dict[str, list[str]] = {}
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        first_name: dict[int, str] = {}
        for name, tensor in named:
            first = first_name.setdefault(id(tensor), name)
            canonical[name] = first
            aliases.setdefault(first, []).append(name)
    persistent = set(module.state_dict(keep_vars=True))
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    state: dict[Node, tuple[str, str]] = {}
    inputs: list[Node] = []
    kinds = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
             InputKind.CONSTANT_TENSOR: "constant"}
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            inputs.append(node)
        elif spec.kind in kinds:
            name = spec.target if spec.kind == InputKind.CONSTANT_TENSOR else canonical.get(spec.target, spec.target)
            state[node] = (kinds[spec.kind], name)
        else:
            raise GraphCaptureError(f"The captured graph takes a {spec.kind.name} input ({spec.target}), which "
                                    "pipeline stages do not support; use split_points or an nn.Sequential.")
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    results = list(output_node.args[0])
    mutations: dict[str, Node] = {}
    outputs: list[Any] = []
    for value, spec in zip(results, signature.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutations[canonical.get(spec.target, spec.target)] = value
        elif spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(value)
        else:
            raise GraphCaptureError(f"The captured graph mutates {spec.target} ({spec.kind.name}); only buffers may "
                                    "change during forward. Use split_points or an nn.Sequential.")
    layers, layer_of = _layers(program.graph)
    constants = {k: v for k, v in program.constants.items() if isinstance(v, torch.Tensor)}
    return CapturedGraph(
        program=program, training=module.training, signature=call_signature(args, kwargs), state=state,
        inputs=inputs, outputs=outputs, mutations=mutations, layers=layers, layer_of=layer_of,
        aliases=aliases, persistent=persistent, constants=constants, method=method,
    )


def module_of(node: Node) -> str:
    """The innermost module a node ran in ("" for the model's own forward)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


def is_follower(node: Node) -> bool:
    """Nodes that must run where their input is computed: a getitem out of a tuple-valued op, and scalar
    bookkeeping (data-dependent symbols and their run-time asserts), which never cross a stage boundary."""
    if node.target is operator.getitem:
        return True
    return not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list))


def _layers(graph: torch.fx.Graph) -> tuple[list[Layer], dict[Node, int]]:
    """Runs of consecutive compute nodes in one module; followers join their latest input's layer."""
    layers: list[Layer] = []
    layer_of: dict[Node, int] = {}
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        producers = [layer_of[a] for a in node.all_input_nodes if a in layer_of]
        if is_follower(node) and producers:
            index = max(producers)
            layers[index].nodes.append(node)
            layer_of[node] = index
            continue
        module = module_of(node)
        if not layers or layers[-1].module != module:
            counts[module] = counts.get(module, 0) + 1
            base = module or ROOT
            name = base if counts[module] == 1 else f"{base}#{counts[module]}"
            layers.append(Layer(name, module))
        layers[-1].nodes.append(node)
        layer_of[node] = len(layers) - 1
    if not layers:
        raise GraphCaptureError("The captured forward computes nothing; there is nothing to split into stages.")
    # A plain module name means where that module (with its children) begins. A container's own first run that
    # comes after one of its children's is not that place: it is "name#1", as its later runs are "name#2", ...
    for index, layer in enumerate(layers):
        if layer.name == layer.module and any(
            other.module.startswith(layer.module + ".") for other in layers[:index]
        ):
            layer.name = f"{layer.module}#1"
    return layers, layer_of
