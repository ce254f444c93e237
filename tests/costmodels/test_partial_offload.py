"""Partial optimizer offload (Megatron's --optimizer-cpu-offload --optimizer-offload-fraction) against megatron-core's
own hybrid device optimizer: its split of a rank's parameter shards between the host and the GPU, run on stand-in
parameters (it reads only their sizes and devices; its copies need CUDA).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from costmodels import Config, Engine, Offload, Optimizer, Precision, Workload, estimate, parse_cluster
from costmodels.partial_offload import HOST_BYTES_PER_ELEMENT
from costmodels.states import model_states
from graphs import Checkpoint, lower

MODEL = "meta-llama/Llama-3.2-1B"


class Shard:
    """What the hybrid optimizer's split reads of a parameter: its elements, device and dtype; `.cpu()` and
    `.float()` return the copies it makes."""

    def __init__(self, elements: int, *, cuda: bool = True, dtype: torch.dtype = torch.bfloat16) -> None:
        self.elements, self.is_cuda, self.dtype = elements, cuda, dtype

    def numel(self) -> int:
        return self.elements

    def detach(self) -> Shard:
        return self

    def clone(self) -> Shard:
        return Shard(self.elements, cuda=self.is_cuda, dtype=self.dtype)

    def cpu(self) -> Shard:
        return Shard(self.elements, cuda=False, dtype=self.dtype)

    def pin_memory(self) -> Shard:
        return self

    def float(self) -> Shard:
        return Shard(self.elements, cuda=self.is_cuda, dtype=torch.float32)


def rank_shards(sizes: list[int], dp: int) -> list[int]:
    """Rank 0's pieces of the parameters under the distributed optimizer: each rank owns 1/dp of the gradient buffer,
    contiguous, which holds the parameters in reverse order (megatron-core param_and_grad_buffer.py adds
    `params[::-1]`). Here the graph's tensors reversed, grouped by kind: the bound checked holds for any order."""
    owned, pieces = math.ceil(sum(sizes) / dp), []
    for size in reversed(sizes):
        take = min(size, owned - sum(pieces))
        if take <= 0:
            break
        pieces.append(take)
    return pieces


def megatron_split(pieces: list[int], fraction: float) -> tuple[int, int]:
    """(host, GPU) fp32 elements of megatron-core's HybridDeviceOptimizer for these parameter pieces."""
    hybrid = pytest.importorskip("megatron.core.optimizer.cpu_offloading.hybrid_optimizer")
    stand_in = SimpleNamespace(param_groups=[{"params": [Shard(n) for n in pieces]}], param_update_in_fp32=True)
    cpu_groups, gpu_groups, *_ = hybrid.HybridDeviceOptimizer._get_sub_optimizer_param_groups(stand_in, fraction)
    host = sum(p.numel() for g in cpu_groups for p in g["params"])
    gpu = sum(p.numel() for g in gpu_groups for p in g["params"] if p.dtype == torch.float32)
    return host, gpu


BASE = {"engine": Engine.MEGATRON, "zero": 1, "dp": 4, "micro_batch": 1, "grad_accum": 8,
        "precision": Precision.BF16_MIXED, "optimizer": Optimizer.ADAMW, "checkpoint": (Checkpoint.FULL,) * 16,
        "optimizer_offload": Offload.CPU}


def megatron_config(fraction: float, **changes) -> Config:
    return Config(**{**BASE, "optimizer_offload_fraction": fraction, **changes})


@pytest.fixture(scope="module")
def graph():
    return lower(MODEL, dtype="bfloat16")


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 1.0])
def test_states_split_as_megatrons_hybrid_optimizer_splits_them(graph, fraction):
    sizes = [t.numel for t, n in graph.tensor_groups(trainable=True) for _ in range(n)]
    pieces = rank_shards(sizes, dp=4)
    host, gpu = megatron_split(pieces, fraction)
    assert host + gpu == sum(pieces)
    states = model_states(graph, megatron_config(fraction))
    # fp32 main parameters (4 bytes) and two fp32 moments (8) per element the GPU steps; the host also keeps a pinned
    # fp32 gradient copy. fitplan prices the fraction exactly, Megatron moves whole pieces until it reaches it: the
    # GPU holds at most what fitplan prices, and less by under one piece.
    priced_gpu, priced_host = states.master // 4, states.cpu // HOST_BYTES_PER_ELEMENT
    assert states.optimizer == pytest.approx(2 * states.master, abs=16)
    assert priced_host + priced_gpu == sum(pieces)
    assert 0 <= priced_gpu - gpu < max(pieces)
    assert 0 <= host - priced_host < max(pieces)


def test_gradient_buffer_stays_on_the_gpu(graph):
    """Megatron's hybrid optimizer reads the gradients from the DDP buffer (`decoupled_grad`): offloading the
    optimizer moves none of them, unlike ZeRO-Offload."""
    offloaded, kept = (model_states(graph, megatron_config(1.0, optimizer_offload=where))
                       for where in (Offload.CPU, Offload.NONE))
    assert offloaded.grads == kept.grads > 0
    assert offloaded.master == offloaded.optimizer == 0 and kept.master > 0


def test_a_smaller_share_costs_less_step_and_more_gpu(graph):
    """On a card with a slow host (L4 nodes), each quarter moved to the host frees GPU memory and costs step time
    once the host step outlasts the GPU's share."""
    cluster, workload = parse_cluster("4xL4"), Workload(seq_len=2048, global_batch=32)
    priced = [estimate(graph, cluster, workload, megatron_config(f)) for f in (0.25, 0.5, 0.75, 1.0)]
    peaks = [p.memory.allocated_peak for p in priced]
    steps = [p.time.offload + p.time.optimizer for p in priced]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    assert steps[-1] > steps[0]


@pytest.mark.parametrize(("changes", "says"), [
    ({"optimizer_offload": Offload.NONE}, "applies to an offloaded optimizer"),
    ({"engine": Engine.DEEPSPEED, "zero": 3}, "offloads all of the optimizer's states"),
    ({"optimizer": Optimizer.ADAMW_BF16}, "fp32 states"),
])
def test_refused_where_no_runtime_steps_a_share(changes, says):
    with pytest.raises(ValueError, match=says):
        megatron_config(0.5, **changes)
