"""Golden digests of the emitted Python files (train_fitplan.py, fitplan_torchtitan.py, fitplan_checkpointing.py)
for plans that cover the training script's branches: FSDP2, DDP, TP, LoRA, QLoRA, pipelines, chunked loss,
activation offload, compile, fp8, Liger, and model names that hold shell and placeholder text.

The plans are frozen in tests/solver/data/template_golden.json (a few solved bases, each case one decision change
on one of them), so a change elsewhere in the solver never moves a digest; the digests were written by the emitters
as they were before the scripts became template modules (solver/plan/launchers/templates/). When an emitted file is
meant to change, rewrite them and say why in the commit: `python -m tests.solver.template_golden`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from costmodels import Engine, Offload, Optimizer, Precision
from costmodels.config import Loss
from costmodels.pipeline_schedule import Schedule
from graphs import Checkpoint
from solver.plan.launchers import hf, torchrun, torchtitan
from solver.plan.launchers.common import all_checkpointed, checkpointed_layers
from solver.plan.record import Plan

DATA = Path(__file__).with_name("data") / "template_golden.json"
LAYERS = 16  # Llama-3.2-1B, the `llama` and `llama-lora` bases
NONE, FULL = (Checkpoint.NONE,) * LAYERS, (Checkpoint.FULL,) * LAYERS
HALF = FULL[:LAYERS // 2] + NONE[LAYERS // 2:]
DDP = {"engine": Engine.DDP, "zero": 0}
TP2 = {"tp": 2, "dp": 4, "grad_accum": 8}
PIPE = {**DDP, "pp": 2, "dp": 4, "grad_accum": 8, "pp_schedule": Schedule.ONE_F_ONE_B, "pp_split": (8, 8)}
# A model name is user text: shell metacharacters, a newline, quotes, and the emitters' own placeholder spellings.
HOSTILE = "x;touch PWNED $(touch P2) `p3` 'single' \"double\" \\ #\n$HOME __PLAN__ __SUMMARY__ {JOB_FILE} __LR__"

# name -> (base plan, decision changes, model name or None to keep the base's).
CASES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "fsdp2-zero3": ("llama", {}, None),
    "fsdp2-zero2": ("llama", {"zero": 2}, None),
    "fsdp2-param-offload": ("llama", {"optimizer_offload": Offload.CPU, "param_offload": Offload.CPU}, None),
    "fsdp2-fp16": ("llama", {"precision": Precision.FP16_MIXED}, None),
    "fsdp2-pure-bf16": ("llama", {"precision": Precision.BF16}, None),
    "fsdp2-tp2": ("llama", TP2, None),
    "fsdp2-compile": ("llama", {"compile": True}, None),
    "fsdp2-fp8": ("llama", {"precision": Precision.FP8}, None),
    "fsdp2-checkpoint-full": ("llama", {"checkpoint": FULL}, None),
    "fsdp2-checkpoint-half": ("llama", {"checkpoint": HALF}, None),
    "fsdp2-checkpoint-selective": ("llama", {"checkpoint": (Checkpoint.SELECTIVE,) * LAYERS}, None),
    "fsdp2-checkpoint-op-selective": ("llama", {"checkpoint": (Checkpoint.OP_SELECTIVE,) * LAYERS}, None),
    "fsdp2-optimizer-in-backward": ("llama", {"optimizer_in_backward": True, "micro_batch": 8, "grad_accum": 1}, None),
    "fsdp2-activation-offload": ("llama", {"activation_offload": True, "checkpoint": FULL}, None),
    "fsdp2-loss-chunked": ("llama", {"loss": Loss.CHUNKED}, None),
    "fsdp2-loss-liger": ("llama", {"loss": Loss.FUSED_LINEAR}, None),
    "fsdp2-adamw-fused": ("llama", {"optimizer": Optimizer.ADAMW_FUSED}, None),
    "fsdp2-hostile-model": ("llama", {}, HOSTILE),
    "ddp": ("llama", DDP, None),
    "ddp-fp16": ("llama", {**DDP, "precision": Precision.FP16_MIXED}, None),
    "ddp-tf32": ("llama", {**DDP, "precision": Precision.TF32}, None),
    "ddp-tp2-sequence-parallel": ("llama", {**DDP, **TP2, "sequence_parallel": True}, None),
    "ddp-checkpoint-half": ("llama", {**DDP, "checkpoint": HALF}, None),
    "ddp-loss-chunked-activation-offload": ("llama", {**DDP, "loss": Loss.CHUNKED, "activation_offload": True,
                                                    "checkpoint": FULL}, None),
    "ddp-sgd": ("llama", {**DDP, "optimizer": Optimizer.SGD}, None),
    "ddp-adafactor": ("llama", {**DDP, "optimizer": Optimizer.ADAFACTOR}, None),
    "ddp-adamw-8bit": ("llama", {**DDP, "optimizer": Optimizer.ADAMW_8BIT}, None),
    "ddp-paged-adamw-32bit": ("llama", {**DDP, "optimizer": Optimizer.PAGED_ADAMW_32BIT}, None),
    "pp2-1f1b": ("llama", PIPE, None),
    "pp2-uneven-block-recompute": ("llama", {**PIPE, "pp_split": (7, 9), "checkpoint": HALF}, None),
    "pp2-gpipe-compile": ("llama", {**PIPE, "pp_schedule": Schedule.GPIPE, "compile": True}, None),
    "pp2-fsdp2-zero2": ("llama", {**PIPE, "engine": Engine.FSDP2, "zero": 2}, None),
    "pp4-interleaved": ("llama", {**PIPE, "pp": 4, "dp": 2, "pp_schedule": Schedule.INTERLEAVED_1F1B,
                                  "pp_virtual": 2, "pp_split": (2,) * 8}, None),
    "pp2-interleaved-zero-bubble": ("llama", {**PIPE, "pp_schedule": Schedule.INTERLEAVED_ZB, "pp_virtual": 2,
                                              "pp_split": (4,) * 4}, None),
    "pp2-zbv": ("llama", {**PIPE, "pp_schedule": Schedule.ZBV, "pp_virtual": 2, "pp_split": (4,) * 4}, None),
    "pp2-hostile-model": ("llama", PIPE, HOSTILE),
    "lora-fsdp2": ("llama-lora", {}, None),
    "lora-ddp": ("llama-lora", DDP, None),
    "lora-tp2": ("llama-lora", {**DDP, **TP2}, None),
    "lora-checkpoint-half": ("llama-lora", {**DDP, "checkpoint": HALF}, None),
    "qlora": ("qlora", {}, None),
    "gpt2-fsdp2": ("gpt2", {}, None),
    "multinode-fsdp2": ("multinode", {}, None),
}
# The cases whose plan torchtitan runs (its config module is the same text for every plan).
TORCHTITAN_CASES = ("fsdp2-zero3", "fsdp2-hostile-model", "multinode-fsdp2")


@cache
def stored() -> dict[str, Any]:
    return json.loads(DATA.read_text())


def plan(name: str) -> Plan:
    """The case's plan: its base, read back from the stored JSON, with the case's decisions and model name."""
    base, changes, model = CASES[name]
    result = Plan.from_json(stored()["plans"][base])
    result = dataclasses.replace(result, decisions=dataclasses.replace(result.decisions, **changes))
    if model is not None:
        result = dataclasses.replace(result, inputs=dataclasses.replace(result.inputs, model=model))
    return result


def python_files(name: str) -> dict[str, str]:
    """The Python files fitplan emits for the case's plan, by the emitters that write them."""
    case = plan(name)
    files = {"train_fitplan.py": torchrun.emit(case)["train_fitplan.py"]}
    if name in TORCHTITAN_CASES:
        files["fitplan_torchtitan.py"] = torchtitan.emit(case)["fitplan_torchtitan.py"]
    if checkpointed_layers(case) and not all_checkpointed(case):
        files["fitplan_checkpointing.py"] = hf.checkpoint_snippet(case)
    return files


def digests(name: str) -> dict[str, str]:
    return {file: hashlib.sha256(text.encode()).hexdigest() for file, text in python_files(name).items()}


def write() -> None:
    """Rewrite the stored digests from the emitters as they are now (the stored plans stay)."""
    data = {"plans": stored()["plans"], "digests": {name: digests(name) for name in CASES}}
    DATA.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write()
