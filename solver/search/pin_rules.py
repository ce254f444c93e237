"""The pins a search starts from: the caller's pins, opened where the caller lets the search choose (memory savers),
narrowed where this machine cannot price a value (Liger without liger-kernel), and completed where one pin implies
another (activation offload needs full recompute). Each change is said in the plan's assumptions."""

from __future__ import annotations

import os
from typing import Any

from costmodels.choices import RUNTIME_ONLY_LOSSES
from costmodels.config import Config, Loss
from costmodels.estimator import model_refusals
from graphs import Checkpoint, FitplanError, LayerGraph, LoraSpec
from graphs.liger import liger_version
from solver.plan import capability
from solver.search.pins import KNOBS, Pins

# What `allow_savers` opens where the user pinned nothing: the savers that keep the training (same math, other
# kernels or memory placement), chosen by the search jointly with every other knob. Optimizer-in-backward is the same
# AdamW update for a step of one micro-batch per rank (`Config.in_backward_refusals`: no accumulation), without
# gradient clipping (torchtune's optimizer_in_bwd refuses clipping; the plan says so where it is chosen).
SAVER_CHOICES: dict[str, tuple[Any, ...]] = {"optimizer_in_backward": (False, True),
                                             "loss": tuple(loss for loss in Loss if loss not in RUNTIME_ONLY_LOSSES),
                                             "activation_offload": (False, True)}
# An environment setting for quick, repeated searches (the test suite sets it): "off" leaves torch.compile out of an
# unpinned search, which then lowers no compiled variant (each costs a second trace through AOTAutograd, about as
# long as the eager one). Unset or "search", an unpinned --compile is the search's choice.
AUTO_COMPILE_SETTING = "FITPLAN_AUTO_COMPILE"
# The knobs that save memory without changing the training (besides the optimizer): pinned, they can leave no
# configuration for a reason of their own (the model, or no launcher), which is said instead of a pin search.
SAVERS = ("optimizer_in_backward", "loss", "activation_offload")


def pins_of(pins: Pins | None, knobs: dict[str, Any]) -> Pins:
    """The pins, given either as a `Pins` or as knob keywords."""
    if pins is not None and knobs:
        raise FitplanError("Give pins either as `pins=` or as knob keywords, not both.", "Use one of the two.")
    if pins is not None:
        return pins
    try:
        return Pins.of(**knobs)
    except ValueError as err:
        raise FitplanError(f"Invalid pin: {err}", "Check the value against `solve --help`.") from err


def prepared(pins: Pins, *, allow_savers: bool, lora: LoraSpec | None) -> tuple[Pins, list[str]]:
    """The pins the search runs with, and the notes that say how they differ from the caller's."""
    notes: list[str] = []
    if allow_savers:
        pins, notes = with_savers(pins, notes)
    pins, notes = titan_losses(pins, notes)
    pins, notes = auto_compile(pins, notes)
    pins, notes = installed_losses(pins, notes)
    if lora is not None and (lora.quantization or lora.use_dora or lora.use_rslora or lora.modules_to_save) and \
            pins.launcher not in (None, *capability.PEFT_VARIANT_RUNNERS):
        raise FitplanError(f"The {pins.launcher} launcher cannot load QLoRA/DoRA/rsLoRA adapters or "
                           "modules_to_save.",
                           f"Launchers that can: {', '.join(capability.PEFT_VARIANT_RUNNERS)}.")
    if pins.value("activation_offload") and pins.value("checkpoint") is None:
        pins = pinned(pins, "checkpoint", Checkpoint.FULL)
        notes.append("full activation checkpointing on every layer (activation offload needs it)")
    elif pins.value("activation_offload") and pins.value("checkpoint") is not Checkpoint.FULL:
        raise FitplanError(f"--activation-offload on needs full checkpointing on every layer, not "
                           f"--checkpoint {pins.value('checkpoint')} (torchtune refuses it otherwise).",
                           "Use --checkpoint full (or leave it to the solver).")
    return pins, notes


def with_savers(pins: Pins, notes: list[str]) -> tuple[Pins, list[str]]:
    """`pins` with the unpinned `SAVER_CHOICES` knobs allowed all their values, and the note that says so."""
    opened = [name for name in SAVER_CHOICES if pins.allowed(name) is None]
    for name in opened:
        pins = pinned_set(pins, name, SAVER_CHOICES[name])
    if opened:
        notes = [*notes, "memory savers searched (--allow-savers): " + ", ".join(
            f"{KNOBS[name].option} {','.join(shown(v) for v in SAVER_CHOICES[name])}" for name in opened)
            + " (the guide line says what each chosen one runs on)"]
    return pins, notes


