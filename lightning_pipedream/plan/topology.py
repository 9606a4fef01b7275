"""Topology: levels of workers and the bandwidth that joins them, innermost level first."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _format_bandwidth(bandwidth: float) -> str:
    if math.isinf(bandwidth):
        return "free links"
    return f"{bandwidth / 1e9:g} GB/s"


@dataclass(frozen=True)
class Topology:
    """Workers grouped in levels, innermost first: ``[(4, 10e9), (4, 1.25e9)]`` is 4 servers of 4 workers,
    10 GB/s between workers of a server and 1.25 GB/s between servers (PipeDream's ``-n 4 4 -b 10e9 1.25e9``)."""

    levels: tuple[tuple[int, float], ...]

    def __init__(self, levels: list[tuple[int, float]] | tuple[tuple[int, float], ...]) -> None:
        checked = []
        if not levels:
            raise ValueError("A topology needs at least one level of (workers, bandwidth), e.g. [(4, 1e9)].")
        for position, level in enumerate(levels):
            try:
                workers, bandwidth = level
            except (TypeError, ValueError):
                raise ValueError(
                    f"Topology level {position} is {level!r}; give (workers, bandwidth in bytes/s)."
                ) from None
            if isinstance(workers, float) and float(workers).is_integer():
                workers = int(workers)
            if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
                raise ValueError(f"Topology level {position} has {workers!r} workers; use a whole number >= 1.")
            bandwidth = float(bandwidth)
            if not bandwidth > 0:
                raise ValueError(f"Topology level {position} has bandwidth {bandwidth!r}; use bytes per second > 0.")
            checked.append((workers, bandwidth))
        object.__setattr__(self, "levels", tuple(checked))

    @classmethod
    def flat(cls, num_workers: int, bandwidth: float = math.inf) -> Topology:
        """``num_workers`` workers joined by links of ``bandwidth`` bytes per second."""
        return cls([(num_workers, bandwidth)])

    @classmethod
    def of_cluster(cls, processes_per_node: int, nodes: int, bandwidth: float | list[float] | tuple[float, ...]
                   ) -> Topology:
        """The processes a Trainer runs: ``nodes`` machines of ``processes_per_node`` each; ``bandwidth`` is
        bytes/s between processes, or ``[within a node, between nodes]``."""
        speeds = [float(b) for b in bandwidth] if isinstance(bandwidth, (list, tuple)) else [float(bandwidth)] * 2
        if len(speeds) != 2:
            raise ValueError(
                f"bandwidth={list(bandwidth)}: give one number (bytes/s between any two processes) or two "  # type: ignore[arg-type]
                "([within a node, between nodes])."
            )
        if nodes == 1:
            return cls.flat(processes_per_node, speeds[0])
        return cls([(processes_per_node, speeds[0]), (nodes, speeds[1])])

    @property
    def num_workers(self) -> int:
        return math.prod(workers for workers, _ in self.levels)

    def check_processes(self, num_processes: int) -> None:
        """Raise ``ValueError`` unless the topology has exactly one worker per process."""
        if self.num_workers != num_processes:
            shape = " x ".join(str(w) for w, _ in reversed(self.levels))
            raise ValueError(
                f"The topology {shape} has {self.num_workers} workers but there are {num_processes} processes; "
                f"make the product of the levels' workers equal {num_processes}."
            )

    def bandwidth_between(self, worker_a: int, worker_b: int) -> float:
        """Bandwidth of the innermost level whose group holds both workers (ranks laid out level by level)."""
        group = 1
        for workers, bandwidth in self.levels:
            group *= workers
            if worker_a // group == worker_b // group:
                return bandwidth
        return self.levels[-1][1]

    def describe(self) -> str:
        parts = [f"{w} workers at {_format_bandwidth(b)}" for w, b in self.levels]
        return f"{self.num_workers} workers: " + ", then ".join(parts)

    def to_json(self) -> list[list[float]]:
        return [[w, b] for w, b in self.levels]
