"""Launcher emitters: one module per target, each a pure `emit(plan)` returning file name -> text."""

from __future__ import annotations

from collections.abc import Callable

from graphs import FitplanError
from solver.plan.launchers import accelerate, axolotl, deepspeed, hf, megatron, torchrun, torchtitan, trl
from solver.plan.launchers.support import unsupported
from solver.plan.record import Plan


def _deepspeed(plan: Plan) -> dict[str, str]:
    return deepspeed.emit(plan, hidden=plan.inputs.hidden_size)


def _hf(plan: Plan) -> dict[str, str]:
    files = {**hf.emit(plan), **trl.emit(plan)}  # TRL's SFTConfig extends the Trainer's arguments
    if plan.decisions.engine.value == "deepspeed":
        files.update(_deepspeed(plan))  # TrainingArguments(deepspeed="ds_config.json") reads it
    return files


def _accelerate(plan: Plan) -> dict[str, str]:
    files = accelerate.emit(plan)
    if accelerate.checkpointing_entry(plan):
        # accelerate's config has no checkpointing key outside FSDP: the training script applies the plan's layers.
        files["fitplan_checkpointing.py"] = hf.checkpoint_snippet(plan)
    if plan.decisions.engine.value == "deepspeed":
        files.update(_deepspeed(plan))
    return files


# The emitter of each launcher in the registry (`capability.REGISTRY`, same names and order).
EMITTERS: dict[str, Callable[[Plan], dict[str, str]]] = {
    "torchrun": torchrun.emit, "accelerate": _accelerate, "hf": _hf, "deepspeed": _deepspeed,
    "axolotl": axolotl.emit, "torchtitan": torchtitan.emit, "megatron": megatron.emit,
}


def emit(plan: Plan, launcher: str) -> dict[str, str]:
    """The files `launcher` needs to run `plan`, or an error naming what it cannot express."""
    if launcher not in EMITTERS:
        raise FitplanError(f"Unknown launcher {launcher!r}", f"Choose from: {', '.join(EMITTERS)}.")
    problems = unsupported(launcher, plan.decisions, plan.inputs)
    if plan.post_training is not None and launcher not in trl.POST_TRAINING_RUNNERS:
        problems = [f"{plan.post_training.task} runs in TRL's trainer, which the {launcher} files do not start "
                    f"(launchers for it: {', '.join(trl.POST_TRAINING_RUNNERS)})", *problems]
    if problems:
        raise FitplanError(f"The {launcher} launcher cannot run this plan as decided: {'; '.join(problems)}.",
                           f"Launchers that can: {', '.join(plan.launchers) or 'none'}; or re-plan with "
                           f"--launcher {launcher} to restrict the search to what it expresses.")
    return EMITTERS[launcher](plan)
