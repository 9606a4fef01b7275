"""`python -m lightning_pipedream plan|simulate|show`: see :mod:`lightning_pipedream.cli`; `python -m
lightning_pipedream checkpoint consolidate|export-hf`: see :mod:`lightning_pipedream.strategy.checkpoint_commands`
(it reads Lightning's checkpoints, so it lives with the strategy, apart from the commands that never load Lightning)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["checkpoint"]:
        from lightning_pipedream.strategy.checkpoint_commands import main as checkpoint_main

        sys.exit(checkpoint_main(sys.argv[2:]))
    from lightning_pipedream.cli import main

    sys.exit(main())
