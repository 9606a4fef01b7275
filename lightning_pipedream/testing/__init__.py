"""What the tests and benchmarks check the package against, never used in training: a model of NCCL's rules."""
