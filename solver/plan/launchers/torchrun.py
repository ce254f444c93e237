"""torchrun: a launch line and a training script that applies the plan with plain PyTorch (FSDP2, DTensor TP,
DDP, per-layer checkpointing, torch.distributed.pipelining stages: `torchrun_pipeline`, torchtune's chunked loss and
activation offloading: `torchrun_savers`). The script is the template modules of `SCRIPT_PARTS` filled with the plan;
it runs as emitted; replace `batches()` (or `pipeline_batches()`) with your data."""

from __future__ import annotations

import json

from solver.plan.launchers.common import LEARNING_RATE, MAX_GRAD_NORM, about, launch_environment
from solver.plan.launchers.hf import LIGER_KERNEL_CONFIG
from solver.plan.launchers.nodes import nodes_note, slurm_script, torchrun_argv
from solver.plan.launchers.shell import launch_script, option
from solver.plan.launchers.templating import python_file
from solver.plan.launchers.torchrun_pipeline import pipeline_spec
from solver.plan.launchers.torchrun_savers import SAVER_VALUES
from solver.plan.record import Plan

# The emitted train_fitplan.py: these template parts (solver/plan/launchers/templates/), joined in this order into one
# module, as torchrun runs it.
SCRIPT_PARTS = ("train_fitplan.py", "training_data.py", "memory_savers.py", "pipeline_stages.py", "train_main.py")


def script(plan: Plan) -> str:
    """train_fitplan.py for `plan`: the template parts filled with the plan, its model and the values the plan was
    priced with. repr() of a str is always a valid Python literal of that str, so user text never becomes code."""
    spec = {"decisions": plan.to_json()["decisions"], "seq_len": plan.inputs.seq_len, "pipeline": pipeline_spec(plan)}
    values = {"PLAN": repr(json.dumps(spec)), "MODEL": repr(plan.inputs.model), "SUMMARY": plan.decisions.summary(),
              "LR": repr(LEARNING_RATE), "MAX_GRAD_NORM": repr(MAX_GRAD_NORM), "LIGER": repr(LIGER_KERNEL_CONFIG),
              **SAVER_VALUES}
    return python_file(SCRIPT_PARTS, values, name="train_fitplan.py")


def emit(plan: Plan) -> dict[str, str]:
    """train_fitplan.py, torchrun_launch.sh (torchrun on each node) and, beyond one node, slurm_launch.sh."""
    script_text = script(plan)  # first: a pipeline plan without a split is refused before anything else
    program = ["train_fitplan.py", *option("--model", plan.inputs.model)]
    launch = launch_script([*torchrun_argv(plan), *program], about=about(plan),
                           environment=launch_environment(plan), forward=True, notes=nodes_note(plan))
    files = {"train_fitplan.py": script_text, "torchrun_launch.sh": launch}
    if plan.inputs.cluster.nodes > 1:
        files["slurm_launch.sh"] = slurm_script(plan, program, about=about(plan))
    return files
