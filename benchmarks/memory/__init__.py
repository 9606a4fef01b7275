"""Memory: each rank's peak per schedule, the memory model against measurement, sharded replicas, and the GPU check;
imports only ``common``."""
