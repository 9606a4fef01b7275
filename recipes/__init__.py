"""Hydra recipes for the PipeDream paper's four tasks: models, data modules, tasks and the train entry point."""
