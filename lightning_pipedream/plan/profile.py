"""Per-layer profiles: the profiler that times a module layer by layer, JSON files, PipeDream's graph.txt."""

from __future__ import annotations

import heapq
import json
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_pipedream.plan.errors import ProfileFormatError, is_number, is_whole

if TYPE_CHECKING:  # torch is imported where the profiler runs: reading and planning a profile do without it
    import torch
    from torch import nn

_LAYER_FIELDS = (
    "name", "forward_s", "backward_s", "activation_bytes", "parameter_bytes", "description", "saved_bytes",
    "output_saved", "weight_s", "grad_working_bytes", "grad_temp_bytes", "pending_bytes", "largest_parameter_bytes",
)
_OPTIONAL_FIELDS = _LAYER_FIELDS[6:]  # left out of the JSON when unknown
_BYTE_FIELDS = ("saved_bytes", "grad_working_bytes", "grad_temp_bytes", "pending_bytes", "largest_parameter_bytes")


@dataclass
class LayerProfile:
    """One layer: seconds per minibatch forward and backward, bytes of its output and of its parameters.

    ``saved_bytes`` (when the profiler measured it) is what the layer's forward leaves for the backward: the tensors
    it creates that autograd saves (intermediates, and its output when it or the next layer saves it), parameters
    aside; ``output_saved`` says whether its output is among them. Unknown (None), the memory model takes the output
    as all a layer keeps. ``weight_s`` is the weight-gradient part of ``backward_s`` (what a zero-bubble schedule
    defers), when measured (``profile_module(split_backward=True)``); unknown, planners take half the backward.

    What the backward needs on top, per minibatch (the memory model's working set; unknown, it estimates them):
    ``grad_working_bytes``, the most activation gradients it holds at once (the one arriving included);
    ``grad_temp_bytes``, the parameter gradients it computes before adding them into ``.grad``; ``pending_bytes``,
    the gradients a split backward keeps from its input half for its weight half; ``largest_parameter_bytes``, the
    largest parameter tensor (what an optimizer's per-tensor temporaries are sized by).
    """

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    parameter_bytes: int
    description: str = ""
    saved_bytes: int | None = None
    output_saved: bool | None = None
    weight_s: float | None = None
    grad_working_bytes: int | None = None
    grad_temp_bytes: int | None = None
    pending_bytes: int | None = None
    largest_parameter_bytes: int | None = None


