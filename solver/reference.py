"""The reference: enumerate every outer configuration and every canonical per-layer assignment, evaluating each
with the same tables as the CP-SAT model. Exponential; for tests and small instances."""

from __future__ import annotations

from dataclasses import dataclass

from graphs import Checkpoint

from .space import all_counts, canonical_modes
from .tables import Table, objective, tie_weight


@dataclass(frozen=True, slots=True)
class Best:
    objective: int
    table: int
    modes: tuple[Checkpoint, ...]
    evaluated: int


def enumerate_best(tables: list[Table], kinds: list[int], modes: tuple[Checkpoint, ...]) -> Best | None:
    """The feasible assignment with the smallest objective, or None when nothing fits."""
    weight = tie_weight(tables, len(kinds))
    assignments = [canonical_modes(kinds, counts) for counts in all_counts(kinds, modes)]
    best: Best | None = None
    evaluated = 0
    for k, table in enumerate(tables):
        if not table.host_ok:
            continue
        for assignment in assignments:
            if not all(table.outer.runs(mode) for mode in set(assignment)):
                continue  # no launcher that runs this configuration expresses one of these modes
            evaluated += 1
            if table.peak_of(assignment) > table.budget:
                continue
            value = objective(table, assignment, tie_weight=weight)
            if best is None or value < best.objective:
                best = Best(value, k, assignment, 0)
    return None if best is None else Best(best.objective, best.table, best.modes, evaluated)
