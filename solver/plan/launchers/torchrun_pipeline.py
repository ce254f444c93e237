"""The pipeline part of the generated torchrun script: torch.distributed.pipelining stages cut from the HF model,
the plan's schedule class, and the per-rank report of what a steady-state step holds (issue 13).

Its code is the template part templates/pipeline_stages.py of train_fitplan.py (which imports nothing from fitplan);
`pipeline_spec` is what the script reads of the plan: the torch schedule class, each global stage's rank and decoder
layers, as priced."""

from __future__ import annotations

from typing import Any

from costmodels.pipeline_schedule import SPLIT_BACKWARD, TORCH_CLASS, stage_ranks
from graphs import FitplanError
from graphs.architectures import pipeline_classes
from solver.plan.record import Plan

# Causal LMs whose transformers 5.x decoder runs `model.embed_tokens -> model.layers -> model.norm` and whose head
# applies `lm_head` with nothing in between, so a stage takes the previous stage's hidden states as `inputs_embeds`
# and passes its own on through identity norm and head: the architecture table's `pipeline_stages` records
# (graphs/data/architectures.json, which also says why Gemma, Granite, GPT-2, Mixtral and Qwen 3 MoE are not).
PIPELINE_ARCHITECTURES = pipeline_classes()


def pipeline_spec(plan: Plan) -> dict[str, Any] | None:
    """The schedule class, stage placement and split of a pipeline plan (None without a pipeline)."""
    d = plan.decisions
    if d.pp == 1:
        return None
    split = d.pp_split or (plan.estimate.pipeline.stage_layers if plan.estimate.pipeline else ())
    if not split:
        raise FitplanError("The plan records no pipeline split, which the torchrun script's stages need.",
                           "Re-plan with this fitplan (its plans record the split), or pin one with --pp-split.")
    return {"schedule": TORCH_CLASS[d.pp_schedule], "split": list(split),
            "stage_ranks": list(stage_ranks(d.pp_schedule, d.pp, d.pp_virtual)),
            "split_backward": d.pp_schedule in SPLIT_BACKWARD,
            "architectures": list(PIPELINE_ARCHITECTURES)}
