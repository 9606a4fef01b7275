"""The benchmarks, in rooms by what they measure (run from the repository root, e.g. ``python -m
benchmarks.speed.schedules``; see docs/benchmarks.md): ``speed`` (schedules, transports, Lightning), ``memory``
(peaks, the memory model, sharding, the GPU check), ``big_models`` (models built per stage, checkpoints),
``generation``, ``paper`` (PipeDream's claims: replicated stages, the planner's speed); each imports only
``common``, which holds what every benchmark repeats (the workload, workers, medians over rounds, JSON results)."""
