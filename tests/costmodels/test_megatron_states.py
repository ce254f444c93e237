"""Megatron plans' model states against Megatron-LM's own accounting.

Megatron-LM's `compute_weight_and_optimizer_memory` (megatron/training/theoretical_memory_usage.py at the tag of
the installed megatron-core) prices the most loaded model shard at 18 bytes per parameter, or 6 + 12/dp with the
distributed optimizer, on the arguments Megatron parses from the emitted flags. fitplan's first pipeline rank (the
embedding and its stage's layers) holds those bytes in parameters, gradients and optimizer states. The
precision-aware optimizer (adamw-bf16) is checked against the dtypes Megatron's parser sets from the emitted flags
and megatron-core's OptimizerConfig default (`store_param_remainders`).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from costmodels import Engine, Offload, Optimizer, Precision, Workload, estimate, parse_cluster
from graphs import Checkpoint, lower
from solver import solve
from solver.plan.record import Plan
from tests.solver.test_parallel_launchers import megatron_checked, plan_for

# Plans as users get them: torch.compile searched, as without FITPLAN_AUTO_COMPILE (tests/conftest.py).
pytestmark = pytest.mark.compile_search

MODEL = "meta-llama/Llama-3.1-8B"  # untied head; vocab 128256 pads to itself for tp <= 2 (128 x tp)
LAYERS = 32
VOCAB = 128256


@pytest.fixture(scope="module")
def small() -> Plan:
    return solve("meta-llama/Llama-3.2-1B", "8xH100", seq_len=2048, global_batch=64, time_limit=5)


def states_of(plan: Plan) -> int:
    """Parameters, gradients and optimizer states fitplan prices on the plan's first (most loaded) rank."""
    d = plan.decisions
    graph = lower(MODEL, dtype="bfloat16")
    priced = estimate(graph, parse_cluster("8xH100"), Workload(seq_len=plan.inputs.seq_len,
                                                           global_batch=plan.inputs.global_batch), d)
    memory = priced.pipeline.ranks[0].memory if priced.pipeline is not None else priced.memory
    return memory.parameters + memory.gradients + memory.optimizer_states


def weights_and_optimizer(args: Any) -> float:
    """Megatron-LM's own estimate, with the padded vocabulary its tokenizer builder sets (`_vocab_size_with_padding`:
    a multiple of --make-vocab-size-divisible-by x tp)."""
    tokenizer = importlib.import_module("megatron.training.tokenizer.tokenizer")
    args.padded_vocab_size = tokenizer._vocab_size_with_padding(VOCAB, args, logging_enabled=False)
    theoretical = importlib.import_module("megatron.training.theoretical_memory_usage")
    return theoretical.compute_weight_and_optimizer_memory(args)


def megatron_plan(small: Plan, **decisions: Any) -> Plan:
    layout = {"tp": 2, "pp": 1, "dp": 4, "micro_batch": 1, "grad_accum": 8, "engine": Engine.MEGATRON,
              "precision": Precision.BF16_MIXED, "optimizer": Optimizer.ADAMW,
              "checkpoint": (Checkpoint.FULL,) * LAYERS, **decisions}
    return plan_for(small, MODEL, 1, seq_len=4096, **layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"zero": 0}, {"zero": 1}, {"zero": 1, "pp": 2, "dp": 2, "pp_split": (16, 16)},
                                    {"zero": 0, "pp": 4, "dp": 1, "pp_split": (8,) * 4}])
def test_states_equal_megatrons_own_estimate(small, tmp_path, monkeypatch, layout):
    plan = megatron_plan(small, **layout)
    args, _ = megatron_checked(plan, tmp_path, monkeypatch)
    expected = weights_and_optimizer(args)
    # Megatron's estimate spreads the final norm over the stages and rounds nothing; a few KiB apart.
    assert states_of(plan) == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow
def test_precision_aware_optimizer_states_follow_megatrons_dtypes(small, tmp_path, monkeypatch):
    from megatron.core.optimizer import OptimizerConfig

    plan = megatron_plan(small, zero=1, optimizer=Optimizer.ADAMW_BF16)
    args, _ = megatron_checked(plan, tmp_path, monkeypatch)
    assert args.use_precision_aware_optimizer and args.use_distributed_optimizer
    # the 16 low bits of each fp32 master weight, beside the bf16 weight (TE >= 2.1)
    master = 2 if OptimizerConfig.__dataclass_fields__["store_param_remainders"].default else 4
    per_param_sharded = master + args.exp_avg_dtype.itemsize + args.exp_avg_sq_dtype.itemsize
    per_param_whole = args.params_dtype.itemsize + args.main_grads_dtype.itemsize
    fp32 = megatron_plan(small, zero=1)
    params = weights_and_optimizer(megatron_checked(fp32, tmp_path / "fp32", monkeypatch)[0]) / (6 + 12 / 4)
    assert states_of(plan) == pytest.approx(params * (per_param_whole + per_param_sharded / args.data_parallel_size),
                                            rel=1e-4)
    assert states_of(plan) < states_of(fp32) * 0.7


@pytest.mark.slow
def test_hybrid_optimizer_offload_reads_back_and_keeps_its_share_of_the_states(small, tmp_path, monkeypatch):
    """--optimizer-cpu-offload passes Megatron-LM's validate_args only with the precision-aware optimizer's flag;
    the parsed fraction is the plan's, and the GPU keeps 1 - fraction of the sharded 12 bytes per parameter of
    Megatron's own estimate (`costmodels.partial_offload`), the 6 unsharded bytes whole."""
    plan = megatron_plan(small, zero=1, optimizer_offload=Offload.CPU, optimizer_offload_fraction=0.25)
    args, _ = megatron_checked(plan, tmp_path, monkeypatch)
    assert args.optimizer_cpu_offload and args.use_precision_aware_optimizer and args.overlap_cpu_optimizer_d2h_h2d
    assert args.optimizer_offload_fraction == 0.25
    dp = args.data_parallel_size
    params = weights_and_optimizer(args) / (6 + 12 / dp)
    assert states_of(plan) == pytest.approx(params * (6 + 12 * (1 - 0.25) / dp), rel=1e-4)
