"""Which launchers can express a plan's decisions (DESIGN.md: every plan records who can run it); the rules
live in `solver.capability`, which the search space reads too."""

from __future__ import annotations

from ..capability import runnable_by as _runnable_by
from ..capability import unsupported as _unsupported
from ..plan import Decisions


def unsupported(launcher: str, d: Decisions) -> list[str]:
    """Decisions `launcher` cannot express (empty when it can run the plan as emitted)."""
    return _unsupported(launcher, d, checkpoint=d.checkpoint, lora=d.lora is not None)


def runnable_by(d: Decisions) -> tuple[str, ...]:
    return _runnable_by(d, checkpoint=d.checkpoint, lora=d.lora is not None)
