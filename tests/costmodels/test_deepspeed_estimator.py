"""DeepSpeed ZeRO-2/3 model-state bytes against DeepSpeed's own estimators, for Llama-3.2-1B in bf16 mixed
precision with AdamW on one and two nodes of 8 GPUs.

The estimators (`estimate_zero2_model_states_mem_needs` in deepspeed/runtime/zero/stage_1_and_2.py,
`estimate_zero3_model_states_mem_needs` in stage3.py) count 2 bytes/param of 16-bit weights and 18 bytes/param
of 16-bit and fp32 gradients, fp32 master weights and Adam moments. fitplan shards each tensor with ceil
division, so it may hold up to 18 bytes more than P/N per tensor: the comparisons allow tensors × 18 bytes
above DeepSpeed's numbers (which round down) and nothing below.
"""

from __future__ import annotations

import math

import pytest

from costmodels import Config, Engine, Offload, Optimizer, Precision, parse_cluster
from costmodels.engines.deepspeed import OFFLOAD_HOST_BUFFER_FACTOR
from costmodels.memory import engine_buffers, offload_bytes
from costmodels.states import model_states
from costmodels.zero import persistence_threshold
from graphs import Role, lower

stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2",
                                    reason="deepspeed is not installed (pip install -e '.[dev]')")
stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3",
                             reason="deepspeed is not installed (pip install -e '.[dev]')")

MODEL = "meta-llama/Llama-3.2-1B"
# (world size, GPUs per node, nodes): one and two nodes of 8.
WORLDS = [(8, 8, 1), (16, 8, 2)]
# The buffer factor the estimators default to, and the one fitplan applies to host memory per node.
BUFFER_FACTOR = 1.5


@pytest.fixture(scope="module")
def graph():
    return lower(MODEL, dtype="bfloat16")


def config(zero: int, dp: int, optimizer_offload: Offload = Offload.NONE,
           param_offload: Offload = Offload.NONE) -> Config:
    return Config(engine=Engine.DEEPSPEED, zero=zero, dp=dp, precision=Precision.BF16_MIXED,
                  optimizer=Optimizer.ADAMW, optimizer_offload=optimizer_offload, param_offload=param_offload)


def ceil_slack(graph) -> int:
    """Most bytes per rank that per-tensor ceil division can add over DeepSpeed's P/N (18 B/param states)."""
    return 18 * len(graph.params())


def largest_layer_params(graph) -> int:
    return max(layer.param_count for layer in graph.decoder_layers())


def persistent_extra(graph, dp: int, *, whole: bool = False) -> int:
    """bf16 bytes a rank holds beyond its shard (or in all, `whole`) for parameters ZeRO-3 keeps whole
    (`stage3_param_persistence_threshold`: norm weights here); the estimators do not model persistence."""
    small = [t for t in graph.params() if t.numel <= persistence_threshold(graph.dims.hidden)]
    return 2 * sum(t.numel - (0 if whole else math.ceil(t.numel / dp)) for t in small)


def assert_within_ceil_slack(fitplan: int, deepspeed: int, graph) -> None:
    assert 0 <= fitplan - deepspeed <= ceil_slack(graph), (fitplan, deepspeed, fitplan - deepspeed)


@pytest.mark.parametrize(("world", "per_node", "nodes"), WORLDS)
@pytest.mark.parametrize("offload", [Offload.NONE, Offload.CPU])
def test_zero2_gpu_states_match_deepspeed_estimator(graph, world, per_node, nodes, offload):
    """No offload: 2P + 18P/N. Optimizer offload: 2P (the 16-bit weights; gradients stream to the host)."""
    _, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(
        graph.param_count, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload is Offload.CPU,
        additional_buffer_factor=BUFFER_FACTOR)
    states = model_states(graph, config(2, world, optimizer_offload=offload))
    assert_within_ceil_slack(states.gpu_total, gpu, graph)


# DeepSpeed's ZeRO-2 host estimate is P * max(4 * total_gpus, 16) * 1.5 per node. The 4 * total_gpus term is
# the fp32 model every process loads before the engine starts, which fitplan does not model (it plans the
# training step), so the 16 bytes/param of offloaded states (fp32 master 4, Adam moments 8, fp32 gradients 4)
# only show on fewer than 4 GPUs. The estimator does not divide by the node count, so use one node of 2.
# One micro-batch per step (the helper `config` uses grad_accum=1): the fp32 gradient partition goes to the host,
# no 16-bit accumulation buffer (DeepSpeed stage_1_and_2.py allocates one only with accumulation).
def test_zero2_offloaded_host_bytes_per_node_match_deepspeed_estimator(graph):
    cpu, _ = stage_1_and_2.estimate_zero2_model_states_mem_needs(
        graph.param_count, num_gpus_per_node=2, num_nodes=1, cpu_offload=True,
        additional_buffer_factor=BUFFER_FACTOR)
    states = model_states(graph, config(2, 2, optimizer_offload=Offload.CPU))
    host, _ = offload_bytes(parse_cluster("2xH100"), config(2, 2, optimizer_offload=Offload.CPU), states)
    slack = math.ceil(ceil_slack(graph) * 2 * OFFLOAD_HOST_BUFFER_FACTOR)
    assert 0 <= host - cpu <= slack, (host, cpu, host - cpu)


