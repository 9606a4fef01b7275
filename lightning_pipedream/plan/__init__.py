"""What runs where: profiles, topologies, partitioners and the Plan they produce."""

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
