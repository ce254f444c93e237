"""TRL's `SFTConfig` keyword arguments (trl 1.16 names): the plan's `TrainingArguments` (SFTConfig extends them)
plus the sequence length and packing the plan's rows were priced with, for `SFTTrainer`."""

from __future__ import annotations

import json
from typing import Any

from solver.plan.launchers.hf import training_arguments
from solver.plan.record import Plan


def sft_config(plan: Plan) -> dict[str, Any]:
    """`SFTConfig(**kwargs)`. Rows are priced full at seq_len tokens unless the plan came from dataset lengths
    without packing (then each micro-batch is padded to its longest sequence, with no rounding up); TRL's "bfd"
    packing also runs padding-free (sequences flattened into one row, which needs a FlashAttention
    `attn_implementation`)."""
    packing = plan.inputs.packing
    packed = packing != "none"
    kwargs: dict[str, Any] = {**training_arguments(plan), "max_length": plan.inputs.seq_len, "packing": packed}
    if packed:
        kwargs["packing_strategy"] = "wrapped" if packing == "wrapped" else "bfd"
    else:
        kwargs["pad_to_multiple_of"] = None  # trl's "auto" would round each micro-batch up to 128 tokens
    return kwargs


def emit(plan: Plan) -> dict[str, str]:
    """TRL's config files beside the Trainer's: `trl.SFTConfig(**json.load(open("sft_config.json")))`."""
    return {"sft_config.json": json.dumps(sft_config(plan), indent=2) + "\n"}
