"""Arbitrary models as pipelines: capture the forward call into a graph, profile it, split it into stage modules."""

from lightning_pipedream.graph.capture import CapturedGraph, GraphCaptureError, Layer, call_signature, capture
from lightning_pipedream.graph.split import (
    GraphSplit,
    GraphStage,
    SplitError,
    StageProgram,
    build_stages,
    consolidate_state_dict,
    split_graph,
)

__all__ = [
    "CapturedGraph", "GraphCaptureError", "GraphSplit", "GraphStage", "Layer", "SplitError", "StageProgram",
    "build_stages", "call_signature", "capture", "consolidate_state_dict", "split_graph",
]
