"""Searches made of searches: the fastest of a launcher's whole-model checkpoint modes (launchers that apply one
policy to every layer), and LoRA or QLoRA when full fine-tuning cannot fit and the caller allows it."""

from __future__ import annotations

from dataclasses import replace

from graphs import Checkpoint, LoraSpec
from solver.plan import capability
from solver.plan.record import Plan
from solver.search import risk
from solver.search.diagnose import Infeasible
from solver.search.pin_rules import pinned
from solver.search.pins import Pins
from solver.search.request import Request
from solver.search.solve import solve_request


def plan(request: Request, pins: Pins, *, allow_lora: bool) -> Plan:
    """The fastest plan: full fine-tuning (or the caller's adapters), else, where allowed, the faster of LoRA and
    QLoRA; with the memory risk it takes stated (`risk`): a safer plan within a small time cost where its margin
    is below the estimate's error, and a faster one the headroom alone refuses."""
    try:
        found = searched(request, pins)
    except Infeasible as refused:
        if not allow_lora or request.lora is not None:
            raise risk.refusal_inside_headroom(request, pins, refused, searched) from None
        found = fastest_adapters(request, pins)
    if found.decisions.lora is not None and request.lora is None:  # the adapters fitplan chose, searched again
        request = replace(request, lora=found.decisions.lora.spec())
    return risk.inside_headroom(request, pins, risk.with_margin(request, pins, found, searched), searched)


def searched(request: Request, pins: Pins) -> Plan:
    """One search, or, for a launcher that applies one checkpoint mode to every layer (torchtitan, axolotl), the
    fastest of its whole-model modes."""
    return fastest_uniform(request, pins) if uniform_modes(pins) else solve_request(request, pins)


def fastest_adapters(request: Request, pins: Pins) -> Plan:
    """Full fine-tuning does not fit: the faster of LoRA (r=16 on all linear layers) and QLoRA (the same adapters
    on a 4-bit NF4 base with double quantisation, as the QLoRA paper trains), each searched on its own; QLoRA only
    when it is faster or 16-bit LoRA cannot fit (it changes the training more), and the plan says what the other
    one would have cost."""
    why = "full fine-tuning does not fit"
    lora = qlora = None
    failures: list[Infeasible] = []
    try:
        lora = searched(replace(request, lora=LoraSpec()).with_notes(f"{why}; LoRA r=16 on all linear layers"),
                        pins)
    except Infeasible as err:
        failures.append(err)
    try:
        qlora = searched(replace(request, lora=LoraSpec(quantization="nf4", double_quant=True)).with_notes(
            f"{why}; QLoRA r=16 on all linear layers over a 4-bit NF4 base (double quantisation)"), pins)
    except Infeasible as err:
        failures.append(err)
    if lora is None and qlora is None:  # QLoRA's diagnosis is the leanest; say that 16-bit LoRA was tried too
        last = failures[-1]
        raise Infeasible(f"Neither full fine-tuning nor 16-bit LoRA nor QLoRA fits. With QLoRA: {last.message}",
                         last.hint, last.diagnosis)
    if qlora is None or (lora is not None and lora.estimate.time.step_time <= qlora.estimate.time.step_time):
        other = "QLoRA does not fit either" if qlora is None else \
            f"QLoRA would take {qlora.estimate.time.step_time:.3g} s per step"
        chosen, note = lora, f"16-bit LoRA chosen: {other}"
    else:
        other = "16-bit LoRA does not fit" if lora is None else \
            f"16-bit LoRA would take {lora.estimate.time.step_time:.3g} s per step"
        chosen, note = qlora, f"QLoRA chosen as the faster: {other} (QLoRA quantizes the frozen base to 4 bits)"
    assert chosen is not None
    return replace(chosen, inputs=replace(chosen.inputs, assumed=(*chosen.inputs.assumed, note)))


def uniform_modes(pins: Pins) -> tuple[Checkpoint, ...]:
    """The checkpoint modes to compare when the pinned launcher applies one mode to every layer (torchtitan) and
    none is pinned: every mode it runs, least recompute first (ties go to it); empty otherwise."""
    entry = capability.REGISTRY.get(pins.launcher) if pins.launcher else None
    if entry is None or entry.per_layer or pins.value("checkpoint") is not None:
        return ()
    runs = {Checkpoint.NONE: True, Checkpoint.SELECTIVE: entry.selective != "none",
            Checkpoint.OP_SELECTIVE: entry.op_selective != "none", Checkpoint.FULL: True}
    return tuple(m for m in (Checkpoint.NONE, Checkpoint.SELECTIVE, Checkpoint.OP_SELECTIVE, Checkpoint.FULL)
                 if runs[m] and pins.allows("checkpoint", m))


def fastest_uniform(request: Request, pins: Pins) -> Plan:
    """The fastest plan over the launcher's whole-model checkpoint modes, each searched with that mode pinned
    (the time limit shared); Infeasible (the leanest mode's diagnosis) when none fits."""
    modes = uniform_modes(pins)
    note = (f"one checkpoint mode for every layer ({pins.launcher} applies one policy): the fastest that fits "
            f"of {', '.join(map(str, modes))}")
    each = replace(request, time_limit=request.time_limit / len(modes)).with_notes(note)
    best: Plan | None = None
    failure: Infeasible | None = None
    for mode in modes:
        try:
            found = solve_request(each, pinned(pins, "checkpoint", mode))
        except Infeasible as err:
            failure = err
            continue
        if best is None or found.estimate.time.step_time < best.estimate.time.step_time:
            best = found
    if best is None:
        raise failure or Infeasible("Nothing fits.", "Relax the pins.")
    return replace(best, inputs=replace(best.inputs, pins=pins.shown()))
