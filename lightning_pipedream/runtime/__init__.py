"""How it runs (torch.distributed, no Lightning), in rooms that import one way: ``faults`` <- ``communication`` <-
``stages`` <- ``execution`` <- :mod:`.pipeline`, the standalone API."""
