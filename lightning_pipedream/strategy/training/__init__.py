"""A fit through the pipeline: each batch's step, the updates, the loss scale, drains and the divergence guard; may
import ``setup``, ``checkpoints`` and ``reporting``."""
