"""What runs where: profiles, topologies, partitioners and the Plan they produce."""

from lightning_pipedream.plan.auto import AutoPlan, Candidate, NoPlanFitsError, auto_plan
from lightning_pipedream.plan.memory import StageMemory, optimizer_kind, predict_memory, stage_bytes
from lightning_pipedream.plan.partition import (
    METHODS,
    Plan,
    StagePlan,
    configuration_time,
    data_parallel_time,
    partition,
)
from lightning_pipedream.plan.profile import LayerProfile, Profile, load_pipedream_graph, profile_module
from lightning_pipedream.plan.topology import Topology

__all__ = [
    "METHODS",
    "AutoPlan",
    "Candidate",
    "NoPlanFitsError",
    "StageMemory",
    "auto_plan",
    "optimizer_kind",
    "predict_memory",
    "stage_bytes",
    "LayerProfile",
    "Plan",
    "Profile",
    "StagePlan",
    "Topology",
    "configuration_time",
    "data_parallel_time",
    "load_pipedream_graph",
    "partition",
    "profile_module",
]
