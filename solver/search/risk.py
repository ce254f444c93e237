"""The memory risk a plan takes, stated rather than hidden (issue 35 items 3 and 4): a faster configuration that
only the headroom refuses is named with the headroom that accepts it, and a plan whose margin is below the
estimate's measured error for the code that runs it gives way to the next plan within a small time cost."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources

from costmodels.verdict import fits, headroom_to_fit
from solver.plan.launchers.support import MEGATRON_PRICED, TITAN_PRICED
from solver.plan.record import Alternative, Plan
from solver.search.diagnose import Infeasible, NoPlanInTime
from solver.search.pins import Pins
from solver.search.request import Request

# A safer plan is preferred when it costs at most this share of the step more, and a riskier one is pointed out
# only when it saves more than this: a 3% step is within the time model's median error on most sources
# (docs/fidelity.md, "Time against published throughputs": 4.4-11.8% median per source).
RISK_WORTH = 0.03
# The searches that only state a risk (a safer or a riskier plan beside the one found) take this share of the time
# limit each, so that they add a bounded fraction to the solve.
SIDE_SHARE = 0.25
GIB = 2**30

Search = Callable[[Request, Pins], Plan]


@dataclass(frozen=True, slots=True)
class Uncertainty:
    """How far a real run's allocated peak can exceed the estimate for the code that runs a plan."""
    runtime: str
    method: str
    under: float
    """Fraction of the estimated allocated peak."""
    source: str


@cache
def _table() -> dict[tuple[str, str], Uncertainty]:
    text = resources.files("solver.search").joinpath("data", "memory_uncertainty.json").read_text()
    return {(row["runtime"], row["method"]): Uncertainty(row["runtime"], row["method"], row["under"], row["_source"])
            for row in json.loads(text)["runtimes"]}


def uncertainty(plan: Plan) -> Uncertainty:
    """The measured error of the estimate for the code `plan` was priced on (torchtitan's, megatron-core's or the
    HF modeling code) and its method (adapters or full fine-tuning)."""
    attention = plan.decisions.attention
    runtime = "torchtitan" if attention == TITAN_PRICED else "megatron" if attention == MEGATRON_PRICED else "hf"
    method = "lora" if plan.decisions.lora is not None and runtime == "hf" else "full"
    return _table()[(runtime, method)]


def margin(plan: Plan) -> int:
    """Usable bytes left at the plan's device peak (its verdict's margin)."""
    return fits(plan.estimate, plan.inputs.cluster.gpu_memory_bytes, plan.inputs.headroom).margin


def _error_bytes(plan: Plan) -> int:
    """Bytes by which a real run's allocated peak may exceed the plan's estimate (`uncertainty`)."""
    return int(uncertainty(plan).under * plan.estimate.memory.allocated_peak)


def _headroom_bytes(plan: Plan) -> int:
    capacity = plan.inputs.cluster.gpu_memory_bytes
    return capacity - fits(plan.estimate, capacity, plan.inputs.headroom).usable


def with_margin(request: Request, pins: Pins, found: Plan, search: Search) -> Plan:
    """`found`, or the plan searched with the estimate's error kept free beside the headroom when `found`'s margin
    is below that error and the safer plan costs at most RISK_WORTH more; either way the plan says why."""
    error = uncertainty(found)
    needed = _error_bytes(found)
    left = margin(found)
    if left >= needed:
        return found
    capacity = found.inputs.cluster.gpu_memory_bytes
    stricter = request.headroom + needed / capacity  # the usable memory less the error: margin >= error
    what = (f"its margin ({left / GIB:.2f} GiB) is below the estimate's measured error for {error.runtime} "
            f"{error.method} plans ({error.under:.1%} of the allocated peak, {needed / GIB:.2f} GiB; "
            "solver/search/data/memory_uncertainty.json)")
    safer = _searched_or_none(_side(request, stricter), pins, search) \
        if stricter < 1 else None
    if safer is not None and safer.estimate.time.step_time <= found.estimate.time.step_time * (1 + RISK_WORTH):
        cost = safer.estimate.time.step_time / found.estimate.time.step_time - 1
        note = (f"memory risk: {found.decisions.summary()} was {cost:.1%} faster, but {what}; this plan keeps "
                f"that error free (within the {RISK_WORTH:.0%} fitplan trades for it)")
        # the same job and headroom as asked (the stricter search was fitplan's own): found's inputs, and its
        # alternatives, which the budget-only search left out
        return _noted(replace(safer, inputs=found.inputs, alternatives=found.alternatives), note)
    why = "no plan keeps that error free" if safer is None else \
        (f"the fastest plan that keeps it free is {_slower(safer, found):.1%} "
         f"slower (more than the {RISK_WORTH:.0%} fitplan trades for it)")
    return _noted(found, f"memory risk: {what}; {why}, so this plan is kept at that risk")


