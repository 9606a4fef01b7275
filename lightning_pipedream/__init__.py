"""Pipeline-parallel training for PyTorch Lightning: GPipe, 1F1B and PipeDream with weight stashing."""

from lightning_pipedream.schedule.builders import SCHEDULES, build_schedule

__version__ = "0.1.0"

__all__ = ["SCHEDULES", "build_schedule", "__version__"]
