"""The layer that knows Lightning: ``PipeDreamStrategy`` and the small objects its hooks delegate to.

Importing it registers ``strategy="pipedream"``, ``"pipedream_1f1b"`` and ``"pipedream_gpipe"`` with Lightning.

Its rooms import one way: ``reporting`` and ``checkpoints`` (the bottom, apart) <- ``setup`` <- ``training`` and
``inference`` (apart) <- :mod:`.pipedream`, the strategy's face.
"""

from lightning_pipedream.strategy.pipedream import SCHEDULES, PipeDreamStrategy
from lightning_pipedream.strategy.setup.checks import NonFiniteError

__all__ = ["NonFiniteError", "PipeDreamStrategy", "SCHEDULES"]
