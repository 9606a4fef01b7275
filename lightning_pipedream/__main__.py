"""`python -m lightning_pipedream plan|simulate|show`: plans and timelines without training."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that provides `add_arguments(parser)` and `run(args) -> int`
_COMMANDS = {
    "plan": ("lightning_pipedream.plan.cli", "profile a model or read a PipeDream profile, and partition it"),
    "simulate": ("lightning_pipedream.schedule.cli_simulate", "predict step time, bubble and memory of a schedule"),
    "show": ("lightning_pipedream.schedule.cli_show", "print a schedule as a step x rank grid"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipedream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    module = importlib.import_module(_COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