@dataclass
class Profile:
    """Layers in a topological order; ``edges`` are (producer, consumer) layer indices, a chain when None."""

    layers: list[LayerProfile]
    edges: list[tuple[int, int]] | None = None
    batch_size: int | None = None
    source: str = ""
    profiling_s: float | None = None  # wall time the profiler took, to report its overhead
    no_cut_after: list[int] = field(default_factory=list)  # layers that share a stage with the next layer
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        where = f" ({self.source})" if self.source else ""
        if not isinstance(self.layers, list) or not self.layers:
            raise ProfileFormatError(f"The profile{where} has no layers; profile a model with at least one layer.")
        seen: set[str] = set()
        for index, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise ProfileFormatError(f"Layer {index} of the profile{where} is {layer!r}, not a LayerProfile.")
            if not isinstance(layer.name, str) or not layer.name:
                raise ProfileFormatError(
                    f"Layer {index} of the profile{where} has name={layer.name!r}; give each layer a non-empty string."
                )
            if not isinstance(layer.description, str):
                raise ProfileFormatError(
                    f"Layer {index} ({layer.name}) of the profile{where} has description={layer.description!r}; "
                    "use a string."
                )
            if layer.name in seen:
                raise ProfileFormatError(
                    f"The profile{where} names two layers {layer.name!r}; layer names must be unique."
                )
            seen.add(layer.name)
            for key in ("forward_s", "backward_s", "activation_bytes", "parameter_bytes"):
                value = getattr(layer, key)
                if not is_number(value):
                    raise ProfileFormatError(
                        f"Layer {index} ({layer.name}) of the profile{where} has {key}={value!r}; "
                        "use a number >= 0 (finite: seconds or bytes)."
                    )
            for key in _BYTE_FIELDS:
                value = getattr(layer, key)
                if value is not None and not is_number(value):
                    raise ProfileFormatError(
                        f"Layer {index} ({layer.name}) of the profile{where} has {key}={value!r}; "
                        "use bytes >= 0, or null when not measured."
                    )
            if layer.weight_s is not None and not (is_number(layer.weight_s) and layer.weight_s <= layer.backward_s):
                raise ProfileFormatError(
                    f"Layer {index} ({layer.name}) of the profile{where} has weight_s={layer.weight_s!r}; use seconds "
                    f"between 0 and its backward_s ({layer.backward_s!r}): the weight-gradient part of the backward, "
                    "or null when not measured."
                )
            if layer.output_saved is not None and not isinstance(layer.output_saved, bool):
                raise ProfileFormatError(
                    f"Layer {index} ({layer.name}) of the profile{where} has output_saved={layer.output_saved!r}; "
                    "use true, false, or null when not measured."
                )
        count = len(self.layers)
        if not isinstance(self.no_cut_after, list):
            raise ProfileFormatError(
                f"The profile{where} has no_cut_after={self.no_cut_after!r}; use a list of layer indices."
            )
        for index in self.no_cut_after:
            if not (isinstance(index, int) and not isinstance(index, bool) and 0 <= index < count - 1):
                raise ProfileFormatError(
                    f"The profile{where} has no_cut_after={index!r}; use indices of layers 0..{count - 2}."
                )
        if self.edges is not None:
            if not isinstance(self.edges, list):
                raise ProfileFormatError(
                    f"The profile{where} has edges={self.edges!r}; use a list of [producer, consumer] pairs, or null."
                )
            for edge in self.edges:
                if (
                    not isinstance(edge, (tuple, list))
                    or len(edge) != 2
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in edge)
                ):
                    raise ProfileFormatError(
                        f"The profile{where} has an edge {edge!r}; "
                        "an edge is a pair of layer indices [producer, consumer]."
                    )
                a, b = edge
                if not (0 <= a < count and 0 <= b < count):
                    raise ProfileFormatError(f"The profile{where} has an edge {a} -> {b} outside its {count} layers.")
                if a >= b:
                    raise ProfileFormatError(
                        f"The profile{where} has an edge {a} -> {b} that goes backwards; "
                        "list layers in a topological order."
                    )
        if self.batch_size is not None and not is_whole(self.batch_size, 1):
            raise ProfileFormatError(
                f"The profile{where} has batch_size={self.batch_size!r}; use a whole number >= 1, or null."
            )
        if self.profiling_s is not None and not is_number(self.profiling_s):
            raise ProfileFormatError(
                f"The profile{where} has profiling_s={self.profiling_s!r}; use seconds >= 0, or null."
            )
        if not isinstance(self.source, str):
            raise ProfileFormatError(f"The profile has source={self.source!r}; use a string (where it came from).")
        if not isinstance(self.extra, dict):
            raise ProfileFormatError(f"The profile{where} has extra={self.extra!r}; use a JSON object.")

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def cut_allowed(self) -> list[bool]:
        """Whether a stage may end after each layer but the last."""
        allowed = [True] * (len(self.layers) - 1)
        for index in self.no_cut_after:
            allowed[index] = False
        return allowed

    def cut_bytes(self) -> list[int]:
        """Bytes crossing the cut after each layer but the last: the outputs of every layer before the cut
        that a layer after it consumes (each output counted once, however many edges it has)."""
        count = len(self.layers)
        edges = self.edges if self.edges is not None else [(i, i + 1) for i in range(count - 1)]
        last_use = list(range(count))
        for a, b in edges:
            last_use[a] = max(last_use[a], b)
        delta = [0] * (count + 1)
        for index, layer in enumerate(self.layers):  # layer i crosses the cuts i .. last_use[i]-1
            if last_use[index] > index:
                delta[index] += layer.activation_bytes
                delta[last_use[index]] -= layer.activation_bytes
        cuts, running = [], 0
        for k in range(count - 1):
            running += delta[k]
            cuts.append(running)
        return cuts

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": [
                {k: v for k, v in asdict(layer).items() if v is not None or k not in _OPTIONAL_FIELDS}
                for layer in self.layers
            ],
            "edges": None if self.edges is None else [list(e) for e in self.edges],
            "batch_size": self.batch_size,
            "source": self.source,
            "profiling_s": self.profiling_s,
            **({"no_cut_after": list(self.no_cut_after)} if self.no_cut_after else {}),
            **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> Profile:
        """A profile from :meth:`to_json`'s dict (or its JSON text); :class:`ProfileFormatError` names what is
        wrong (the layer and field)."""
        if isinstance(data, str):
            data = _parse_json(data, "The profile")
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            raise ProfileFormatError(
                "A profile is a JSON object with a 'layers' list; this one has none"
                + (f" ({data['source']})" if isinstance(data, dict) and isinstance(data.get("source"), str) else "")
                + "."
            )
        source = data.get("source", "")
        if not isinstance(source, str):
            raise ProfileFormatError(f"The profile has source={source!r}; use a string (where it came from).")
        where = f" ({source})" if source else ""
        layers = []
        for index, entry in enumerate(data["layers"]):
            needs = "name, forward_s, backward_s, activation_bytes and parameter_bytes"
            if not isinstance(entry, dict):
                raise ProfileFormatError(
                    f"Layer {index} of the profile{where} is {_short(entry)}; each layer is an object with {needs}."
                )
            missing = [key for key in _LAYER_FIELDS[:5] if key not in entry]
            unknown = sorted(set(entry) - set(_LAYER_FIELDS))
            if missing or unknown:
                raise ProfileFormatError(
                    f"Layer {index} of the profile{where} is {_short(entry)}; each layer needs {needs}"
                    + (f" (missing {', '.join(missing)})" if missing else "")
                    + (f" (unknown fields {unknown}; known fields are {list(_LAYER_FIELDS)})" if unknown else "")
                    + "."
                )
            layers.append(LayerProfile(**entry))
        edges = data.get("edges")
        if edges is not None:
            if not isinstance(edges, list):
                raise ProfileFormatError(
                    f"The profile{where} has edges={_short(edges)}; use a list of [producer, consumer] pairs, or null."
                )
            pairs = []
            for edge in edges:
                if not isinstance(edge, list) or len(edge) != 2 or not all(is_whole(i) for i in edge):
                    raise ProfileFormatError(
                        f"The profile{where} has an edge {_short(edge)}; an edge is a pair of layer indices "
                        "[producer, consumer], each a whole number >= 0."
                    )
                pairs.append((int(edge[0]), int(edge[1])))
            edges = pairs
        no_cut_after = data.get("no_cut_after") or []
        if not isinstance(no_cut_after, list) or not all(is_whole(i) for i in no_cut_after):
            raise ProfileFormatError(
                f"The profile{where} has no_cut_after={_short(no_cut_after)}; use a list of layer indices "
                "(whole numbers >= 0)."
            )
        return cls(
            layers,
            edges=edges,
            batch_size=data.get("batch_size"),
            source=source,
            profiling_s=data.get("profiling_s"),
            no_cut_after=[int(i) for i in no_cut_after],
            extra=data.get("extra") or {},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile saved by :meth:`save`, or a PipeDream ``graph.txt`` (recognised by its first line)."""
        text = _read_text(path, "profile")
        if not text.strip():
            raise ProfileFormatError(
                f"The profile {path} is empty; write one with Profile.save or `python -m lightning_pipedream plan`."
            )
        if not text.lstrip().startswith("{"):
            return parse_pipedream_graph(text, source=str(path))
        data = _parse_json(text, f"The profile {path}")
        if isinstance(data, dict) and not data.get("source"):
            data["source"] = str(path)
        try:
            return cls.from_json(data)
        except ProfileFormatError as err:
            if str(path) in str(err):
                raise
            raise ProfileFormatError(f"{path}: {err}") from None  # the file's own "source" names another


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_text(path: str | Path, what: str) -> str:
    """The file's text; a file that is not UTF-8 is a :class:`ProfileFormatError` naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ProfileFormatError(
            f"The {what} {path} is not UTF-8 text (byte {err.start}: {err.reason}); "
            "a profile is JSON written by Profile.save, or PipeDream's graph.txt."
        ) from None


