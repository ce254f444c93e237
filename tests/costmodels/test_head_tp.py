"""The LM head on one tensor-parallel rank: its matmuls span vocab / tp columns (megatron-core's
`ColumnParallelLinear` output layer, the HF plan's colwise lm_head), against torch's FLOP counter on that shard; and the
pipeline split balanced on what each rank really runs, against brute force."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from costmodels import Config, Engine, Workload, parse_cluster
from costmodels.activations import evaluate
from costmodels.compute import device_seconds, launch_seconds
from costmodels.pipeline_stages import stage_layers
from costmodels.tensor_parallel import rank_layer
from costmodels.timing import speed_for, time_terms
from graphs import Role
from graphs.megatron import lower_megatron

S = 2048


@functools.cache
def megatron_graph():
    return lower_megatron("meta-llama/Llama-3.2-1B", dtype="bfloat16", kernels="te")


def shard_flops(vocab: int, hidden: int, tokens: int, tp: int) -> int:
    """Forward + backward FLOPs of one rank's head as torch counts them: logits = x W_shard^T with W_shard the
    rank's (vocab / tp, hidden) rows (megatron-core core_v0.16.1 tensor_parallel/layers.py ColumnParallelLinear:
    `self.output_size_per_partition = divide(output_size, world_size)`), then dX and dW."""
    x = torch.randn(tokens, hidden, device="meta", requires_grad=True)
    weight = torch.randn(vocab // tp, hidden, device="meta", requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.linear(x, weight).sum().backward()
    return counter.get_total_flops()


def head_of(graph):
    return next(layer for layer in graph.nodes() if layer.role is Role.HEAD)


@pytest.mark.parametrize("tp", [2, 8])
def test_a_tp_ranks_head_flops_match_the_flop_counter_on_its_vocab_shard(tp):
    graph = megatron_graph()
    dims, cost = graph.dims, rank_layer(graph, head_of(graph), tp).cost()
    counted = sum(evaluate(w.flops, b=1, s=S, tp=tp, sequence_parallel=False) for w in (cost.forward, cost.backward))
    # The graph's vocabulary divides by 2 and 8 (128256 = 8 x 16032), so the shard is exact.
    assert counted == shard_flops(dims.vocab, dims.hidden, S, tp)


def test_a_tp_ranks_step_charges_its_share_of_the_head_and_of_megatrons_loss():
    """tp=8 against tp=1: the step's nodes outside the decoder layers differ by the head, now its shard's FLOPs at
    the head's rate, and by Megatron's vocab-parallel cross-entropy, now an eighth of its bytes."""
    graph, cluster = megatron_graph(), parse_cluster("8xH100")
    workload = Workload(seq_len=S, global_batch=8)
    outside, heads = {}, {}
    for tp in (1, 8):
        config = Config(engine=Engine.MEGATRON, tp=tp, dp=8 // tp, micro_batch=1, grad_accum=tp)
        outside[tp] = time_terms(graph, cluster, workload, config).fixed.compute / config.grad_accum
        heads[tp] = shard_flops(graph.dims.vocab, graph.dims.hidden, S, tp) / speed_for(
            graph, cluster, config, b=1, s=S, head=True).matmul_flops
    speeds = {tp: speed_for(graph, cluster, Config(engine=Engine.MEGATRON, tp=tp, dp=8 // tp, micro_batch=1),
                            b=1, s=S) for tp in (1, 8)}
    loss = next(layer for layer in graph.nodes() if layer.role is Role.LOSS).cost()
    # The loss's memory-bound bytes split eight ways; a phase still waits on the host issuing its kernels.
    losses = {tp: sum(max(device_seconds(w, speeds[tp], b=1, s=S, tp=1) / tp, launch_seconds(w, speeds[tp]))
                      for w in (loss.forward, loss.backward)) for tp in (1, 8)}
    # Tolerance: float sums in a different order.
    assert outside[1] - outside[8] == pytest.approx(heads[1] - heads[8] + losses[1] - losses[8], rel=1e-9)


def test_the_pipeline_split_at_tp8_balances_each_ranks_flops_like_brute_force():
    """Megatron-expressible splits (free first and last stages, equal middle ones) of Llama-3.2-1B's 16 layers over
    4 stages at tp=8: fitplan's split has the least costliest stage, counting per rank each layer's FLOPs and the
    head's vocab shard."""
    graph, tp, stages = megatron_graph(), 8, 4
    config = Config(engine=Engine.MEGATRON, tp=tp, pp=stages, dp=1, micro_batch=1, grad_accum=8)
    layer = graph.decoder_layers()[0].cost()
    per_layer = sum(evaluate(w.flops, b=1, s=S, tp=tp, sequence_parallel=False) for w in (layer.forward,
                                                                                         layer.backward))
    head = shard_flops(graph.dims.vocab, graph.dims.hidden, S, tp)
    n = len(graph.decoder_layers())

    def costliest(split: tuple[int, ...]) -> int:
        return max(k * per_layer + (head if i == len(split) - 1 else 0) for i, k in enumerate(split))

    splits = [(a, *(m,) * (stages - 2), n - a - m * (stages - 2))
              for a, m in itertools.product(range(1, n), repeat=2) if n - a - m * (stages - 2) >= 1]
    chosen = stage_layers(graph, Workload(seq_len=S, global_batch=8), config)
    assert costliest(chosen) == min(costliest(split) for split in splits)
