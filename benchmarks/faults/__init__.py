"""What a run survives and what saving costs it: processes killed under torchrun with restarts (``kills``) and
asynchronous saves against synchronous ones (``async_save``). ``python -m benchmarks.faults`` runs every part
(``--quick`` for a smoke run); see docs/benchmarks.md."""
