"""solver: choose the fastest configuration that fits (CP-SAT over every knob), and hand launchers a config.

`solve(model, gpus, ...) -> Plan` and `estimate(model, gpus, config) -> Estimate` are the library calls;
`fitplan` / `solve` are the command-line tools. The names load on first use (`graphs.exports`), so that the command line
and `import solver.plan` do not pay for the search and lowering code they do not run.
"""

from __future__ import annotations

from graphs.exports import lazy_exports

_WHERE = {"estimate": "solver.api", "solve": "solver.api", "Infeasible": "solver.search.diagnose",
          "Plan": "solver.plan.record", "json_schema": "solver.plan.record"}
__all__ = ["Infeasible", "Plan", "estimate", "json_schema", "solve"]
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
