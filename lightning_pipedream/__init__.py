"""Pipeline-parallel training for PyTorch Lightning: GPipe, 1F1B and PipeDream with weight stashing."""

from lightning_pipedream.runtime.pipeline import Pipeline
from lightning_pipedream.schedule.builders import SCHEDULES, build_schedule
from lightning_pipedream.strategy import PipeDreamStrategy  # registers Trainer(strategy="pipedream")

__version__ = "0.1.0"

__all__ = ["PipeDreamStrategy", "Pipeline", "SCHEDULES", "build_schedule", "__version__"]
