"""Estimate a captured graph's layers from shapes alone (FLOPs and bytes), for a model no process holds whole.

A model built on the meta device has no weights to time: :func:`estimate_graph` gives the partitioner the same
:class:`~lightning_pipedream.plan.profile.Profile` that :func:`~lightning_pipedream.graph.split_points.profile_graph`
measures, with each layer's time taken as its floating-point operations (torch's FLOP formulas, read from the
traced shapes: nothing is allocated or run) over a nominal rate plus the bytes it writes over a nominal
bandwidth, and the backward as twice the forward.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor
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
