"""Schedules as data: the action IR, one builder per schedule, a validator, a simulator."""
