"""solver: choose the fastest configuration that fits (CP-SAT over every knob), and hand launchers a config.

`solve(model, gpus, ...) -> Plan` and `estimate(model, gpus, config) -> Estimate` are the library calls;
`fitplan` / `solve` are the command-line tools.
"""

from solver.api import estimate, solve
from solver.plan.record import Plan, json_schema
from solver.search.diagnose import Infeasible

__all__ = ["Infeasible", "Plan", "estimate", "json_schema", "solve"]
