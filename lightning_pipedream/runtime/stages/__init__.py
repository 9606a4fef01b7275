"""One rank's stage and its weights: layers, weight versions, ties, and its replicas (all-reduced or sharded)."""
