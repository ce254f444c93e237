"""Tensor-parallel collectives of Megatron's Transformer Engine layers: forward ones exposed, backward ones behind
the column-parallel modules' GEMMs as TE launches them (async, waited after the weight-gradient GEMM), and the
vocab-parallel loss's per-token all-reduces instead of a gather of the logits."""

from __future__ import annotations

import functools

import pytest

from costmodels import Config, Engine, Workload, parse_cluster
from costmodels.collectives import all_gather_seconds, all_reduce_seconds, reduce_scatter_seconds, tp_group
from costmodels.timing import speed_for, time_terms
from graphs import Checkpoint, Role
from graphs.megatron import lower_megatron


@functools.cache
def megatron_graph():
    return lower_megatron("meta-llama/Llama-3.2-1B", dtype="bfloat16", kernels="te")


def layer_tp(config: Config, s: int) -> tuple[float, float, float, list[float]]:
    """(a decoder layer's TP seconds, all-reduce, all-gather of its boundary, seconds of its column GEMMs)."""
    graph, cluster = megatron_graph(), parse_cluster("8xH100")
    terms = time_terms(graph, cluster, Workload(seq_len=s, global_batch=config.dp * config.grad_accum), config)
    tp = dict(terms.layers[0])[Checkpoint.NONE].tp
    group, boundary = tp_group(cluster, config.tp), s * graph.dims.hidden * 2
    rate = speed_for(graph, cluster, config, b=1, s=s).matmul_flops
    # megatron-core's fused column-parallel weights: linear_qkv (q + 2 kv heads) and linear_fc1 (gate and up).
    dims, tp_degree = graph.dims, config.tp
    qkv = (dims.heads + 2 * dims.kv_heads) * dims.head_dim // tp_degree * dims.hidden
    fc1 = 2 * dims.intermediate // tp_degree * dims.hidden
    gemms = [2 * s * weights / rate for weights in (qkv, fc1)]
    return tp, all_reduce_seconds(cluster, group, boundary), all_gather_seconds(cluster, group, boundary), gemms


@pytest.mark.parametrize("s", [512, 8192])
def test_backward_allreduces_hide_behind_the_weight_gradient_gemms(s):
    """Without sequence parallelism: two exposed forward all-reduces (after linear_proj and linear_fc2), and of each
    column module's input-gradient all-reduce only what outlasts its weight-gradient GEMM."""
    config = Config(engine=Engine.MEGATRON, tp=8, dp=1, micro_batch=1)
    tp, reduce, _, gemms = layer_tp(config, s)
    assert tp == pytest.approx(2 * reduce + sum(max(0.0, reduce - g) for g in gemms), rel=1e-9)
    assert tp < 4 * reduce  # the fc1 GEMM covers its all-reduce (a runtime without the overlap pays 4)


def test_with_sequence_parallelism_only_the_row_parallel_gradient_gathers_show_in_backward():
    config = Config(engine=Engine.MEGATRON, tp=8, dp=1, micro_batch=1, sequence_parallel=True)
    s = 8192
    tp, reduce, gather, gemms = layer_tp(config, s)
    graph, cluster = megatron_graph(), parse_cluster("8xH100")
    scatter = reduce_scatter_seconds(cluster, tp_group(cluster, 8), s * graph.dims.hidden * 2)
    # the re-gather behind the input-gradient GEMM, the reduce-scatter behind the weight-gradient one
    hidden = sum(max(0.0, scatter - g) + max(0.0, gather - g) for g in gemms)
    assert tp == pytest.approx(2 * reduce + 2 * gather + hidden, rel=1e-9)
    assert hidden < 2 * (scatter + gather)


def test_megatrons_loss_all_reduces_three_values_per_token_and_gathers_no_logits():
    graph, cluster = megatron_graph(), parse_cluster("8xH100")
    s, config = 4096, Config(engine=Engine.MEGATRON, tp=8, dp=1, micro_batch=1)
    terms = time_terms(graph, cluster, Workload(seq_len=s, global_batch=1), config)
    assert terms.fixed.communication == pytest.approx(
        all_reduce_seconds(cluster, tp_group(cluster, 8), s * graph.dims.hidden * 2)  # the embedding's all-reduce
        + 3 * all_reduce_seconds(cluster, tp_group(cluster, 8), s * 4), rel=1e-9)
    assert any(layer.role is Role.LOSS for layer in graph.nodes())
