"""A plan for the Megatron launcher is priced on megatron-core's own GPT layers (graphs.megatron, local spec) for
Llama-style models, and on the HF modeling code with a stated note otherwise."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("megatron.core")

from costmodels import Workload, parse_cluster
from costmodels import estimate as estimate_config
from graphs import resolve
from graphs.lower import lower_resolved
from graphs.megatron import MEGATRON_ATTENTION, lower_megatron_resolved
from solver import solve
from solver.api import MEGATRON_PRICED, config_from
from solver.api import estimate as api_estimate

MODEL, GPUS = "meta-llama/Llama-3.2-1B", "8xH100"
SEQ, BATCH = 2048, 64
KNOBS = ("tp", "dp", "engine", "zero", "micro_batch", "grad_accum", "precision", "optimizer", "optimizer_offload",
         "param_offload", "compile", "sequence_parallel")


@pytest.fixture(scope="module")
def plan():
    return solve(MODEL, GPUS, seq_len=SEQ, global_batch=BATCH, time_limit=10, launcher="megatron")


def _knobs(plan) -> dict:
    return {k: getattr(plan.decisions, k) for k in KNOBS}


def test_megatron_plan_estimate_equals_a_fresh_estimate_over_megatron_cores_layers(plan):
    assert MEGATRON_PRICED == MEGATRON_ATTENTION
    assert plan.decisions.attention == MEGATRON_ATTENTION and plan.launchers == ("megatron",)
    config = config_from({**_knobs(plan), "checkpoint": tuple(plan.decisions.checkpoint)}, layers=16)
    cluster, workload = parse_cluster(GPUS), Workload(seq_len=SEQ, global_batch=BATCH)
    resolved = resolve(MODEL)
    fresh = estimate_config(lower_megatron_resolved(resolved, dtype="bfloat16"), cluster, workload, config)
    assert fresh.memory == plan.estimate.memory
    assert fresh.time.step_time == pytest.approx(plan.estimate.time.step_time, rel=1e-12)
    # The HF lowering prices the same decisions differently (flash/SDPA attention there, materialised scores here).
    hf = estimate_config(lower_resolved(resolved, dtype="bfloat16"), cluster, workload, config)
    assert hf.memory.allocated_peak != fresh.memory.allocated_peak


def test_estimate_of_a_megatron_plans_decisions_gives_the_plans_own_estimate(plan):
    config = {**{k: str(v) if hasattr(v, "value") else v for k, v in _knobs(plan).items()},
              "checkpoint": [str(m) for m in plan.decisions.checkpoint]}
    again = api_estimate(MODEL, GPUS, config, seq_len=SEQ, global_batch=BATCH, attention=MEGATRON_PRICED)
    assert dataclasses.asdict(again.memory) == dataclasses.asdict(plan.estimate.memory)


def test_megatron_plan_for_a_model_megatron_core_is_not_lowered_for_says_it_is_priced_on_hf_code():
    plan = solve("gpt2", "1xA100", seq_len=512, global_batch=8, time_limit=5, launcher="megatron")
    assert plan.decisions.attention != MEGATRON_ATTENTION
    assert any("HF modeling code" in line and "megatron" in line for line in plan.inputs.assumed)