@pytest.mark.parametrize(("world", "per_node", "nodes"), WORLDS)
@pytest.mark.parametrize(("optimizer_offload", "param_offload"),
                         [(Offload.NONE, Offload.NONE), (Offload.CPU, Offload.NONE), (Offload.CPU, Offload.CPU)])
def test_zero3_gpu_states_match_deepspeed_estimator_without_the_gathered_layer(graph, world, per_node, nodes,
                                                                               optimizer_offload, param_offload):
    """No offload: 18P/N; optimizer offload: 2P/N (the weight shard); full offload: nothing."""
    largest = largest_layer_params(graph)
    _, gpu, largest_memory = stage3.estimate_zero3_model_states_mem_needs(
        graph.param_count, largest, num_gpus_per_node=per_node, num_nodes=nodes,
        cpu_offload=optimizer_offload is Offload.CPU, cpu_offload_params=param_offload is Offload.CPU,
        zero_init=True, additional_buffer_factor=BUFFER_FACTOR)
    states = model_states(graph, config(3, world, optimizer_offload, param_offload))
    # DeepSpeed's gpu figure adds 4 * largest_layer_params for the gathered layer; fitplan keeps that out of the
    # model states and prices it per node as a transient (`engine_buffers`, compared below).
    deepspeed = gpu - largest_memory
    # fitplan keeps parameters up to the persistence threshold whole on every rank, on the GPU even under
    # parameter offload (DeepSpeed's runtime: `ds_persist`); the estimator does not model them. With parameter
    # offload the estimator puts no shard on the GPU, so they add in full.
    deepspeed += persistent_extra(graph, world, whole=param_offload is Offload.CPU)
    assert_within_ceil_slack(states.gpu_total, deepspeed, graph)


@pytest.mark.parametrize(("world", "per_node", "nodes"), WORLDS)
def test_zero3_offloaded_host_bytes_per_node_match_deepspeed_estimator(graph, world, per_node, nodes):
    """Optimizer offload: 16 bytes/param (fp32 master, moments, fp32 gradients) over the nodes, times 1.5."""
    cpu, _, _ = stage3.estimate_zero3_model_states_mem_needs(
        graph.param_count, largest_layer_params(graph), num_gpus_per_node=per_node, num_nodes=nodes,
        cpu_offload=True, cpu_offload_params=False, zero_init=True, additional_buffer_factor=BUFFER_FACTOR)
    cfg = config(3, world, optimizer_offload=Offload.CPU)
    host, _ = offload_bytes(parse_cluster(f"{nodes}x{per_node}xH100"), cfg, model_states(graph, cfg))
    slack = math.ceil(ceil_slack(graph) * per_node * OFFLOAD_HOST_BUFFER_FACTOR)
    assert 0 <= host - cpu <= slack, (host, cpu, host - cpu)


@pytest.mark.parametrize(("world", "per_node", "nodes"), WORLDS)
def test_zero3_full_offload_states_per_rank_match_deepspeed_estimator(graph, world, per_node, nodes):
    """Full offload: 18 bytes/param over the nodes, times 1.5, on the host; counted per rank wherever it lives."""
    cpu, gpu, largest_memory = stage3.estimate_zero3_model_states_mem_needs(
        graph.param_count, largest_layer_params(graph), num_gpus_per_node=per_node, num_nodes=nodes,
        cpu_offload=True, cpu_offload_params=True, zero_init=True, additional_buffer_factor=BUFFER_FACTOR)
    states = model_states(graph, config(3, world, Offload.CPU, Offload.CPU))
    # Per rank, without the estimator's buffer factor; the persistent parameters are whole on every rank
    # wherever fitplan places them (the estimator does not model them).
    deepspeed = math.floor(cpu / (BUFFER_FACTOR * per_node)) + gpu - largest_memory + persistent_extra(graph, world)
    assert_within_ceil_slack(states.gpu_total + states.cpu, deepspeed, graph)


@pytest.mark.parametrize(("world", "nodes"), [(8, 1), (16, 2)])
def test_zero3_gathered_last_decoder_layer_is_half_of_deepspeed_largest_layer_memory(graph, world, nodes):
    """DeepSpeed's working set is 4 bytes per element of the largest layer (2 + 2: its gathered 16-bit weights
    and their 16-bit gradients); fitplan's forward transient holds the gathered weights only, and prices the
    gradients as ZeRO's reduce buckets in backward (2 x reduce_bucket_size, not per layer)."""
    largest = largest_layer_params(graph)
    *_, largest_memory = stage3.estimate_zero3_model_states_mem_needs(
        graph.param_count, largest, num_gpus_per_node=8, num_nodes=nodes, cpu_offload=False,
        cpu_offload_params=False, zero_init=True, additional_buffer_factor=BUFFER_FACTOR)
    nodes_in_order = graph.nodes()
    last = max(i for i, layer in enumerate(nodes_in_order) if layer.role is Role.DECODER)
    # The node after the last decoder layer is the final norm, whose weight persists, so nothing is prefetched.
    forward_transient = engine_buffers(graph, config(3, world))[last][0]
    layer = nodes_in_order[last]
    assert layer.param_count == largest
    persistent = sum(t.numel for t in layer.params if t.numel < persistence_threshold(graph.dims.hidden))
    assert forward_transient == largest_memory // 2 - 2 * persistent
