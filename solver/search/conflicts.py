"""Pins that contradict each other, found before any model is lowered, and named with the rule they break.

What needs the model or the cluster (TP degrees, data-parallel ranks, NVMe) is left to the search space, whose
refusal is the general "no configuration is possible".
"""

from __future__ import annotations

from itertools import product
from typing import Any

from costmodels import Config, Offload
from costmodels.engines import RULES
from graphs import FitplanError
from solver.search.pins import Pins

# Unpinned knobs are completed most permissive first, with the stages each engine has, so the rule reported is
# one the pins themselves break.
_ENGINES = tuple(sorted(RULES, key=lambda engine: -len(RULES[engine].stages)))  # DeepSpeed, FSDP2, DDP
_STAGES = {engine: tuple(reversed(rules.stages)) for engine, rules in RULES.items()}
_OFFLOADS = (Offload.NONE, Offload.CPU, Offload.NVME)


def check_pins(pins: Pins, *, global_batch: int | None) -> None:
    """Raise FitplanError when no engine, ZeRO stage and offload completes the pins, or when pinned micro-batch
    and accumulation cannot multiply into the global batch (global batch = micro-batch x accumulation x dp)."""
    _check_engine(pins)
    if global_batch is not None:
        _check_batch(pins.value("micro_batch"), pins.value("grad_accum"), global_batch)


def _check_engine(pins: Pins) -> None:
    first_error = None
    def choices(name: str, every: tuple[Any, ...]) -> tuple[Any, ...]:
        return pins.allowed(name) or every  # a pinned value is tried even where it breaks a rule, to name it

    combinations = ((engine, zero, opt, param) for engine in choices("engine", _ENGINES)
                    for zero, opt, param in product(choices("zero", _STAGES[engine]),
                                                    choices("optimizer_offload", _OFFLOADS),
                                                    choices("param_offload", _OFFLOADS)))
    for engine, zero, opt, param in combinations:
        try:
            Config(engine=engine, zero=zero, optimizer_offload=opt, param_offload=param)
            return
        except ValueError as error:
            first_error = first_error or error
    involved = ("engine", "zero", "optimizer_offload", "param_offload")
    given = Pins(tuple((n, v) for n, v in pins.fixed if n in involved)).flags()
    raise FitplanError(f"The pins {given} contradict each other: {first_error}.",
                       "Change or drop one of them (`solve --help` lists what each engine supports).")


def _check_batch(micro_batch: int | None, grad_accum: int | None, global_batch: int) -> None:
    per_rank = (micro_batch or 1) * (grad_accum or 1)
    if global_batch % per_rank:
        pinned = " x ".join(f"--{name} {value}" for name, value in (("micro-batch", micro_batch),
                                                                     ("grad-accum", grad_accum)) if value)
        shown = f"{pinned} = {per_rank}" if micro_batch and grad_accum else pinned
        raise FitplanError(f"{shown} does not divide --global-batch {global_batch}: the global batch is "
                           "micro-batch x grad-accum x data-parallel ranks.",
                           "Pin values whose product divides the global batch, or drop the pin.")
