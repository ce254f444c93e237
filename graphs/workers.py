"""Worker processes for independent work (a model's lowerings, `choose`'s clusters), started only where they can
start: a spawned worker re-imports the caller's main script, and a script that does its work at top level without
an `if __name__ == "__main__":` guard would run again in every worker (Python refuses that with "An attempt has
been made to start a new process before the current process has finished its bootstrapping phase"). Such callers
get the work done in their own process, one item after another."""

from __future__ import annotations

import multiprocessing
import re
import sys
from multiprocessing.context import BaseContext
from pathlib import Path

GUARD = re.compile(r"""^if\s+__name__\s*==\s*["']__main__["']\s*:""", re.MULTILINE)


def spawn_context() -> BaseContext | None:
    """The spawn context (the caller may hold OR-Tools' or torch's threads: never fork), or None where a spawned
    worker would re-run the caller's unguarded main script."""
    return multiprocessing.get_context("spawn") if main_is_guarded() else None


def main_is_guarded() -> bool:
    """Whether re-importing `__main__` in a worker runs nothing: no script (an interpreter prompt, `python -c`, a
    notebook), a package run with `python -m` (multiprocessing skips its `__main__`), or a script whose work sits
    under an `if __name__ == "__main__":` guard (console scripts such as `fitplan` are)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.endswith(".__main__"):  # `python -m package`: spawn never re-runs it
        return True
    path = getattr(spec, "origin", None) or getattr(main, "__file__", None)
    if path is None:
        return True
    try:
        source = Path(path).read_text(errors="replace")
    except OSError:  # a frozen or vanished script: do not guess
        return False
    return GUARD.search(source) is not None
