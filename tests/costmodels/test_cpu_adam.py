"""The host optimizer step of each engine at its implementation's measured speed (benchmarks/cpu_adam.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodels import Config, Engine, Offload, Optimizer, Precision, parse_cluster
from costmodels.offload import _cpu_step_seconds, cpu_adam_slowdowns, torch_cpu_optimizer

DATA = Path(__file__).resolve().parents[2] / "costmodels" / "data" / "cpu_adam.json"
PARAMS = 7_000_000_000


def step(engine: Engine, optimizer: Optimizer) -> float:
    zero = 3 if engine is not Engine.DDP else 0
    params = Offload.CPU if engine is Engine.FSDP2 else Offload.NONE  # CPUOffloadPolicy moves both
    config = Config(engine=engine, zero=zero, dp=8, optimizer_offload=Offload.CPU, param_offload=params,
                    precision=Precision.BF16_MIXED, optimizer=optimizer)
    return _cpu_step_seconds(parse_cluster("8xH100"), config, PARAMS)


def test_the_data_file_records_how_it_was_measured():
    record = json.loads(DATA.read_text())
    assert {"_source", "measured", "machine", "params_per_second"} <= set(record)
    rates = record["params_per_second"]
    assert record["slowdown_vs_deepspeed"] == pytest.approx(
        {name: rates["deepspeed_cpu_adam"] / value for name, value in rates.items()})


def test_fsdp2_with_fused_adamw_is_priced_at_torch_fused_speed():
    # Before: every FSDP2 host step was charged 6x DeepSpeed's CPUAdam, fused or not.
    deepspeed = step(Engine.DEEPSPEED, Optimizer.ADAMW)
    fused = step(Engine.FSDP2, Optimizer.ADAMW_FUSED)
    assert fused == pytest.approx(deepspeed * cpu_adam_slowdowns()["torch_fused"])
    assert fused < 3 * deepspeed


def test_fsdp2_default_adamw_on_cpu_runs_the_single_tensor_loop():
    assert torch_cpu_optimizer(Optimizer.ADAMW) == "torch_single"
    assert step(Engine.FSDP2, Optimizer.ADAMW) == pytest.approx(
        step(Engine.DEEPSPEED, Optimizer.ADAMW) * cpu_adam_slowdowns()["torch_single"])
    assert step(Engine.FSDP2, Optimizer.ADAMW) > step(Engine.FSDP2, Optimizer.ADAMW_FUSED)


def test_torch_default_is_not_foreach_on_cpu():
    # The premise of torch_cpu_optimizer: for CPU parameters torch's AdamW default picks neither foreach nor fused.
    import torch
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = [torch.zeros(4)]
    assert _default_to_fused_or_foreach(params, differentiable=False, use_fused=False) == (False, False)
