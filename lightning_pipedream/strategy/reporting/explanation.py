"""At the end of a fit, on rank 0: the plan's prediction against what every stage measured (``plan/explain.py``),
printed as a table, kept on the strategy (``strategy.explanation``) and written into a merged trace's metadata."""

from __future__ import annotations

import logging
from typing import Any

from lightning_pipedream.plan.explain import ExplainError, Explanation, explain
from lightning_pipedream.strategy.reporting.stage_figures import RankFigures

log = logging.getLogger("lightning_pipedream.strategy")


def measured_ranks(totals: dict[int, RankFigures]) -> list[dict[str, Any]]:
    """Each rank's mean per training step of every part (seconds), from the fit's totals (JSON-ready)."""
    out = []
    for rank, r in sorted(totals.items()):
        f, n = r.figures, max(r.figures.steps, 1)
        out.append({"rank": rank, "stage": r.stage, "replica": r.replica, "steps": f.steps,
                    "compute": f.compute / n, "wait": f.wait / n, "transfer": f.transfer / n, "update": f.update / n,
                    "other": f.other / n, "step": f.step / n})
    return out


def explain_fit(plan: Any, ranks: list[dict[str, Any]], replicated: bool) -> Explanation | None:
    """The explanation of the fit against ``plan``, printed; None (and why, at debug level) where there is none to
    give: no plan with stage times (``balance=``), replicated stages, no step measured."""
    if plan is None or replicated:
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