def _parse_json(text: str, what: str) -> Any:
    """``json.loads``, with errors that name ``what`` (e.g. "The profile p.json") and the line and column."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfileFormatError(
            f"{what} is not valid JSON: line {err.lineno}, column {err.colno}: {err.msg}."
        ) from None
    except RecursionError:
        raise ProfileFormatError(f"{what} is not valid JSON: its arrays or objects nest too deeply.") from None


# ---------------------------------------------------------------------------------------------------------
# The profiler


def _fresh_leaves(tree: Any, requires_grad: bool = True) -> Any:
    """The same tree with each tensor detached; floating tensors require grad, as a later stage's input does
    (with ``requires_grad=False``, those that required it before)."""
    from lightning_pipedream.tree import map_tensors

    def fresh(t: torch.Tensor) -> torch.Tensor:
        leaf = t.detach()
        wanted = requires_grad or t.requires_grad
        return leaf.requires_grad_(True) if wanted and leaf.is_floating_point() else leaf

    return map_tensors(fresh, tree)


def _call(layer: nn.Module, inputs: Any) -> Any:
    # A layer receives its predecessor's output as one argument, whatever its structure.
    return layer(inputs)


class _Stopwatch:
    """Times one piece of work on the device of ``tensors``: with CUDA events on a GPU (the time the device spent
    between them, which is what a pipeline stage costs once the host runs ahead of it), else the host's clock."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        import torch

        gpus = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
        self.device = gpus[0] if gpus else None
        self._cuda = torch.cuda if gpus else None
        self._started: Any = None

    def sync(self) -> None:
        if self._cuda is not None:
            self._cuda.synchronize(self.device)

    def start(self) -> None:
        if self._cuda is None:
            self._started = time.perf_counter()
            return
        self._started = self._cuda.Event(enable_timing=True)
        self._started.record(self._cuda.current_stream(self.device))

    def stop(self) -> float:
        """Seconds since :meth:`start` (waits for the device's work to end)."""
        if self._cuda is None:
            return time.perf_counter() - self._started
        end = self._cuda.Event(enable_timing=True)
        end.record(self._cuda.current_stream(self.device))
        end.synchronize()
        return self._started.elapsed_time(end) / 1000.0  # elapsed_time gives milliseconds


