"""Capture a module's forward call into a functional ATen graph (torch.export), grouped into layers by module."""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import os
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node
from torch.utils import _pytree as pytree

log = logging.getLogger("lightning_pipedream.graph")

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
    # Rebuilds the call's own output type (a dataclass, an HF ModelOutput) from the traced plain tree; None when the
    # output was a plain tensor tree already.
    rebuild_output: Callable[[Any], Any] | None = None
    capture_s: float = 0.0  # wall time of the trace (0.0 when it came from the cache)
    cached: bool = False  # whether this capture came from the in-process cache
    key: tuple | None = None  # the module structure and call it was captured for (see structure_key)
    # What the output held that is not a tensor and was dropped: (where in the output, type name), e.g.
    # ("output.past_key_values", "DynamicCache")
    dropped: list[tuple[str, str]] = field(default_factory=list)

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
            through: str | None = None, *, cache: bool = True, on_meta: bool = False) -> CapturedGraph:
    """Trace ``module(*args, **kwargs)`` into a functional graph, in the module's current train/eval mode.

    ``through``: trace the call of that submodule instead of ``module.forward`` (whose own code may not
    trace); names in the graph stay relative to ``module``.

    torch.export (non-strict) first; when only a data-dependent check inside torch itself stops it
    (nn.Transformer's test whether a mask is causal), torch.export.draft_export, which keeps the
    example's branch and asserts it at run time. The graph is specialised to the example's shapes:
    capture once per input signature (see :func:`call_signature`) and per mode.

    An output that torch's pytree does not know (a dataclass, an object holding a cache such as Hugging Face's
    ``DynamicCache``) is traced as a plain tree: its tensors travel, and ``rebuild_output`` makes the call's own
    type again on the last stage; a value that is neither a tensor, a constant nor a container (a cache object)
    cannot cross processes and is dropped (None) with a warning that names it.

    ``cache``: a module of the same structure (classes and their forward code, parameter and buffer names,
    shapes and dtypes, modes, plain attributes) captured for the same call signature before, in this process,
    is not traced again (see :func:`structure_key`); the graph reads the module's own weights when it runs.

    ``on_meta``: trace with every parameter, buffer and argument on the meta device (shapes only: a model built on
    meta, or one whose other stages' weights this process never holds), then point the graph's device arguments
    (``arange(..., device=)``, ``.to(device)``) at the device of the call's own tensors, where the stages run.
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    if on_meta:
        return _capture_on_meta(module, args, kwargs, through, cache)
    key = structure_key(module, args, kwargs, through) if cache else None
    hit = _CACHE.get(key) if key is not None else None
    if hit is not None:
        _CACHE.move_to_end(key)
        return dataclasses.replace(hit, constants=_refreshed_constants(module, hit.constants), capture_s=0.0,
                                   cached=True)
    started = time.perf_counter()
    method = "export"
    plain = _PlainOutput(type(module).__name__)
    with warnings.catch_warnings(), _forward_for_export(module, through, plain):
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
                where = _user_frame(err2) or _forward_line(module, through)
                raise GraphCaptureError(_capture_message(module, err2, where)) from err2
            method = "draft_export"
            _check_draft_report(module, program)
        # Out-of-place ops only: a value that crosses stages must not be changed in place on either side.
        program = program.run_decompositions({})
    dropped = list(plain.dropped)
    plain.warn_dropped()
    captured = _describe(module, program, args, kwargs, method)
    captured.dropped = dropped
    # The stages read the module's own weights; the program's references to them would keep this module's weights
    # alive as long as the capture is cached.
    program._state_dict = {k: torch.empty_like(v, device="meta") for k, v in program.state_dict.items()}
    captured.rebuild_output = plain.rebuild
    captured.capture_s = time.perf_counter() - started
    captured.key = key
    if key is not None:
        _CACHE[key] = captured
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return captured


def _capture_on_meta(module: nn.Module, args: tuple, kwargs: dict[str, Any], through: str | None,
                     cache: bool) -> CapturedGraph:
    devices = [t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = devices[0] if devices else torch.device("cpu")
    to_meta = functools.partial(pytree.tree_map_only, torch.Tensor, lambda t: t.to("meta"))
    with _state_on_meta(module):
        captured = capture(module, to_meta(args), to_meta(kwargs), through, cache=False)
    unknown = _constants_on_device(captured, device)
    if unknown:
        raise GraphCaptureError(_unknown_constants_message(module, unknown, captured.dropped))
    _point_devices(captured.graph, device)
    captured.signature = call_signature(args, kwargs)
    return captured


def _constants_on_device(captured: CapturedGraph, device: torch.device) -> list[str]:
    """A meta trace's tensor constants that have no values to know, made on ``device``: the empty ones (Hugging
    Face's ``DynamicCache`` starts each layer's keys and values as ``torch.tensor([])`` on the inputs' device, then
    concatenates onto them). Returns the names of those whose values the trace cannot know (a non-empty constant
    on the meta device)."""
    unknown = []
    for kind, name in captured.state.values():
        value = captured.constants.get(name) if kind == "constant" else None
        if value is None or not value.is_meta:
            continue
        if value.numel() == 0:
            captured.constants[name] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                                           device=device)
        else:
            unknown.append(name)
    return unknown


def _unknown_constants_message(module: nn.Module, names: list[str], dropped: list[tuple[str, str]]) -> str:
    """Why a meta trace's constants have no values, and what to do: a cache the output holds (use_cache=False), a
    tensor the forward makes from Python data on its inputs' device, or a tensor attribute that is not a buffer."""
    cls = type(module).__name__
    shown = names[:4] + ([f"... {len(names) - 4} more"] if len(names) > 4 else [])
    made = [n for n in names if n.rsplit(".", 1)[-1].startswith("lifted_tensor")]
    caches = [(where, kind) for where, kind in dropped if "cache" in kind.lower() or "cache" in where.lower()]
    if made and caches:
        where, kind = caches[0]
        return (f"{cls}.forward fills a {kind} (at `{where}` in its output) with tensors {shown} whose values a "
                "trace on the meta device cannot know: a cache of past keys and values, which the forward keeps "
                "because use_cache is on. Training has no use for it: pass use_cache=False to the model's call "
                "(self.model(..., use_cache=False)) or set it in the model's config (config.use_cache = False) "
                "before building the model.")
    if made:
        return (f"{cls}.forward makes tensors {shown} from Python data on the device of its inputs (such as "
                "torch.tensor([...], device=x.device)); on the meta device, where a model built in configure_model "
                "is traced, their values are lost. Make them on the CPU and move them, torch.tensor([...]).to("
                "x.device), or register them as buffers (register_buffer, set in the module's __init__ or "
                "reset_parameters()); or build the model on a real device.")
    return (f"{cls} holds tensor attributes {shown} on the meta device that are neither parameters nor buffers, so "
            "no checkpoint or initialization gives them values and a trace on the meta device cannot know them. "
            "Register them as buffers (register_buffer, set in the module's reset_parameters()), or build the model "
            "on a real device.")


