"""Where tables for people are printed: a rich console on stdout, shared by the CLI verbs
and the library's own reports (``torchgpu bench``), so neither imports the other."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

PIPED_WIDTH = 160  # columns for tables written to a pipe or a log file


def make_console() -> Console:
    """A rich console on stdout: the terminal's width, or ``PIPED_WIDTH`` columns when
    stdout is a pipe or file (rich would otherwise squeeze tables into 80 columns)."""
    from rich.console import Console

    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(file=sys.stdout, highlight=False, width=PIPED_WIDTH if piped else None)
