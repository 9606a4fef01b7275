"""How long a wait of the pipeline may last: the default process group's timeout, which every group made for the
pipeline (ties, replicas, flags) carries too."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def world_timeout() -> timedelta:
    """The default process group's timeout, which every wait of the pipeline honours too.

    A group made by ``dist.new_group()`` without ``timeout=`` gets torch's default (30 minutes), not the
    world's; waiting at most the world's timeout keeps ``init_process_group(timeout=...)`` (and
    ``PipeDreamStrategy(timeout=...)``) in force for the pipeline's own groups. ``timedelta(0)``: unknown (no
    default group, or a backend that does not say): the group's own.
    """
    try:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        return timedelta(0)


def group_timeout() -> timedelta | None:
    """What ``dist.new_group(timeout=...)`` should get for a group of the pipeline: the world's, or None (torch's
    default) when it is unknown."""
    timeout = world_timeout()
    return timeout if timeout > timedelta(0) else None
