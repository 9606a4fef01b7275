"""Estimate a captured graph's layers from shapes alone (FLOPs and bytes), for a model no process holds whole.

A model built on the meta device has no weights to time: :func:`estimate_graph` gives the partitioner the same
:class:`~lightning_pipedream.plan.profile.Profile` that :func:`~lightning_pipedream.graph.split_points.profile_graph`
measures, with each layer's time taken as its floating-point operations (torch's FLOP formulas, read from the
traced shapes: nothing is allocated or run) over a nominal rate plus the bytes it writes over a nominal
bandwidth, and the backward as twice the forward.

:func:`with_working_sets` adds what the memory model needs (what each layer's forward leaves for its backward, what
its backward holds on top): each layer's program runs once under a fake-tensor mode on tensors of the graph's shapes
on the device the stages run on, so autograd saves the tensors a real run saves (the same ATen ops, the same kernel
choices: scaled-dot-product attention picks the device's kernel) while no storage is allocated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import Node
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from lightning_pipedream.graph.capture import CapturedGraph
from lightning_pipedream.plan.profile import LayerProfile, Profile

NOMINAL_FLOPS = 1e12  # FLOP/s a layer's time is estimated at: only the layers' ratios matter to a straight split
NOMINAL_BYTES = 1e11  # bytes/s a layer writes its outputs at (element-wise layers cost what they move)
SOURCE = "FLOP estimate"  # Profile.source of an estimate (the plan's printout says which was used)


def _val(value: Any) -> Any:
    return pytree.tree_map_only(Node, lambda n: n.meta.get("val"), value)


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, Tensor))


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, Tensor) else 0


def node_flops(node: Node) -> int:
    """Floating-point operations of one ATen node, from its arguments' and output's shapes (0 for ops with no
    formula: element-wise ops, whose cost the bytes they write stand for)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    packet, out = node.target.overloadpacket, node.meta.get("val")
    args = _val(node.args)
    # Composite ops that torch's formulas (written for what they decompose into) do not cover:
    if packet in (torch.ops.aten.linear, torch.ops.aten.matmul) and isinstance(args[0], Tensor):
        return 2 * _numel(out) * int(args[0].shape[-1])  # one multiply-add per output element per input feature
    if packet is torch.ops.aten.scaled_dot_product_attention and isinstance(args[0], Tensor):
        query, key = args[0], args[1]
        return 4 * _numel(query) * int(key.shape[-2])  # scores and their weighted sum, per query element
    count = flop_registry.get(packet)
    if count is None:
        return 0
    return int(count(*args, **_val(node.kwargs), out_val=out))


def estimate_graph(captured: CapturedGraph, rate: float = NOMINAL_FLOPS) -> Profile:
    """Each layer of ``captured``: forward seconds = its FLOPs / ``rate`` (backward twice that), the bytes of the
    values it hands to later layers and of the parameters it reads, and the edges between layers."""
    started = time.perf_counter()
    layer_of = captured.layer_of
    outputs = {v for v in captured.outputs if isinstance(v, Node)}
    results, edges = [], set()
    for index, layer in enumerate(captured.layers):
        members = set(layer.nodes)
        edges |= {(layer_of[a], index) for n in layer.nodes for a in n.all_input_nodes
                  if a in layer_of and layer_of[a] != index}
        produced = [n for n in layer.nodes if n in outputs or any(u not in members and u.op != "output"
                                                                    for u in n.users)]
        params = {p for p in captured.state if captured.state[p][0] == "parameter"
                  and any(u in members for u in p.users)}
        flops = sum(node_flops(n) for n in layer.nodes)
        written = sum(_bytes(n.meta.get("val")) for n in layer.nodes)
        seconds = flops / rate + written / NOMINAL_BYTES
        results.append(LayerProfile(
            layer.name, seconds, 2 * seconds, sum(_bytes(n.meta.get("val")) for n in produced),
            sum(_bytes(p.meta.get("val")) for p in params), f"{len(layer.nodes)} ops, {flops:.3g} FLOPs",
        ))
    batch = [n.meta["val"] for n in captured.inputs if isinstance(n.meta.get("val"), Tensor)
             and n.meta["val"].dim() > 0]
    return Profile(results, edges=sorted(edges), batch_size=int(batch[0].shape[0]) if batch else None,
                   source=SOURCE, profiling_s=time.perf_counter() - started)


class _LayerProgram(nn.Module):
    """One layer's program as a module of its parameters (what ``plan.profile``'s working-set measure takes)."""

    def __init__(self, program: nn.Module, state: list[Tensor]) -> None:
        super().__init__()
        self.program, self.state = program, state
        self.weights = nn.ParameterList([t for t in state if isinstance(t, nn.Parameter)])

    def forward(self, inputs: list[Any]) -> Any:
        return self.program(*self.state, *inputs)


