"""`python -m lightning_pipedream plan|simulate|show`: see :mod:`lightning_pipedream.cli`."""

import sys

from lightning_pipedream.cli import main

if __name__ == "__main__":
    sys.exit(main())
