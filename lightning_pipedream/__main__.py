"""`python -m lightning_pipedream plan|simulate|show`: see :mod:`lightning_pipedream.cli`; `python -m
lightning_pipedream checkpoint consolidate|export-hf`: see
:mod:`lightning_pipedream.strategy.checkpoints.checkpoint_commands` (it reads Lightning's checkpoints, so it lives
with the strategy, apart from the commands that never load Lightning)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run one command (``argv``: the arguments after ``python -m lightning_pipedream``) and return its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["checkpoint"]:
        from lightning_pipedream.strategy.checkpoints.checkpoint_commands import main as checkpoint_main

        return checkpoint_main(argv[1:])
    from lightning_pipedream.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
