"""A progress line on stderr for the steps that take long (lowering a model, searching, sweeping clusters), shown
only when stderr is a terminal; the library reports steps through a plain callback."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console


@contextlib.contextmanager
def status_line(console: Console, first: str) -> Iterator[Callable[[str], None]]:
    """A callback that replaces the status line's text; a no-op when `console` is not a terminal."""
    if not console.is_terminal:
        yield lambda _text: None
        return
    with console.status(first) as status:
        yield lambda text: status.update(text)
