"""Steps marked ``@generates`` as setup and the pipelined steps meet them: which hook is marked, and the step the
strategy runs through the pipeline now (or whose forward call setup captures), which ``generate`` reads to make the
model's plain forward call at setup, or to refuse in an unmarked step."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

GENERATES = "_pipedream_generates"  # the attribute ``@generates`` sets on a step


def generating_step(module: nn.Module, hook: str) -> bool:
    """Whether ``module``'s ``hook`` is marked with ``@generates`` (:func:`~lightning_pipedream.generates`)."""
    return bool(getattr(getattr(module, hook, None), GENERATES, False))


# The step the strategy runs through the pipeline now, or whose forward call setup captures: (hook, marked).
PIPELINED_STEP: contextvars.ContextVar[tuple[str, bool] | None] = contextvars.ContextVar("pipelined_step",
                                                                                          default=None)


@contextmanager
def pipelined_step(module: nn.Module, hook: str) -> Iterator[None]:
    """While the strategy runs ``module``'s ``hook`` to find its pipelined call (setup's capture, or an unmarked
    step split at its ``self(...)``): :func:`generate` called from a step marked with :func:`generates` makes the
    model's plain forward call once (what setup builds the pipeline from), and from an unmarked step it refuses,
    saying to mark the step."""
    token = PIPELINED_STEP.set((hook, generating_step(module, hook)))
    try:
        yield
    finally:
        PIPELINED_STEP.reset(token)


def unmarked_step_words(module: nn.Module, hook: str) -> str:
    """What an unmarked step that calls :func:`generate` under the strategy is told."""
    name = type(module).__name__
    if hook == "training_step":
        return (f"{name}.training_step called generate() under PipeDreamStrategy, which splits a training step at its "
                "self(...) call. Generate from a validation_step, test_step or predict_step marked with @generates "
                "(from lightning_pipedream import generates), or after fit on every rank.")
    return (f"{name}.{hook} calls generate() but is not marked with @generates, so PipeDreamStrategy splits it at its "
            "model call between the stages instead of decoding around the pipeline's ring. Mark the step: "
            f"`from lightning_pipedream import generates`, then `@generates` on the line above `def {hook}`.")
