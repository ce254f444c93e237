"""Quiet by default: what third-party libraries print while a command runs (Python warnings, log records, and
writes to the process's stdout/stderr from Python or C++ at import and trace time) is captured, shown with
`--verbose`, and listed in `--json` output. fitplan's own messages go to `user_stderr`, which stays the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import IO, Any


class UserStream:
    """A text stream for fitplan's own stderr messages: the terminal's stderr, also while third-party output is
    captured (the CLI's consoles write here, so progress and errors stay visible)."""

    def __init__(self) -> None:
        self.target: IO[str] | None = None

    def _stream(self) -> IO[str]:
        return self.target or sys.stderr

    def write(self, text: str) -> int:
        return self._stream().write(text)

    def flush(self) -> None:
        self._stream().flush()

    def isatty(self) -> bool:
        return self._stream().isatty()

    def fileno(self) -> int:
        return self._stream().fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, ...: the current stream's
        return getattr(self._stream(), name)


user_stderr = UserStream()


class _Recorder(logging.Handler):
    """Keeps the log records third-party libraries emit (with no handler, Python prints them to stderr)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    """Capture third-party output while the block runs; yields the list the captured lines are added to on exit.
    File descriptors 1 and 2 go to a temporary file (C++ and handlers bound to the old streams write there), and
    sys.stdout/sys.stderr with them; `user_stderr` keeps writing to the terminal."""
    lines: list[str] = []
    saved_err, saved_out = os.dup(2), os.dup(1)
    terminal, opened = _terminal(saved_err)
    recorder, root = _Recorder(lines), logging.getLogger()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as sink, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        old_streams, user_stderr.target = (sys.stdout, sys.stderr), terminal
        sys.stdout = sys.stderr = sink
        root.addHandler(recorder)
        try:
            yield lines
        finally:
            root.removeHandler(recorder)
            sys.stdout, sys.stderr = old_streams
            sys.stdout.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            user_stderr.target = None
            if opened:
                terminal.close()
            sink.flush()
            sink.seek(0)
            lines.extend(line.rstrip() for line in sink if line.strip())
            lines.extend(f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught)


def _terminal(saved_err: int) -> tuple[IO[str], bool]:
    """Where fitplan's own messages go while fd 2 is captured: a new stream over the saved terminal fd when
    sys.stderr writes to fd 2, else sys.stderr itself (a test runner's in-memory stream); and whether it was opened
    here."""
    try:
        real = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        real = False
    if not real:
        return sys.stderr, False
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    return os.fdopen(os.dup(saved_err), "w", buffering=1, encoding=encoding, errors="replace"), True
