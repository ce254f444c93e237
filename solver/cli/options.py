"""Bounded value types of the CLI options: each refuses, while parsing (exit 2), a value outside its range with
the option's name, the value and what is allowed, and --help shows the range. The bounds are `solver.search.bounds`.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from typing import Any

import typer
from rich.console import Console

# Rich renders help at the terminal's width, 80 columns when output is piped or captured, and then truncates
# long option names ("--offload-para…"); help is rendered at least this wide (TERMINAL_WIDTH still overrides).
HELP_WIDTH = 150


def help_width() -> int:
    """Columns for --help: the terminal's width, at least `HELP_WIDTH`."""
    return max(HELP_WIDTH, shutil.get_terminal_size(fallback=(HELP_WIDTH, 24)).columns)


# Rich renders piped output at 80 columns and cuts table cells to fit ("a100-s…"); piped, the result is rendered
# this wide (the widest table, `fitplan gpus`, needs ~170), and listing columns wrap rather than cut.
PIPED_WIDTH = 200


def result_console() -> Console:
    """The console of the result on stdout: the terminal's width, or `PIPED_WIDTH` when stdout is a pipe or a
    file (an explicit COLUMNS still decides)."""
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=PIPED_WIDTH) if piped else Console()


class Bounded:
    """Parses an int or float option within [lo, hi] (ends open where flagged); nan and inf are refused."""

    def __init__(self, kind: type, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
        self.kind, self.lo, self.hi, self.lo_open, self.hi_open = kind, lo, hi, lo_open, hi_open
        self.__name__ = kind.__name__  # typer names the value type after the parser

    @property
    def allowed(self) -> str:
        """The range in words, e.g. "1 to 2,097,152" or "more than 0 and at most 3,600"."""
        lo, hi = f"{self.lo:,g}" if self.kind is float else f"{self.lo:,}", \
            f"{self.hi:,g}" if self.kind is float else f"{self.hi:,}"
        if not (self.lo_open or self.hi_open):
            return f"{lo} to {hi}"
        above, below = "more than" if self.lo_open else "at least", "less than" if self.hi_open else "at most"
        return f"{above} {lo} and {below} {hi}"

    def __call__(self, value: Any) -> Any:
        try:
            number = self.kind(value)
        except (TypeError, ValueError):
            noun = "an integer" if self.kind is int else "a number"
            raise ValueError(f"{str(value)[:40]!r} is not {noun}; allowed: {self.allowed}.") from None
        low_ok = number > self.lo if self.lo_open else number >= self.lo
        high_ok = number < self.hi if self.hi_open else number <= self.hi
        if not (math.isfinite(number) and low_ok and high_ok):
            raise ValueError(f"{str(value)[:40]} is out of range; allowed: {self.allowed}.")
        return number


def number(kind: type, lo: float, hi: float, help: str, *, lo_open: bool = False, hi_open: bool = False,
           **extra: Any) -> Any:
    """A typer option of `kind` bounded to [lo, hi], the range shown in --help."""
    parser = Bounded(kind, lo, hi, lo_open=lo_open, hi_open=hi_open)
    return typer.Option(parser=parser, help=f"{help} \\[{parser.allowed}]", **extra)  # "\\[" escapes rich markup


class Text:
    """Parses a string of at most `limit` printable characters (names, lists, cluster strings)."""

    __name__ = "str"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, value: Any) -> str:
        text = str(value)
        if len(text) > self.limit:
            raise ValueError(f"a value of {len(text):,} characters is too long; allowed: at most {self.limit}.")
        if not text.isprintable():
            shown = text[:40].encode("unicode_escape").decode()
            raise ValueError(f"{shown!r} holds control characters; allowed: printable text.")
        return text


def text(limit: int, help: str, *names: str) -> Any:
    """A typer string option of at most `limit` printable characters."""
    return typer.Option(*names, parser=Text(limit), help=help)
