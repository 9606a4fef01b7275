"""The benchmarks (run from the repository root, e.g. ``python -m benchmarks.schedules``); see docs/benchmarks.md."""
