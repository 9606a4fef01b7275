"""Lightning's collectives during a pipelined run (barriers, broadcasts, ``self.log(sync_dist=True)``'s reductions,
``self.all_gather``, callbacks' decisions): issued where every rank is at the same point of the schedule, every wait
bounded and named.

Every rank runs the same Lightning hooks at the same batch, so a collective Lightning issues from a hook is called
by every rank at the same hook. Under a synchronous schedule that is the same point of the schedule. Under an
asynchronous one (``pipedream``, ``2bw``) it is not: at a batch boundary the stages hold different minibatches, and a
collective of the pipeline that spans the boundary (a tied weight's all-reduce, issued by the last stage for
minibatch t in step t and by the first in step t + stages - 1) waits on a rank that is already in Lightning's
collective: a circle (issue #52). So, before such a collective, every rank drains the pipeline (a point every rank
reaches alike, as validation's and checkpoints' drains are), then issues it; the drain costs the pipeline's overlap
once, and is said once per collective. Inside a pipelined step only one stage runs the user's step, so a collective
there is refused in words (it would wait forever for the ranks that do not run it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor

from lightning_pipedream.runtime.faults.failures import pipeline_failures

log = logging.getLogger(__name__)

T = TypeVar("T")

_inside: list[str] = []  # the pipelined step running on this rank ("training_step"), innermost last
_said: set[str] = set()  # collectives whose drain was said already (once per process)


@contextmanager
def inside_step(hook: str) -> Iterator[None]:
    """Around a pipelined step (``training_step``, ``validation_step``, ...): the user's code inside runs on some
    ranks only."""
    _inside.append(hook)
    try:
        yield
    finally:
        _inside.pop()


def before_collective(what: str, asynchronous_fit: bool, drain: Callable[[], None], say: bool = True) -> None:
    """Before one of Lightning's collectives (``what``: "Lightning's broadcast from rank 0"): refuse it inside a
    pipelined step; drain first during an asynchronous fit (see the module's text). ``say``: this rank says so (once
    per collective; rank 0 does)."""
    if _inside:
        hook = _inside[-1]
        raise RuntimeError(
            f"{what} was called inside {hook} under PipeDreamStrategy. Only the stage that computes the loss runs "
            f"{hook} (the others run their layers), so a collective there waits forever for ranks that never call "
            f"it. Move it to a hook every rank runs (on_train_batch_end, on_validation_epoch_end, ...), or log "
            f"without sync_dist in {hook}: every rank logs the value the last stage computed, nothing to reduce."
        )
    if not asynchronous_fit:
        return
    if say and what not in _said:
        _said.add(what)
        log.info("PipeDreamStrategy: %s during an asynchronous schedule's fit: every rank drains the pipeline first, "
                 "so that no collective of the pipeline spans it (this costs the pipeline's overlap at each call; "
                 "docs/strategy.md, \"Collectives\").", what)
    drain()


@contextmanager
def lightning_collective(strategy: Any, what: str) -> Iterator[None]:
    """Around one of Lightning's collectives on ``strategy`` (a PipeDreamStrategy): :func:`before_collective`, then
    the wait bounded by the timeout and named (a peer's failure reaches this rank as its own words)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING and (
        trainer.state.status == TrainerStatus.RUNNING)
    before_collective(what, fitting and _asynchronous(strategy), strategy.drain, say=strategy.is_global_zero)
    with pipeline_failures(None, waiting=what):
        yield


def _asynchronous(strategy: Any) -> bool:
    try:
        return bool(strategy.asynchronous)
    except RuntimeError:  # schedule="auto" before setup decides it: no pipeline runs yet, nothing to drain
        return False


# The strategy's own methods (PipeDreamStrategy's class body takes them): DDPStrategy's, around lightning_collective.
def barrier(strategy: Any, name: str | None = None) -> None:
    with lightning_collective(strategy, f"Lightning's barrier{f' {name!r}' if name else ''}"):
        DDPStrategy.barrier(strategy, name)


def broadcast(strategy: Any, obj: T, src: int = 0) -> T:
    with lightning_collective(strategy, f"Lightning's broadcast from rank {src}"):
        return DDPStrategy.broadcast(strategy, obj, src)


def reduce(strategy: Any, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
    if not isinstance(tensor, Tensor):  # DDPStrategy returns it as it is
        return tensor
    with lightning_collective(strategy, "Lightning's all-reduce (self.log(sync_dist=True), a callback's decision)"):
        return DDPStrategy.reduce(strategy, tensor, group=group, reduce_op=reduce_op)


def all_gather(strategy: Any, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
    with lightning_collective(strategy, "Lightning's all-gather (self.all_gather)"):
        return DDPStrategy.all_gather(strategy, tensor, group=group, sync_grads=sync_grads)
