"""``python -m benchmarks.faults [--quick]``: every part of the room, one after the other, each writing its JSON."""

from __future__ import annotations

import importlib
import sys

# Each part: a module of this room whose ``main()`` reads its options (``--quick`` among them) from the command line.
# One line a part.
PARTS = [
    "kills",  # seeded kills under torchrun: finished, equal, steps lost, the way back (results/faults.json)
    "async_save",  # the pipeline's stall in an asynchronous save against a synchronous one (results/async_save.json)
]


def main(argv: list[str]) -> None:
    for part in PARTS:
        print(f"== benchmarks.faults.{part}", flush=True)
        sys.argv = [f"benchmarks.faults.{part}", *argv]
        importlib.import_module(f"benchmarks.faults.{part}").main()


if __name__ == "__main__":
    main(sys.argv[1:])
