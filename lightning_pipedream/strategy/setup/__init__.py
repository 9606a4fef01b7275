"""What setup decides and builds: options, placement, planning, the graph path, pretrained weights, the checks, and
the stage pipeline itself; may import ``reporting`` and ``checkpoints``."""
