"""Which launchers can run a plan's decisions for its model (DESIGN.md: every plan records who can run it); the
knob rules live in the launcher registry, `solver.plan.capability`, which the search space reads too; a launcher that
builds only models it knows (torchtitan's flavours) also says which models it cannot run."""

from __future__ import annotations

from solver.plan.capability import LAUNCHERS
from solver.plan.capability import runnable_by as _runnable_by
from solver.plan.capability import unsupported as _unsupported
from solver.plan.launchers import torchtitan
from solver.plan.launchers.torchrun_pipeline import PIPELINE_ARCHITECTURES
from solver.plan.record import Decisions, Inputs

# `graphs.titan.TITAN_ATTENTION` (not imported: graphs.titan imports torch): the attention of a plan priced on
# torchtitan's own model code, which only the torchtitan launcher runs.
TITAN_PRICED = "flex"
# `graphs.megatron.TE_ATTENTION`: the attention of a plan priced on megatron-core's layers with Transformer Engine's
# kernels (Megatron's engine), which only the Megatron launcher runs.
MEGATRON_PRICED = "te-flash"


def model_problems(launcher: str, inputs: Inputs, attention: str) -> list[str]:
    """What `launcher` cannot run of the plan's model (empty for launchers that load any transformers model)."""
    if launcher == "torchtitan":
        return torchtitan.model_problems(inputs, attention)
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


def parallelism_problems(launcher: str, d: Decisions, inputs: Inputs) -> list[str]:
    """What of the decisions' expert and pipeline parallelism the model itself rules out under `launcher`."""
    experts = inputs.shape.experts if inputs.shape is not None else 0
    problems = []
    if d.ep > 1 and not experts:
        problems.append(f"expert parallelism (ep={d.ep}) for a model without experts")
    elif d.ep > 1 and experts % d.ep:
        problems.append(f"ep={d.ep}, which does not divide the model's {experts} experts")
    return problems + (pipeline_problems(launcher, inputs) if d.pp > 1 else [])


def pipeline_problems(launcher: str, inputs: Inputs) -> list[str]:
    """What keeps `launcher` from cutting the plan's model into pipeline stages (empty: the model's layout does not)."""
    if launcher == "torchrun" and inputs.architecture not in PIPELINE_ARCHITECTURES:
        return [f"pipeline parallelism of {inputs.architecture or 'this model'} (the script cuts stages from "
                f"{', '.join(PIPELINE_ARCHITECTURES)} only: their decoders run embedding, layers, norm and "
                "head with nothing in between; launchers that run it: megatron, torchtitan)"]
    if launcher == "torchtitan" and inputs.shape is not None and inputs.shape.tied_embeddings:
        return ["pipeline parallelism of a model with tied input and output embeddings (torchtitan 0.3.0 "
                "refuses it: models/common/decoder.py 'Weight tying is not supported with Pipeline "
                "Parallel'; launchers that run it: megatron)"]
    return []


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
    return runners if inputs is None else tuple(n for n in runners if not parallelism_problems(n, d, inputs))