def inside_headroom(request: Request, pins: Pins, found: Plan, search: Search) -> Plan:
    """`found` with, where memory binds it, the faster plan the headroom alone refuses (more than RISK_WORTH
    faster, keeping the estimate's error free) as its first alternative, with the card's memory it leaves and the
    --headroom that plans it. No side search when the caller asks for no alternatives (`choose`'s sweep)."""
    # Inside the headroom, the estimate's own error is still kept free: a plan within it is no risk to offer.
    error = _error_bytes(found) / found.inputs.cluster.gpu_memory_bytes
    if request.alternatives <= 0 or error >= request.headroom or not found.binding.startswith("device memory"):
        return found
    risky = _searched_or_none(_side(request, error), pins, search)
    if risky is None or risky.estimate.time.step_time >= found.estimate.time.step_time * (1 - RISK_WORTH):
        return found
    same = risky.decisions.summary()  # the same configuration may be listed among the misfits: once is enough
    others = tuple(alt for alt in found.alternatives if alt.decisions != same)
    return replace(found, alternatives=(_risky_alternative(risky, found, request.headroom), *others))


def refusal_inside_headroom(request: Request, pins: Pins, refused: Infeasible, search: Search) -> Infeasible:
    """The refusal, saying so when a plan fits the card inside the headroom (the user's risk to take)."""
    if request.headroom <= 0:
        return refused
    risky = _searched_or_none(_side(request, 0.0), pins, search)
    if risky is None or margin(risky) + _headroom_bytes(risky) < _error_bytes(risky):
        return refused  # nothing fits the card with the estimate's error free
    verdict = fits(risky.estimate, risky.inputs.cluster.gpu_memory_bytes, request.headroom)
    message = (f"{refused.message} Inside the {request.headroom:.0%} headroom, {risky.decisions.summary()} fits the "
               f"card with {verdict.left:.1%} left: at risk, since the headroom covers the estimate's error.")
    hint = f"--headroom {headroom_to_fit(verdict.left):g} plans it. {refused.hint}".strip()
    return Infeasible(message, hint, {**refused.diagnosis, "inside_headroom": risky.decisions.summary(),
                                      "inside_headroom_left": verdict.left})


def _risky_alternative(risky: Plan, found: Plan, headroom: float) -> Alternative:
    verdict = fits(risky.estimate, risky.inputs.cluster.gpu_memory_bytes, headroom)
    faster = 1 - risky.estimate.time.step_time / found.estimate.time.step_time
    return Alternative(decisions=risky.decisions.summary(), step_time=risky.estimate.time.step_time,
                       device_peak=risky.estimate.memory.device_peak, fits=False,
                       why=f"{faster:.1%} faster, but inside the {headroom:.0%} headroom: it fits the card with "
                           f"{verdict.left:.1%} left, at risk (the headroom covers the estimate's error); "
                           f"--headroom {headroom_to_fit(verdict.left):g} plans it")


def _side(request: Request, headroom: float) -> Request:
    """The request at another headroom, for a side search: no alternatives, a share of the time limit."""
    return replace(request, headroom=headroom, alternatives=0, time_limit=request.time_limit * SIDE_SHARE)


def _searched_or_none(request: Request, pins: Pins, search: Search) -> Plan | None:
    """The plan of `request`, or None when nothing fits it or the time limit found none (NoPlanInTime)."""
    try:
        return search(request, pins)
    except (Infeasible, NoPlanInTime):
        return None


def _slower(plan: Plan, than: Plan) -> float:
    return plan.estimate.time.step_time / than.estimate.time.step_time - 1


def _noted(plan: Plan, note: str) -> Plan:
    return replace(plan, inputs=replace(plan.inputs, assumed=(*plan.inputs.assumed, note)))
