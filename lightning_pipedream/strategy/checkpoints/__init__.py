"""Checkpoints of a pipeline: single-file (gathered), sharded (each rank its own share), and the commands that turn
one into the other; imports no other room of strategy/ (it reads setup's pipeline through a protocol)."""