def titan_losses(pins: Pins, notes: list[str]) -> tuple[Pins, list[str]]:
    """Under the torchtitan launcher an unpinned loss is either loss torchtitan 0.3.0 runs: its ChunkedLossWrapper
    (its own llama3 jobs) or its plain cross-entropy (full logits; the only one priced with tp > 1), each traced on
    its own code; the search chooses, the emitted job runs the chosen one, and --loss pins one."""
    if pins.launcher != "torchtitan" or pins.allowed("loss") is not None:
        return pins, notes
    return pinned_set(pins, "loss", (Loss.CHUNKED, Loss.HF)), [
        *notes, "loss: torchtitan's ChunkedLossWrapper or its plain cross-entropy, as the search chooses "
        "(--loss chunked or --loss hf pins one)"]


def auto_compile(pins: Pins, notes: list[str]) -> tuple[Pins, list[str]]:
    """An unpinned --compile pinned off where the environment says so (`AUTO_COMPILE_SETTING`), and the note."""
    setting = os.environ.get(AUTO_COMPILE_SETTING, "search")
    if setting not in ("search", "off"):
        raise FitplanError(f"{AUTO_COMPILE_SETTING}={setting!r} is neither 'search' nor 'off'.",
                           f"Unset {AUTO_COMPILE_SETTING}, or set it to 'off' to leave torch.compile unsearched.")
    if setting == "search" or pins.allowed("compile") is not None:
        return pins, notes
    return pinned(pins, "compile", False), [*notes, f"torch.compile not searched ({AUTO_COMPILE_SETTING}=off; "
                                                    "unset it to search torch.compile, or pin --compile on)"]


def installed_losses(pins: Pins, notes: list[str]) -> tuple[Pins, list[str]]:
    """Liger's fused-linear loss is priced by tracing liger-kernel's own patch, so it needs the package here:
    without it, dropped from a list of allowed losses (said in the plan), an error when it is the only one."""
    allowed = pins.allowed("loss")
    if allowed is None or Loss.FUSED_LINEAR not in allowed or liger_version() is not None:
        return pins, notes
    install = ("pip install liger-kernel (fitplan traces its patch to price it; the run needs it too), or plan "
               "another --loss.")
    kept = tuple(loss for loss in allowed if loss is not Loss.FUSED_LINEAR)
    if not kept:
        raise FitplanError("--loss fused-linear needs liger-kernel, which is not installed here.", install)
    return pinned_set(pins, "loss", kept), [*notes, "--loss fused-linear left out: liger-kernel is not "
                                                    "installed here (" + install + ")"]


def shown(value: Any) -> str:
    """A knob value as its flag takes it."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def check_memory_savers(pins: Pins, graph: LayerGraph, launchers: tuple[str, ...]) -> None:
    """A FitplanError naming why the pinned memory savers cannot run on this model or any allowed launcher."""
    knobs = {name: pins.value(name) for name in SAVERS if pins.value(name) not in (None, False, KNOBS[name].default)}
    if not knobs:
        return
    config = Config(**knobs, checkpoint=(Checkpoint.FULL,) * len(graph.decoder_layers()))
    reasons = model_refusals(graph, config)
    if not reasons and not capability.runnable_by(config, launchers=launchers):
        reasons = sorted({p for name in launchers for p in capability.unsupported(name, config)
                          if any(word in p for word in ("optimizer-in-backward", "cross-entropy", "activation"))})
    if reasons:
        flags = " ".join(f"{KNOBS[n].option} {'on' if v is True else v}" for n, v in knobs.items())
        raise FitplanError(f"{flags} cannot run here: {'; '.join(reasons)}.",
                           "Leave these knobs to the solver, or estimate them with `fitplan estimate`.")


def pinned(pins: Pins, name: str, value: Any) -> Pins:
    """`pins` with knob `name` pinned to `value` as well."""
    return pinned_set(pins, name, (value,))


def pinned_set(pins: Pins, name: str, values: tuple[Any, ...]) -> Pins:
    """`pins` with knob `name` allowed exactly `values`."""
    fixed = {**pins.as_dict, name: values}
    return Pins(tuple((n, fixed[n]) for n in KNOBS if n in fixed), pins.launcher)
