"""FSDP2 shards MoE expert stacks over every data-parallel rank: the rule the model prices is the rule the
emitted script runs, and more ranks always mean fewer parameter bytes per GPU."""

from __future__ import annotations

import ast
import functools

import pytest

from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, parse_cluster
from costmodels.zero import fsdp_shard_dim
from graphs import Checkpoint, lower
from solver import solve
from solver.plan.launchers import emit

GIB = 2**30


@functools.cache
def emitted_shard_dim():
    """`shard_dim` as train_fitplan.py defines it, compiled from the emitted source."""
    plan = solve("meta-llama/Llama-3.2-1B", "2xA100", seq_len=512, global_batch=2, engine="fsdp2")
    source = emit(plan, "torchrun")["train_fitplan.py"]
    tree = ast.parse(source)
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "shard_dim")
    namespace: dict = {}
    exec(compile(ast.Module(body=[function], type_ignores=[]), "train_fitplan.py", "exec"), namespace)
    return namespace["shard_dim"]


@pytest.mark.parametrize("shape", [(8, 32768, 6144), (8, 6144, 16384), (128, 64), (4096,), (3, 5, 5), (64, 4096),
                                   (2, 7)])
@pytest.mark.parametrize("ranks", [1, 2, 8, 32, 256])
def test_emitted_placement_is_the_priced_rule(shape, ranks):
    assert emitted_shard_dim()(shape, ranks) == fsdp_shard_dim(shape, ranks)


def test_mixtral_fsdp2_parameters_shrink_with_more_ranks():
    # Mixtral-8x22B stacks its 8 experts in one tensor per layer: sharding dim 0 over 32 or 64 ranks left an eighth
    # of the experts (63 GiB) on every GPU whatever the data-parallel degree.
    graph = lower("mistralai/Mixtral-8x22B-v0.1", dtype="bfloat16")
    per_gpu = {}
    for gpus in ("4x8xH100", "8x8xH100"):
        cluster = parse_cluster(gpus)
        config = Config(engine=Engine.FSDP2, zero=3, dp=cluster.world_size, micro_batch=2,
                        checkpoint=(Checkpoint.FULL,) * graph.dims.layers, precision=Precision.BF16_MIXED,
                        optimizer=Optimizer.ADAMW)
        result = estimate(graph, cluster, Workload(seq_len=2048, global_batch=2 * cluster.world_size), config)
        per_gpu[gpus] = result.memory.parameters
    assert per_gpu["4x8xH100"] < 20 * GIB  # 141B parameters in fp32 over 32 ranks: about 16.4 GiB
    assert per_gpu["8x8xH100"] == pytest.approx(per_gpu["4x8xH100"] / 2, rel=0.02)