@contextmanager
def _state_on_meta(module: nn.Module) -> Iterator[None]:
    """Every parameter and buffer of ``module`` replaced by a meta tensor of its shape (tied ones stay tied) for
    the duration, then put back: what the trace sees of the weights is their shapes."""
    saved: list[tuple[nn.Module, dict, str, Any]] = []
    made: dict[int, Any] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for leaf, value in table.items():
                if value is None or value.is_meta:
                    continue
                if id(value) not in made:
                    meta = torch.empty_like(value, device="meta")
                    made[id(value)] = nn.Parameter(meta, value.requires_grad) if isinstance(value, nn.Parameter) \
                        else meta
                saved.append((sub, table, leaf, value))
                table[leaf] = made[id(value)]
    try:
        yield
    finally:
        for _, table, leaf, value in saved:
            table[leaf] = value


def _point_devices(graph: torch.fx.Graph, device: torch.device) -> None:
    """Replace the meta device in the graph's arguments (factory functions, copies, metadata asserts) by
    ``device``."""
    def fix(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    for node in graph.nodes:
        if node.op == "call_function":
            node.args = pytree.tree_map(fix, node.args)
            node.kwargs = pytree.tree_map(fix, node.kwargs)


CACHE_SIZE = 16  # captures kept per process (each holds a graph and its shape metadata, not the weights)
_CACHE: OrderedDict[tuple, CapturedGraph] = OrderedDict()


def clear_capture_cache() -> None:
    """Forget every capture kept in this process (the next :func:`capture` traces again)."""
    _CACHE.clear()


_PLAIN_ATTRIBUTE = (bool, int, float, str, type(None))
# Public attributes that are not settings a forward may read (modules and tensors are keyed by their own names).
_NOT_SETTINGS = (nn.Module, torch.Tensor, dict, list, tuple, set)


def _attribute_key(value: Any) -> Any:
    """A plain attribute as it is; another object (a Hugging Face config, say) by its repr, which lists its settings,
    or by its identity when the repr is only its address (then only the same object hits the cache)."""
    if isinstance(value, _PLAIN_ATTRIBUTE):
        return value
    text = repr(value)
    return text if " at 0x" not in text else ("object", id(value))


def structure_key(module: nn.Module, args: tuple, kwargs: dict[str, Any] | None, through: str | None) -> tuple:
    """What a capture depends on besides the weights' values: each submodule's class (its forward code), mode,
    plain attributes (flags, rates) and its parameters' and buffers' names, shapes, dtypes and sharing, and the
    call's signature. Two modules with equal keys trace to the same graph."""
    parts: list[Any] = [through, call_signature(args, kwargs)]
    for name, sub in module.named_modules(remove_duplicate=False):
        attributes = tuple(sorted((k, _attribute_key(v)) for k, v in vars(sub).items()
                                  if isinstance(v, _PLAIN_ATTRIBUTE) and not k.startswith("__")
                                  or not k.startswith("_") and not isinstance(v, _NOT_SETTINGS)))
        parts.append((name, type(sub), type(sub).forward, sub.training, attributes))
    seen: dict[int, str] = {}
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, t in named:
            parts.append((name, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad,
                          seen.setdefault(id(t), name)))
    return tuple(parts)


def _refreshed_constants(module: nn.Module, constants: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A cached capture's tensor constants, taken from ``module`` where they are its attributes (a plain tensor
    attribute, such as a fixed mask, may hold other values in another instance of the same structure)."""
    fresh = {}
    for name, value in constants.items():
        try:
            current: Any = module
            for part in name.split("."):
                current = getattr(current, part)
        except AttributeError:  # a tensor the forward made (lifted by export): the code, not the instance, fixes it
            current = None
        fresh[name] = current if isinstance(current, torch.Tensor) and current.shape == value.shape else value
    return fresh


@contextmanager
def _forward_for_export(module: nn.Module, through: str | None, plain: _PlainOutput) -> Iterator[None]:
    """While tracing, ``module``'s forward (or only its submodule ``through``'s call) returns a plain tree
    (an instance attribute shadows the method; it keeps the method's signature for export's argument binding)."""
    inner: Callable[..., Any] = module.forward if through is None else module.get_submodule(through)
    # The traced call's own signature binds the example's arguments: the submodule's when tracing through it (a
    # step may call self.model(input_ids=..., labels=...) whatever the LightningModule's forward takes).
    signature_of = module.forward if through is None else module.get_submodule(through).forward

    @functools.wraps(signature_of)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return plain(inner(*args, **kwargs))

    module.forward = forward
    try:
        yield
    finally:
        del module.forward


class _PlainOutput:
    """Turns a call's output into a tree torch.export knows (tensors, constants, tuples, lists, dicts, registered
    nodes), remembering how to make the original types again; objects that are none of those are dropped."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.rebuild: Callable[[Any], Any] | None = None
        self.dropped: list[tuple[str, str]] = []  # (where in the output, type name)

    def __call__(self, output: Any) -> Any:
        self.dropped.clear()
        if all(isinstance(leaf, torch.Tensor) or _is_constant(leaf) for leaf in pytree.tree_leaves(output)):
            self.rebuild = None  # torch's pytree knows every part of it
            return output
        value, self.rebuild = self._plain(output, "output")
        return value

    def _plain(self, value: Any, where: str) -> tuple[Any, Callable[[Any], Any]]:
        if isinstance(value, torch.Tensor) or _is_constant(value):
            return value, _same
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and not _registered(value):
            fields = [f for f in dataclasses.fields(value)]
            children = {f.name: self._plain(getattr(value, f.name), f"{where}.{f.name}") for f in fields}
            cls, init = type(value), {f.name for f in fields if f.init}

            def rebuild_dataclass(plain: dict[str, Any]) -> Any:
                values = {name: rebuild(plain[name]) for name, (_, rebuild) in children.items()}
                obj = cls(**{k: v for k, v in values.items() if k in init})
                for k, v in values.items():
                    if k not in init:
                        object.__setattr__(obj, k, v)
                return obj

            return {name: plain for name, (plain, _) in children.items()}, rebuild_dataclass
        if _registered(value):
            node = pytree.SUPPORTED_NODES[pytree._get_node_type(value)]
            items, context = node.flatten_fn(value)
            keys = _child_names(value, len(items))
            children = [self._plain(item, f"{where}{key}") for item, key in zip(items, keys)]
            return (tuple(plain for plain, _ in children),
                    lambda plain: node.unflatten_fn([rb(p) for (_, rb), p in zip(children, plain)], context))
        self.dropped.append((where, type(value).__name__))
        return None, _same

    def warn_dropped(self) -> None:
        for where, kind in self.dropped:
            warnings.warn(
                f"{self.model}'s output holds a {kind} at `{where}`, which is not a tensor and cannot travel between "
                "pipeline stages: PipeDreamStrategy drops it (it is None in the output your step gets). A cache of "
                "past keys and values is of no use in training: pass use_cache=False to the model (Hugging Face "
                "models), or return only tensors, to silence this.",
                stacklevel=3,
            )
        self.dropped.clear()


def _same(value: Any) -> Any:
    return value


def _is_constant(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device))


def _registered(value: Any) -> bool:
    """Whether torch's pytree flattens ``value`` (tuples, lists, dicts, namedtuples, registered classes)."""
    return not pytree._is_leaf(value) and pytree._get_node_type(value) in pytree.SUPPORTED_NODES


def _child_names(value: Any, count: int) -> list[str]:
    """How the output's children are shown in a warning: `.field`, `['key']` or `[i]`."""
    if isinstance(value, dict):
        return [f"[{k!r}]" for k in value][:count] + [f"[{i}]" for i in range(len(value), count)]
    if hasattr(value, "_fields"):
        return [f".{f}" for f in value._fields][:count]
    return [f"[{i}]" for i in range(count)]


def _forward_line(module: nn.Module, through: str | None) -> str | None:
    """Where the traced forward is defined, 'file:line in Class.forward', to name the user's code in an error."""
    target = module.get_submodule(through) if through else module
    try:
        import inspect

        function = inspect.unwrap(type(target).forward)
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]} in " \
               f"{type(target).__name__}.forward"
    except (TypeError, OSError):
        return None


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
    if "lightning_pipedream" in filename or filename.startswith("<"):  # <string>: code a dataclass or exec made
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