def _median_time(fn: Callable[[], Any], watch: _Stopwatch, warmup: int, repeats: int) -> tuple[float, Any]:
    result = None
    for _ in range(warmup):
        result = fn()
    watch.sync()
    samples = []
    for _ in range(repeats):
        watch.start()
        result = fn()
        samples.append(watch.stop())
    return statistics.median(samples), result


def _saved_by_forward(layer: nn.Module, inputs: Any) -> tuple[int, bool, int]:
    """What one forward of ``layer`` leaves for its backward, once per storage, parameters aside: bytes of the
    tensors it creates, whether its output is among them, and bytes of its inputs it saves."""
    import torch

    from lightning_pipedream.tree import tensors

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    given = {t.untyped_storage().data_ptr() for t in tensors(inputs)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = _call(layer, inputs)
    produced = {t.untyped_storage().data_ptr() for t in tensors(output)}
    created = sum(size for ptr, size in seen.items() if ptr not in given)
    inputs_saved = sum(size for ptr, size in seen.items() if ptr in given)
    return created, any(ptr in produced for ptr in seen), inputs_saved


def backward_bytes(layer: nn.Module, inputs: Any) -> tuple[int, int, int]:
    """What one backward of ``layer`` needs on top of its saved tensors, in bytes: the activation gradients it holds at
    once, the parameter-gradient temporaries on top of those (each added into an existing ``.grad``, as from the
    second micro-batch on), and the gradients a split backward keeps for its weight half (zero bubble)."""
    import torch

    from lightning_pipedream.plan.live_bytes import LiveTensorBytes
    from lightning_pipedream.tree import tensors
    from lightning_pipedream.weight_branches import WeightBranches

    params = [p for p in layer.parameters() if p.requires_grad]
    wanted = [t for t in tensors(inputs) if t.requires_grad]
    kept = {id(t): t.grad for t in (*params, *wanted)}

    def rise(given: Any, targets: list[torch.Tensor]) -> int:
        if not targets:
            return 0
        owned = {id(p) for p in params}
        for t in targets:  # accumulated in place into a gradient that exists (inputs: stolen, as in a stage)
            t.grad = torch.zeros_like(t) if id(t) in owned else None
        meter = LiveTensorBytes(targets[0].device.type)
        meter.add_all((*targets, *(t.grad for t in targets)))
        with meter:  # the forward too, so that what the backward frees of the saved tensors counts against its rise
            out = [t for t in tensors(_call(layer, given)) if t.requires_grad]
            meter.reset_peak()
            base = meter.live
            if out:
                torch.autograd.backward(out, [torch.ones_like(t) for t in out], inputs=targets)
        return meter.peak - base

    def pending() -> int:
        out = [t for t in tensors(_call(layer, inputs)) if t.requires_grad]
        if not out or not wanted or not params:
            return 0
        split = WeightBranches(out, wanted, params)
        with split.capturing():
            torch.autograd.grad(out, wanted, [torch.ones_like(t) for t in out], retain_graph=True, allow_unused=True)
        return split.pending_bytes()

    with torch.enable_grad():
        if wanted:
            working = rise(inputs, wanted)
        else:  # a first layer: measured as if its input needed a gradient, which is then taken off
            probe = _fresh_leaves(inputs)
            probed = [t for t in tensors(probe) if t.requires_grad]
            working = max(0, rise(probe, probed) - sum(t.numel() * t.element_size() for t in probed))
        total = rise(inputs, [*wanted, *params])
        deferred = pending()
    for t in (*params, *wanted):
        t.grad = kept[id(t)]
    return working, max(0, total - working), deferred


def _profile_layer(
    name: str, layer: nn.Module, inputs: Any, warmup: int, repeats: int, split_backward: bool = False,
    working_sets: bool = False,
) -> tuple[LayerProfile, Any, int]:
    """The layer's profile, its output, and the bytes of its inputs its forward saves (its predecessor's output)."""
    import torch

    from lightning_pipedream.tree import tensors

    in_tensors = tensors(inputs)
    params = [p for p in layer.parameters() if p.requires_grad]
    watch = _Stopwatch(in_tensors + [p for p in layer.parameters()])
    saved, output_saved, inputs_saved = _saved_by_forward(layer, inputs)

    forward_s, output = _median_time(lambda: _call(layer, inputs), watch, warmup, repeats)
    out_tensors = tensors(output)
    activation_bytes = sum(t.numel() * t.element_size() for t in out_tensors)
    parameter_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in layer.parameters()}.values())

    wrt = [t for t in in_tensors if t.requires_grad] + params
    # Backward: a fresh (untimed) forward each time, then autograd.grad so that no .grad is written.
    def backward_time(targets: list[torch.Tensor]) -> float:
        samples = []
        for attempt in range(warmup + repeats):
            out = [t for t in tensors(_call(layer, inputs)) if t.requires_grad]
            grads = [torch.ones_like(t) for t in out]
            watch.sync()
            watch.start()
            torch.autograd.grad(out, targets, grad_outputs=grads, allow_unused=True)
            elapsed = watch.stop()
            if attempt >= warmup:
                samples.append(elapsed)
        return statistics.median(samples)

    backward_s = 0.0
    weight_s = 0.0 if split_backward else None
    if wrt and any(t.requires_grad for t in out_tensors):
        backward_s = backward_time(wrt)
        if split_backward:
            # the input-gradient half alone; the rest is what a zero-bubble schedule defers (all of it when no input
            # needs a gradient, none of it without parameters)
            needed = [t for t in in_tensors if t.requires_grad]
            input_s = backward_time(needed) if needed and params else (0.0 if not needed else backward_s)
            weight_s = min(backward_s, max(0.0, backward_s - input_s))
    largest = max((p.numel() * p.element_size() for p in layer.parameters()), default=0)
    working, temporaries, pending = backward_bytes(layer, inputs) if working_sets else (None, None, None)
    profile = LayerProfile(
        name, forward_s, backward_s, int(activation_bytes), int(parameter_bytes), type(layer).__name__,
        saved_bytes=int(saved), output_saved=output_saved, weight_s=weight_s, grad_working_bytes=working,
        grad_temp_bytes=temporaries, pending_bytes=pending, largest_parameter_bytes=int(largest),
    )
    return profile, output, inputs_saved


