"""`python -m lightning_pipedream plan|simulate|show`: plans and timelines without training (never loads Lightning)."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that provides `add_arguments(parser)` and `run(args) -> int`
COMMANDS = {
    "plan": ("lightning_pipedream.cli.plan", "profile a model or read a PipeDream profile, and partition it"),
    "simulate": ("lightning_pipedream.cli.simulate", "predict step time, bubble and memory of a schedule"),
    "show": ("lightning_pipedream.cli.show", "print a schedule as a step x rank grid"),
    "reproduce-table": (
        "lightning_pipedream.cli.reproduce_table",
        "PipeDream's Table 1 (SOSP'19) predicted from its published profiles: configurations and speedups",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand and return its exit status."""
    parser = argparse.ArgumentParser(prog="python -m lightning_pipedream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except Exception as err:
        if not _is_input_error(err):
            raise  # a programming error: its traceback is what a bug report needs
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2


def _is_input_error(err: Exception) -> bool:
    """The project's own errors about what the user gave (a bad file, flag or value), and the operating system's
    about the files named (missing, unreadable, a directory): a one-line message, not a traceback."""
    from lightning_pipedream.cli.show import UsageError

    if isinstance(err, (UsageError, OSError)):
        return True
    errors = sys.modules.get("lightning_pipedream.plan.errors")  # loaded only by commands that read plans/profiles
    return errors is not None and isinstance(err, errors.InputFormatError)
