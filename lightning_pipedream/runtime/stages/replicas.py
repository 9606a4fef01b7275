"""Process groups of replicated stages (a DeviceMesh for data-parallel copies) and the per-stage gradient all-reduce."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipedream.runtime.faults.failures import pipeline_failures
from lightning_pipedream.runtime.faults.timeouts import group_timeout
from lightning_pipedream.schedule.actions import Layout

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


class ReplicaGroups:
    """The process groups of a :class:`Layout`: one gradient group per stage over exactly its replicas.

    Rank layout (stage-major, see :class:`Layout`): stage s's replicas are the consecutive ranks
    ``sum(replicas[:s]) ...``; with d copies of a p-stage pipeline, rank ``s * d + k`` holds stage s
    of pipeline k. With ``torchrun``/Lightning filling nodes rank by rank, a stage's replicas share
    a node whenever d divides the devices per node, so the gradient all-reduce (the stage's
    parameter bytes, every step) runs on the fast intra-node links and only activations (smaller,
    point to point) cross nodes.

    For uniform layouts the groups come from a torch ``DeviceMesh`` of shape (p, d) named
    ``("pipe", "data")`` (:attr:`mesh`): ``mesh.get_group("data")`` is this rank's stage replicas,
    ``mesh.get_group("pipe")`` its pipeline. A non-uniform plan (2-1, 15-1) has no mesh shape, so
    its groups are made with ``dist.new_group``. Construct on every rank of ``group`` (group
    creation is collective), in the same order relative to other group creations.

    ``group``: the process group the layout's ranks number into (default: the world); its size
    must equal ``layout.num_ranks``.
    """

    def __init__(self, layout: Layout, *, group: dist.ProcessGroup | None = None, device_type: str = "cpu") -> None:
        world = dist.get_world_size(group)
        if world != layout.num_ranks:
            raise ValueError(
                f"replicas {list(layout.replicas)} need {layout.num_ranks} processes, but the process group has "
                f"{world}; start {layout.num_ranks} processes or change the replicas."
            )
        self.layout = layout
        self.rank = dist.get_rank(group)
        self.stage = layout.stage_of(self.rank)
        self.mesh = None
        self._globals = [r if group is None else dist.get_global_rank(group, r) for r in range(world)]
        groups: dict[int, dist.ProcessGroup | None] = {}
        if layout.is_uniform and group is None and layout.replicas[0] > 1 and _has_device_mesh():
            from torch.distributed.device_mesh import init_device_mesh

            p, d = layout.num_stages, layout.replicas[0]
            self.mesh = init_device_mesh(device_type, (p, d), mesh_dim_names=("pipe", "data"))
            groups[self.stage] = self.mesh.get_group("data")
        else:
            for stage in range(layout.num_stages):  # new_group is collective: every rank, every stage, in order
                ranks = [self._globals[r] for r in layout.ranks_of(stage)]
                made = dist.new_group(ranks, timeout=group_timeout()) if len(ranks) > 1 else None
                if stage == self.stage:
                    groups[stage] = made
        self.data_group = groups.get(self.stage)

    def group_members(self) -> list[int]:
        """The global ranks of :attr:`data_group` as torch.distributed sees them (a check of the group itself)."""
        if self.data_group is None:
            return [self._globals[self.rank]]
        return sorted(dist.get_process_group_ranks(self.data_group))

    def reducer(self, params: Iterable[nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> GradientReducer:
        """A :class:`GradientReducer` of ``params`` over this stage's replicas."""
        return GradientReducer(params, self.data_group, bucket_bytes=bucket_bytes)


def _has_device_mesh() -> bool:
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
    except ImportError:  # torch < 2.2
        return False
    return True


class GradientReducer:
    """Sums ``params``' gradients over a stage's replicas, bucket by bucket (DDP-sized flat buffers).

    Every replica calls :meth:`reduce` at the same point of its schedule (the ``ALLREDUCE_GRAD``
    action). A missing ``.grad`` counts as zeros: a replica that ran no backward in a round
    contributes nothing, and afterwards holds the same gradient as the others. One extra element
    in the first bucket counts the contributors, so ``average=True`` (PipeDream's per-round mean)
    divides by the replicas that really ran a backward. With ``group=None`` (one replica) nothing
    travels and only the averaging applies. Buckets go out asynchronously and are waited on
    together, so later buckets overlap the copy-back of earlier ones.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: dist.ProcessGroup | None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.buckets = _buckets(self.params, bucket_bytes)
        self.calls = 0

    def reduce(self, *, average: bool = False) -> int:
        """All-reduce (sum) the gradients; returns how many replicas contributed a gradient.

        ``average=True`` divides the sum by that count.
        """
        self.calls += 1
        contributed = any(p.grad is not None for p in self.params)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flats, works = [], []
        for i, bucket in enumerate(self.buckets):
            parts = [p.grad.reshape(-1) for p in bucket]
            if i == 0:  # the contributor count travels with the first bucket
                parts.append(torch.ones(1, dtype=bucket[0].dtype, device=bucket[0].device) * float(contributed))
            flat = torch.cat(parts)
            flats.append(flat)
            if self.group is not None:
                works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        with pipeline_failures(None, waiting="the stage replicas' gradient all-reduce"):
            for work in works:
                work.wait()
        count = int(round(float(flats[0][-1]))) if flats else int(contributed)
        scale = 1.0 / count if average and count > 1 else 1.0
        for bucket, flat in zip(self.buckets, flats):
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                if scale != 1.0:
                    p.grad.mul_(scale)
                offset += n
            # Freed now, not when the last reference goes: a backend's work object may hold the buffer after wait()
            # (measured: gloo's, now and then, past the update that follows), and the flat copy is the replicated
            # path's peak (plan.memory's sync_working).
            flat.untyped_storage().resize_(0)
        return count


def _buckets(params: Sequence[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """Consecutive parameters of one dtype and device grouped up to ``bucket_bytes`` (a larger parameter alone)."""
    buckets: list[list[Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > bucket_bytes or (last[0].dtype, last[0].device) != (p.dtype, p.device):
            buckets.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return buckets
