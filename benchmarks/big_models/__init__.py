"""Models bigger than one process: built and loaded per stage, fine-tuned, and their checkpoints saved and
consolidated; imports only ``common``."""
