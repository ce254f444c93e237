"""Lazy re-exports for a package's `__init__` (PEP 562): `from graphs import Checkpoint` loads graphs.layer
alone, not the lowering code beside it, so the command line and a cached solve import only what they use."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`, whose public names live in the modules `where` maps them to."""
    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