def profile_module(
    layers: nn.Sequential, sample_input: Any, *, warmup: int = 1, repeats: int = 3, split_backward: bool = False,
    working_sets: bool = False,
) -> Profile:
    """Time each child of ``layers`` on ``sample_input`` (one minibatch): forward and backward seconds
    (median of ``repeats`` after ``warmup`` runs), output bytes and parameter bytes.

    Each layer runs on the previous layer's output (a tensor or a tuple/list/dict of them); the first layer's
    backward computes gradients for ``sample_input`` only where it requires them. ``extra["input_bytes"]`` is the
    size of ``sample_input``'s tensors (what the first stage keeps per batch, for the memory model). Buffers such as
    BatchNorm statistics and the random number generators are restored afterwards, and no ``.grad`` is set.
    ``split_backward=True`` also times each backward's input-gradient half alone, giving ``weight_s`` (the rest),
    for zero-bubble schedules; it costs another ``warmup + repeats`` forwards and partial backwards per layer.
    ``working_sets=True`` also measures what each backward needs on top of the saved tensors (``grad_working_bytes``,
    ``grad_temp_bytes``, ``pending_bytes``), for the memory model: three more forwards and backwards per layer under a
    dispatch mode that counts every tensor (its first use in a process costs about 2 s); without it the model
    estimates them.
    """
    import torch
    from torch import nn

    from lightning_pipedream.tree import tensors

    if not isinstance(layers, nn.Sequential) or len(layers) == 0:
        raise ValueError("profile_module needs a non-empty torch.nn.Sequential; split the model into layers first.")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"profile_module needs warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}.")
    started = time.perf_counter()
    buffers = {name: buf.detach().clone() for name, buf in layers.named_buffers()}
    devices = sorted({t.device.index for t in tensors(sample_input) if t.device.type == "cuda"} - {None})
    results: list[LayerProfile] = []
    with torch.random.fork_rng(devices=devices):
        inputs = _fresh_leaves(sample_input, requires_grad=False)  # a batch of data needs no gradient
        for name, layer in layers.named_children():
            result, output, inputs_saved = _profile_layer(name, layer, inputs, warmup, repeats, split_backward,
                                                          working_sets)
            previous = results[-1] if results else None
            if previous is not None and inputs_saved and not previous.output_saved:
                # the next layer keeps this one's output (a Linear after a Linear): it lives until that backward
                previous.saved_bytes = (previous.saved_bytes or 0) + inputs_saved
                previous.output_saved = True
            results.append(result)
            inputs = _fresh_leaves(output)
    with torch.no_grad():
        for name, buf in layers.named_buffers():
            buf.copy_(buffers[name])
    batch = tensors(sample_input)
    batch_size = int(batch[0].shape[0]) if batch and batch[0].dim() > 0 else None
    # the batch stage 0 keeps for its backward: the memory model's input term (plan.memory.stage_bytes)
    input_bytes = sum(t.numel() * t.element_size() for t in batch)
    return Profile(results, batch_size=batch_size, source="profile_module", profiling_s=time.perf_counter() - started,
                   extra={"input_bytes": int(input_bytes)})


