"""Speed of the schedules and transports: steps/s against the machine's bound and the peers, under Lightning too, and
their timelines; imports only ``common``."""
