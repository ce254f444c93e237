"""Which launchers can run a plan's decisions for its model (DESIGN.md: every plan records who can run it); the
knob rules live in the launcher registry, `solver.plan.capability`, which the search space reads too; a launcher that
builds only models it knows (torchtitan's flavours) also says which models it cannot run."""

from __future__ import annotations

from solver.plan.capability import LAUNCHERS
from solver.plan.capability import runnable_by as _runnable_by
from solver.plan.capability import unsupported as _unsupported
from solver.plan.launchers import megatron, torchtitan
from solver.plan.launchers.parallelism import parallelism_problems, pipeline_problems
from solver.plan.record import Decisions, Inputs

# `graphs.titan.TITAN_ATTENTION` (not imported: graphs.titan imports torch): the attention of a plan priced on
# torchtitan's own model code, which only the torchtitan launcher runs.
TITAN_PRICED = "flex"
# `graphs.megatron.TE_ATTENTION`: the attention of a plan priced on megatron-core's layers with Transformer Engine's
# kernels (Megatron's engine), which only the Megatron launcher runs.
MEGATRON_PRICED = "te-flash"
# The launchers whose files a training script of the user's own reads (the Trainer's arguments, the adapter and
# quantization configs): that script may call PEFT's k-bit preparation itself (`LoraDecision.kbit_preparation`).
USER_SCRIPT_LAUNCHERS = ("hf", "accelerate")


def model_problems(launcher: str, inputs: Inputs, attention: str) -> list[str]:
    """What `launcher` cannot run of the plan's model (empty for launchers that load any transformers model)."""
    if launcher == "torchtitan":
        return torchtitan.model_problems(inputs, attention)
    if launcher == "megatron" and attention != TITAN_PRICED:
        return megatron.model_problems(inputs)
    if attention == TITAN_PRICED:
        return ["a plan priced on torchtitan's model code (made with --launcher torchtitan), whose memory and time "
                "the HF modeling code does not have"]
    if attention == MEGATRON_PRICED and launcher != "megatron":
        return ["a plan priced on megatron-core's layers with Transformer Engine's kernels (Megatron's engine), whose "
                "memory and time the HF modeling code does not have"]
    return []


def model_launchers(inputs: Inputs, attention: str) -> tuple[str, ...]:
    """The launchers that can run this model at all."""
    return tuple(name for name in LAUNCHERS if not model_problems(name, inputs, attention))


def pipeline_launchers(inputs: Inputs, launchers: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `launchers` that can cut this model into pipeline stages (the search's pipeline configurations
    are the ones one of them runs)."""
    return tuple(name for name in launchers if not pipeline_problems(name, inputs))


def unsupported(launcher: str, d: Decisions, inputs: Inputs | None = None) -> list[str]:
    """What `launcher` cannot express of the decisions (and, given `inputs`, of the model); empty: it runs them."""
    problems = _unsupported(launcher, d, checkpoint=d.checkpoint, lora=d.lora is not None)
    if inputs is None:
        return problems
    return problems + model_problems(launcher, inputs, d.attention) + parallelism_problems(launcher, d, inputs)


def runnable_by(d: Decisions, inputs: Inputs | None = None) -> tuple[str, ...]:
    """The launchers that run the decisions (for the model of `inputs`), fewest caveats first."""
    allowed = LAUNCHERS if inputs is None else model_launchers(inputs, d.attention)
    runners = _runnable_by(d, checkpoint=d.checkpoint, lora=d.lora is not None, launchers=allowed)
    if d.lora is not None and d.lora.kbit_preparation:
        runners = tuple(n for n in runners if n in USER_SCRIPT_LAUNCHERS)
    return runners if inputs is None else tuple(n for n in runners if not parallelism_problems(n, d, inputs))