def with_working_sets(profile: Profile, captured: CapturedGraph, device: torch.device | str = "cpu",
                      frozen: Iterable[str] = (), outputs_kept: bool = True) -> Profile:
    """``profile`` (of ``captured``'s layers) with the memory model's per-layer figures found on fake tensors: the
    bytes each layer's forward leaves for the backward (``saved_bytes``: what it creates and autograd saves, once per
    storage and with the layer that made it, parameters and the call's inputs aside; the call's outputs too, which
    the loss reads until the backward, though not what the loss itself saves, such as a cross-entropy's
    log-probabilities: that is the user's code), whether its outputs are kept so, the activation gradients its
    backward holds at once, the parameter-gradient temporaries on top and what a split backward keeps for its weight
    half (``plan.profile``'s measures, run on fake tensors), its largest parameter, and ``extra["input_bytes"]`` (the
    call's tensors). Parameters named in ``frozen`` need no gradient. ``outputs_kept=False``: the call's outputs are
    left to the loss's own count (``strategy.setup.graph_memory.loss_bytes``: a loss that saves them keeps them).
    Nothing is allocated: every tensor is a fake one on ``device``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_pipedream.graph.split import stage_program
    from lightning_pipedream.plan.profile import backward_bytes

    device = torch.device(device)
    frozen = set(frozen)
    outputs = {v for v in captured.outputs if isinstance(v, Node)}
    saved = [0] * len(captured.layers)
    output_saved = [False] * len(captured.layers)
    work: list[tuple[int, int, int]] = []
    with FakeTensorMode(allow_non_fake_inputs=False):
        def fake(node: Node, grad: bool = False) -> Any:
            val = node.meta.get("val")
            if not isinstance(val, Tensor):
                return val
            t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device)
            return nn.Parameter(t, requires_grad=grad) if grad else t

        state = {}
        for node, (kind, name) in captured.state.items():
            if kind == "constant":
                value = captured.constants[name]
                state[node] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            else:
                state[node] = fake(node, grad=kind == "parameter" and name not in frozen
                                   and node.meta["val"].is_floating_point())
        # value of each node handed between layers, whether it needs a gradient, and which layer made it
        env: dict[Node, Any] = {node: fake(node) for node in captured.inputs}
        given = {t.untyped_storage()._cdata for t in env.values() if isinstance(t, Tensor)}  # the input term's
        producer: dict[int, int] = {}  # storage -> the layer whose output it is
        counted: set[int] = set()  # outputs counted in their layer's saved_bytes (saved by several layers: once)
        for index, layer in enumerate(captured.layers):
            members = set(layer.nodes)
            inputs = list(dict.fromkeys(a for n in layer.nodes for a in n.all_input_nodes
                                        if a not in members and a not in captured.state))
            produced = [n for n in layer.nodes if n in outputs or any(u not in members and u.op != "output"
                                                                        for u in n.users)]
            program = stage_program(captured, layer.nodes, inputs, produced, [])
            used = [state[p] for p in captured.state if any(u in members for u in p.users)]
            in_args = [env[a] for a in inputs]
            params = {t.untyped_storage()._cdata for t in used}
            seen: dict[int, int] = {}

            def pack(t: Tensor) -> Tensor:
                storage = t.untyped_storage()
                if storage._cdata not in params and storage._cdata not in given:
                    seen[storage._cdata] = storage.nbytes()
                return t

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                values = program(*used, *in_args)
            mine = {}
            for node, value in zip(produced, values):
                if isinstance(value, Tensor):
                    mine[value.untyped_storage()._cdata] = index
                    value = value.detach().requires_grad_(value.requires_grad)
                env[node] = value
            for key in mine:  # a view of an earlier layer's output is that layer's storage still
                producer.setdefault(key, index)
            for key, nbytes in seen.items():  # an output saved here or later is kept by the layer that made it, once
                owner = producer.get(key, index)
                if key in producer and key in counted:
                    continue
                saved[owner] += nbytes
                output_saved[owner] = output_saved[owner] or key in producer
                if key in producer:
                    counted.add(key)
            for node, value in zip(produced, values):  # the call's outputs: the loss reads them, until the backward
                key = value.untyped_storage()._cdata if isinstance(value, Tensor) else None
                if outputs_kept and node in outputs and key is not None and key not in counted:
                    saved[producer[key]] += value.untyped_storage().nbytes()
                    output_saved[producer[key]] = True
                    counted.add(key)
            work.append(backward_bytes(_LayerProgram(program, used), in_args))
    layers = []
    for index, (layer, (working, temps, pending)) in enumerate(zip(profile.layers, work)):
        largest = max((_bytes(p.meta.get("val")) for p in captured.state if captured.state[p][0] == "parameter"
                       and any(u in captured.layers[index].nodes for u in p.users)), default=0)
        layers.append(dataclasses.replace(layer, saved_bytes=saved[index], output_saved=output_saved[index],
                                          grad_working_bytes=working, grad_temp_bytes=temps, pending_bytes=pending,
                                          largest_parameter_bytes=largest))
    input_bytes = sum(_bytes(n.meta.get("val")) for n in captured.inputs)
    return dataclasses.replace(profile, layers=layers, extra={**profile.extra, "input_bytes": input_bytes})


_PER_SAMPLE = ("activation_bytes", "saved_bytes", "grad_working_bytes", "pending_bytes")


def scaled_to_batch(profile: Profile, factor: int) -> Profile:
    """``profile`` of one micro-batch as the whole batch of ``factor`` micro-batches: what scales with the samples
    (times, outputs, saved tensors, activation gradients, the input) times ``factor``; parameters as they are."""
    if factor == 1:
        return profile
    layers = [dataclasses.replace(layer, forward_s=layer.forward_s * factor, backward_s=layer.backward_s * factor,
                                  **{key: getattr(layer, key) * factor for key in _PER_SAMPLE
                                     if getattr(layer, key) is not None})
              for layer in profile.layers]
    extra = dict(profile.extra)
    if "input_bytes" in extra:
        extra["input_bytes"] = extra["input_bytes"] * factor
    return dataclasses.replace(profile, layers=layers, extra=extra,
                               batch_size=None if profile.batch_size is None else profile.batch_size * factor)
