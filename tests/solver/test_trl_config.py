"""TRL's SFTConfig reads the emitted sft_config.json (the hf launcher's files) as the plan decided it: the
TrainingArguments it extends (batch, accumulation, optimizer, Liger, checkpointing) and the sequence length and
packing the plan's rows were priced with, for a QLoRA plan on a 24 GB card."""

from __future__ import annotations

import dataclasses
import json

import pytest

from costmodels import Optimizer
from costmodels.config import Loss
from graphs import LoraSpec
from solver.api import solve
from solver.plan.launchers import emit
from solver.plan.record import Plan

trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[dev]')")

MODEL, GPUS = "Qwen/Qwen2.5-0.5B", "1xRTX4090"
WORKLOAD = {"seq_len": 1024, "global_batch": 8}


@pytest.fixture(scope="module")
def plan() -> Plan:
    return solve(MODEL, GPUS, **WORKLOAD, lora=LoraSpec(rank=16, alpha=32, quantization="nf4"),
                 optimizers="paged-adamw-8bit", loss="fused-linear", time_limit=10)


def sft_config(plan: Plan, tmp_path) -> tuple[dict, object]:
    kwargs = json.loads(emit(plan, "hf")["sft_config.json"])
    # this host has no GPU for TrainingArguments' half-precision checks: the flags are compared as emitted
    return kwargs, trl.SFTConfig(**{**kwargs, "output_dir": str(tmp_path), "bf16": False, "fp16": False})


@pytest.mark.slow
@pytest.mark.parametrize("packing", [None, "wrapped", "bfd", "none"])
def test_sft_config_reads_the_plans_batch_optimizer_and_packing(plan, packing, tmp_path):
    variant = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, packing=packing))
    kwargs, config = sft_config(variant, tmp_path)
    d = plan.decisions
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (d.micro_batch, d.grad_accum)
    assert d.optimizer is Optimizer.PAGED_ADAMW_8BIT and config.optim.value == "paged_adamw_8bit"
    assert d.loss is Loss.FUSED_LINEAR and config.use_liger_kernel
    assert kwargs["bf16"] == (d.precision.value == "bf16-mixed")
    assert config.max_length == plan.inputs.seq_len
    # rows of seq_len tokens (packed) unless the plan was made from lengths padded per micro-batch
    assert config.packing == (packing != "none")
    if config.packing:
        assert config.packing_strategy == (packing if packing == "wrapped" else "bfd")
    else:
        assert config.pad_to_multiple_of is None
    # everything emitted is an SFTConfig field, read back unchanged
    fields = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    assert set(kwargs) <= fields
    assert all(getattr(config, k) == v or k in ("bf16", "fp16", "optim", "output_dir") or isinstance(v, dict)
               for k, v in kwargs.items())
