"""Validation, test, predict and generation through the pipeline; may import ``setup``, ``checkpoints`` and
``reporting``."""
