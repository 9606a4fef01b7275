"""The layer that knows Lightning: ``PipeDreamStrategy`` and the small objects its hooks delegate to.

Importing it registers ``strategy="pipedream"``, ``"pipedream_1f1b"`` and ``"pipedream_gpipe"`` with Lightning.
"""

from lightning_pipedream.strategy.checks import NonFiniteError
from lightning_pipedream.strategy.pipedream import SCHEDULES, PipeDreamStrategy

__all__ = ["NonFiniteError", "PipeDreamStrategy", "SCHEDULES"]
