"""At the end of a fit, on rank 0: the plan's prediction against what every stage measured (``plan/explain.py``),
printed as a table, kept on the strategy (``strategy.explanation``) and written into a merged trace's metadata.

Each rank's figures carry how many of the plan's minibatches its training step held (``minibatches_per_step``,
:func:`minibatches_per_step`), so that ``plan/explain.py`` compares like with like: the plan's figures are per
minibatch of its profile and per replica, with a replicated stage's minibatches shared among its replicas."""

from __future__ import annotations

import logging
import math
from typing import Any

from lightning_pipedream.plan.explain import ExplainError, Explanation, explain
from lightning_pipedream.strategy.reporting.stage_figures import RankFigures

log = logging.getLogger("lightning_pipedream.strategy")


def minibatches_per_step(plan: Any, stage: int, *, samples_per_step: float | None, minibatches_per_batch: int = 1,
                         layout_replicas: tuple[int, ...] | None = None) -> float:
    """How many of ``plan``'s minibatches one training step of a replica of ``stage`` held.

    A plan's stage figure is per replica, for ``batch / replicas`` samples of its minibatch of ``batch`` samples (the
    profile's batch size, ``plan.extra["profile"]``; the strategy profiles the first training batch whole; a traced
    graph's split-point plan says ``plan.extra["batch_size"]``: it is profiled on one micro-batch, so a step holds
    ``chunks`` of its minibatches). A replica
    runs per step: the whole batch of its pipeline (``samples_per_step``, the mean over the fit) on a straight pipeline
    or on ``d`` data-parallel pipelines, and ``1 / r`` of it on a stage of ``r`` replicas of PipeDream's 1F1B-RR
    (``layout_replicas``; round robin, in the steady state). Without the profile's batch size, the plan's minibatch is
    taken to be the run's: ``1 / minibatches_per_batch`` of the batch, or under 1F1B-RR one input replica's share.
    """
    stages = getattr(plan, "stages", None) or []
    planned = stages[stage].replicas if stage < len(stages) and not plan.extra.get("chunk_stages") else 1
    share = 1.0 / layout_replicas[stage] if layout_replicas is not None else 1.0  # of the batch, per replica
    profile = plan.extra.get("profile") if isinstance(getattr(plan, "extra", None), dict) else None
    profiled = profile.get("batch_size") if isinstance(profile, dict) else None
    if not profiled and isinstance(getattr(plan, "extra", None), dict):  # a traced graph's plan: one micro-batch's
        profiled = plan.extra.get("batch_size")
    if profiled and samples_per_step:
        return samples_per_step * share * planned / float(profiled)
    run_minibatches = layout_replicas[0] if layout_replicas is not None else max(1, minibatches_per_batch)
    return share * planned * run_minibatches


def measured_ranks(totals: dict[int, RankFigures], per_step: dict[int, float] | None = None,
                   predicted_bytes: list[float] | None = None) -> list[dict[str, Any]]:
    """Each rank's mean per training step of every part (seconds), from the fit's totals (JSON-ready); ``per_step``:
    each stage's :func:`minibatches_per_step` (1 where absent). On CUDA also ``device_compute``: the compute actions'
    time on the device (CUDA events), which ``plan/explain.py`` then takes for the stage's compute. Where measured,
    ``peak_live_bytes``: the traced window's peak of live tensor bytes (``live_memory.py``), and where the memory model
    predicted the stage, ``predicted_memory_bytes``."""
    out = []
    for rank, r in sorted(totals.items()):
        f, n = r.figures, max(r.figures.steps, 1)
        row: dict[str, Any] = {"rank": rank, "stage": r.stage, "replica": r.replica, "steps": f.steps,
                               "compute": f.compute / n, "wait": f.wait / n, "transfer": f.transfer / n,
                               "update": f.update / n, "other": f.other / n, "step": f.step / n,
                               "minibatches_per_step": (per_step or {}).get(r.stage, 1.0)}
        if f.device_actions:
            row["device_compute"] = f.device_compute / n
        if math.isfinite(r.live_peak_bytes):
            row["peak_live_bytes"] = r.live_peak_bytes
        if predicted_bytes is not None and r.stage < len(predicted_bytes):
            row["predicted_memory_bytes"] = predicted_bytes[r.stage]
        out.append(row)
    return out


def fit_minibatches(plan: Any, num_stages: int, samples_per_step: float | None, minibatches_per_batch: int,
                    layout_replicas: tuple[int, ...] | None) -> dict[int, float]:
    """:func:`minibatches_per_step` of every stage (empty without a plan, or a plan it cannot read: said, and the
    fit goes on)."""
    if plan is None:
        return {}
    try:
        return {stage: minibatches_per_step(plan, stage, samples_per_step=samples_per_step,
                                            minibatches_per_batch=minibatches_per_batch,
                                            layout_replicas=layout_replicas) for stage in range(num_stages)}
    except Exception as err:  # the explanation is a help, never a reason for a finished fit to fail
        log.warning("PipeDreamStrategy: the plan's minibatches per training step are unknown (%s: %s); the run is "
                    "explained per step.", type(err).__name__, err)
        return {}


def explain_fit(plan: Any, ranks: list[dict[str, Any]]) -> Explanation | None:
    """The explanation of the fit against ``plan``, printed; None (and why, at debug level) where there is none to
    give: no plan with stage times (``balance=``), no step measured."""
    if plan is None:
        return None
    try:
        explanation = explain(plan, ranks)
    except ExplainError as err:
        log.debug("PipeDreamStrategy: no explanation of the run against its plan: %s", err)
        return None
    except Exception as err:  # the explanation is a help, never a reason for a finished fit to fail
        log.warning("PipeDreamStrategy: no explanation of the run against its plan (%s: %s)", type(err).__name__, err)
        return None
    log.info("PipeDreamStrategy: the plan's prediction against this fit's measured steps\n%s", explanation.table())
    return explanation
