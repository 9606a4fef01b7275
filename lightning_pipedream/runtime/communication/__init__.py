"""How ranks talk: tensor trees between pipeline ranks (gloo, shared memory, NCCL-safe directions) and micro-batches."""
