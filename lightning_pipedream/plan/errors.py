"""Errors for malformed inputs (profiles, plans, PipeDream graph.txt, CLI arguments).

Each is a ``ValueError`` whose message names the file, line or field that is wrong and says how to fix it;
the CLI prints it as one line (``error: ...``) and exits with status 2 instead of showing a traceback.
"""

from __future__ import annotations

import math
from typing import Any


class InputFormatError(ValueError):
    """An input file or argument is malformed; the message names the file, line or field."""


class ProfileFormatError(InputFormatError):
    """A profile JSON or a PipeDream graph.txt is malformed."""


class PlanFormatError(InputFormatError):
    """A plan JSON is malformed."""


def is_number(value: Any) -> bool:
    """A JSON number (not a bool) that is finite and >= 0, and small enough to become a float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        as_float = float(value)
    except OverflowError:
        return False
    return as_float >= 0 and not math.isinf(as_float)


def is_whole(value: Any, least: int = 0) -> bool:
    """A whole number >= ``least`` (an int, or a float such as 3.0; not a bool), small enough for a float."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= least and is_number(value)
