"""What a model's own layout rules out of a plan's expert and pipeline parallelism under each launcher (the
launcher registry, `capability.py`, says what each launcher runs at all)."""

from __future__ import annotations

from solver.plan.launchers.torchrun_pipeline import PIPELINE_ARCHITECTURES
from solver.plan.record import Decisions, Inputs


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
