"""What every emitter needs from a plan: training hyperparameters fitplan does not decide, and the layer class."""

from __future__ import annotations

from graphs import Checkpoint
from solver.plan.record import Plan

# fitplan decides how to run, not what to learn: these are common fine-tuning defaults, written explicitly
# so that every launcher gets the same values (HF Trainer refuses a DeepSpeed config that disagrees).
LEARNING_RATE = 2e-5
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.0
MAX_GRAD_NORM = 1.0


def checkpointed_layers(plan: Plan) -> list[int]:
    return [i for i, mode in enumerate(plan.decisions.checkpoint) if mode is not Checkpoint.NONE]


def all_checkpointed(plan: Plan) -> bool:
    return all(mode is not Checkpoint.NONE for mode in plan.decisions.checkpoint)


def precision_flags(plan: Plan) -> dict[str, bool]:
    """bf16/fp16/tf32 as HF spells them (fp8 has no TrainingArguments flag: `capability` refuses it there)."""
    p = plan.decisions.precision.value
    return {"bf16": p in ("bf16-mixed", "bf16"), "fp16": p == "fp16-mixed", "tf32": p == "tf32"}


class CannotExpress(Exception):
    """A launcher cannot run the plan as decided; the message lists what it cannot express."""


def about(plan: Plan) -> str:
    """Which plan an emitted file belongs to, in words (user text: emitters write it only as a comment)."""
    return f"fitplan plan for {plan.inputs.model} on {plan.inputs.cluster.spec}: {plan.decisions.summary()}"


def layer_class(plan: Plan) -> str:
    """The decoder-layer class name (what FSDP wraps), e.g. LlamaDecoderLayer."""
    return plan.inputs.layer_class or "DecoderLayer"


def launch_environment(plan: Plan) -> dict[str, str]:
    """Environment variables the plan's memory model assumes: expandable segments for the caching allocator
    (`costmodels.overhead.reserved_bytes`), unless the plan turned them off."""
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if plan.decisions.expandable_segments else {}
