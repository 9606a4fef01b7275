"""How it runs: transport, stages, weight versions and the executor (torch.distributed, no Lightning)."""