# ---------------------------------------------------------------------------------------------------------
# PipeDream's graph.txt

_NODE = re.compile(r"^(?P<id>\S+) -- (?P<desc>.*) -- (?P<meta>forward_compute_time=.*)$")
_META = re.compile(
    r"^forward_compute_time=(?P<f>[^,]+), backward_compute_time=(?P<b>[^,]+), "
    r"activation_size=(?P<a>\[[^\]]*\]|[^,]+), parameter_size=(?P<p>[^,\s]+)(?: -- stage_id=\d+)?$"
)
_EDGE = re.compile(r"^\t(?P<a>\S+) -- (?P<b>\S+)\s*$")


def _number(text: str, what: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ProfileFormatError(f"{where}: {what} is {text!r}, not a number.") from None
    if not value >= 0 or math.isinf(value):
        raise ProfileFormatError(f"{where}: {what} is {text!r}; it must be a finite number >= 0.")
    return value


def _natural_key(node_id: str) -> tuple[str, int]:
    match = re.match(r"^(.*?)(\d+)$", node_id)
    return (match.group(1), int(match.group(2))) if match else (node_id, -1)


def parse_pipedream_graph(text: str, source: str = "graph.txt", *, attach_side_sources: bool = True) -> Profile:
    """Parse PipeDream's profile format: ``nodeN -- desc -- forward_compute_time=ms, backward_compute_time=ms,
    activation_size=bytes, parameter_size=bytes`` lines, then tab-prefixed ``nodeA -- nodeB`` edges.

    Times become seconds. As PipeDream's optimizer does, ``Input`` sources cost nothing and stay in the first
    stage. Other nodes follow in a topological order that takes lower node numbers first. PipeDream's optimizer
    grows stages from the first source only, so nodes that source does not reach (GNMT's decoder embedding and
    initial hidden state) always share the stage of their first consumer; ``attach_side_sources=False`` lets
    the partitioner place them in an earlier stage instead (the activations they send are still counted).
    """
    nodes: dict[str, LayerProfile] = {}
    edges: list[tuple[str, str]] = []
    edge_lines: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{source}, line {number}"
        if not line.strip():
            continue
        if line.startswith("\t"):
            match = _EDGE.match(line)
            if not match:
                raise ProfileFormatError(
                    f"{where}: expected an edge 'nodeA -- nodeB' after a tab, got {line.strip()!r}."
                )
            edges.append((match["a"], match["b"]))
            edge_lines.append(number)
            continue
        match = _NODE.match(line.strip())
        meta = _META.match(match["meta"]) if match else None
        if not match or not meta:
            raise ProfileFormatError(
                f"{where}: expected 'nodeN -- description -- forward_compute_time=MS, backward_compute_time=MS, "
                f"activation_size=BYTES, parameter_size=BYTES', got {line.strip()[:120]!r}."
            )
        if match["id"] in nodes:
            raise ProfileFormatError(f"{where}: node {match['id']} is defined twice.")
        activation = meta["a"]
        if activation.startswith("["):  # a layer with several outputs lists their sizes
            sizes = [s for s in activation.strip("[]").split(";") if s.strip()]
            activation_bytes = sum(_number(s.strip(), "activation_size", where) for s in sizes)
            if math.isinf(activation_bytes):
                raise ProfileFormatError(f"{where}: activation_size {activation!r} adds up to more than a float holds.")
        else:
            activation_bytes = _number(activation, "activation_size", where)
        nodes[match["id"]] = LayerProfile(
            name=match["id"],
            forward_s=_number(meta["f"], "forward_compute_time", where) / 1000.0,
            backward_s=_number(meta["b"], "backward_compute_time", where) / 1000.0,
            activation_bytes=int(round(activation_bytes)),
            parameter_bytes=int(round(_number(meta["p"], "parameter_size", where))),
            description=match["desc"],
        )
    if not nodes:
        raise ProfileFormatError(f"{source} has no nodes; a PipeDream profile lists 'nodeN -- ...' lines, then edges.")
    for (a, b), number in zip(edges, edge_lines):
        for node in (a, b):
            if node not in nodes:
                raise ProfileFormatError(
                    f"{source}, line {number}: an edge names {node}, which no node line defines; "
                    "define it with a 'nodeN -- ...' line."
                )
    return _order_graph(nodes, edges, source, attach_side_sources)


def _order_graph(
    nodes: dict[str, LayerProfile], edges: list[tuple[str, str]], source: str, attach_side_sources: bool
) -> Profile:
    consumers: dict[str, list[str]] = {n: [] for n in nodes}
    indegree = {n: 0 for n in nodes}
    for a, b in set(edges):
        consumers[a].append(b)
        indegree[b] += 1
    inputs = [n for n, layer in nodes.items() if indegree[n] == 0 and layer.description.startswith("Input")]
    for n in inputs:  # PipeDream's optimizer zeroes the inputs: the first stage always holds them
        nodes[n] = LayerProfile(n, 0.0, 0.0, 0, 0, nodes[n].description)
    # Kahn's algorithm; inputs first, then the lowest node number, which follows the profiler's trace order.
    ready = [((0 if n in inputs else 1, _natural_key(n)), n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in consumers[n]:
            indegree[m] -= 1
            if indegree[m] == 0:
                heapq.heappush(ready, ((1, _natural_key(m)), m))
    if len(order) != len(nodes):
        stuck = sorted(set(nodes) - set(order), key=_natural_key)[:5]
        raise ProfileFormatError(
            f"{source}: the graph has a cycle through {', '.join(stuck)}; PipeDream graphs must be DAGs."
        )
    index = {n: i for i, n in enumerate(order)}
    no_cut = {index[n] for n in inputs}  # the inputs stay with the first layer
    if attach_side_sources:
        no_cut |= _side_branches(nodes, consumers, inputs, index)
    return Profile(
        [nodes[n] for n in order],
        edges=sorted({(index[a], index[b]) for a, b in edges}),
        source=source,
        no_cut_after=sorted(i for i in no_cut if i < len(order) - 1),
        extra={"format": "pipedream-graph", "time_unit_in_file": "ms"},
    )


def _side_branches(
    nodes: dict[str, LayerProfile], consumers: dict[str, list[str]], inputs: list[str], index: dict[str, int]
) -> set[int]:
    """Positions from each node the first source does not reach up to (excluding) its first consumer."""
    fed = {m for n in nodes if n not in inputs for m in consumers[n]}  # fed by something other than an input
    sources = [n for n in nodes if n not in inputs and n not in fed]
    if not sources:
        return set()
    reached, stack = {sources[0]}, [sources[0]]  # PipeDream starts from the first source in file order
    while stack:
        for m in consumers[stack.pop()]:
            if m not in reached:
                reached.add(m)
                stack.append(m)
    blocked: set[int] = set()
    for n in nodes:
        if n in reached or n in inputs or not consumers[n]:
            continue
        first_consumer = min(index[m] for m in consumers[n])
        blocked.update(range(index[n], first_consumer))
    return blocked


def load_pipedream_graph(path: str | Path, *, attach_side_sources: bool = True) -> Profile:
    """Read a PipeDream ``graph.txt`` profile (see :func:`parse_pipedream_graph`)."""
    text = _read_text(path, "PipeDream profile")
    if not text.strip():
        raise ProfileFormatError(
            f"The PipeDream profile {path} is empty; it should list 'nodeN -- ...' lines, then edges."
        )
    return parse_pipedream_graph(text, source=str(path), attach_side_sources=attach_side_sources)
