"""PipeDream's claims: replicated stages (the planner's hybrid plans) against straight pipelines and DDP, and how fast
the planner plans; imports only ``common``."""
