"""FSDP2's CPU offload traffic and host step from what torch's CPUOffloadPolicy does (issue 35 item 13): a real
one-rank gloo FSDP2 run on CPU shows where its sharded parameters, gradients and AdamW moments live and in which
dtype, and `costmodels.offload` must price exactly those bytes: the gradients come down after every micro-batch's
reduce-scatter (`foreach_reduce` copies each to the host and accumulates there; the parameters stay on the host and
go up only in the fetch before each use, not a second time after the step), each in the shard's own dtype, and the
host AdamW streams seven tensors of the moments' dtype per parameter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.recipes import recipe_estimate, recipes
from costmodels import Config, Engine, Offload, Optimizer, Precision, parse_cluster
from costmodels.offload import (
    CPU_ADAM_TENSORS_PER_PARAM,
    PCIE_EFFICIENCY,
    cpu_adam_slowdowns,
    host_memory_bandwidth,
    host_step_seconds,
    offload_seconds,
)
from costmodels.zero import local_elements
from tests.gloo import run_ranks

DTYPES = {Precision.BF16: "bfloat16", Precision.BF16_MIXED: "float32"}  # the module's dtype under each (FSDP2)


def worker(spec_path: str, rank: int) -> None:
    """One FSDP2 rank with CPUOffloadPolicy over a module in `dtype`: where each state lives and its itemsize."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=1)
    module = torch.nn.Linear(16, 16).to(getattr(torch, spec["dtype"]))
    fully_shard(module, offload_policy=CPUOffloadPolicy(pin_memory=False))
    weight = module.weight
    module(torch.randn(4, 16, dtype=weight.dtype)).sum().backward()
    optimizer = torch.optim.AdamW(module.parameters(), fused=True)
    optimizer.step()
    state = optimizer.state[weight]
    record = {"param_device": str(weight.to_local().device), "param_itemsize": weight.to_local().element_size(),
              "grad_device": str(weight.grad.to_local().device), "grad_itemsize": weight.grad.to_local().element_size(),
              "moment_itemsize": state["exp_avg"].element_size()}
    Path(spec["folder"], f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


@pytest.mark.parametrize("precision", list(DTYPES))
def test_fsdp2_offload_prices_the_bytes_cpuoffloadpolicy_moves(precision, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"store": str(tmp_path / "store"), "folder": str(tmp_path),
                                "dtype": DTYPES[precision]}))
    (seen,) = run_ranks("tests.costmodels.test_fsdp2_offload", [str(spec)], world=1, folder=tmp_path, timeout=240)
    assert seen["param_device"] == "cpu" and seen["grad_device"] == "cpu"  # both stay on the host
    cluster = parse_cluster("8xA100")
    config = Config(engine=Engine.FSDP2, zero=3, dp=8, optimizer_offload=Offload.CPU, param_offload=Offload.CPU,
                    precision=precision, optimizer=Optimizer.ADAMW_FUSED, grad_accum=2)
    shard = 10**9
    link = cluster.gpu.host_bandwidth * 0.88  # PCIE_EFFICIENCY
    down = shard * seen["grad_itemsize"] * config.grad_accum  # reduce-scattered gradients to the host, per micro-batch
    up = 2 * shard * seen["param_itemsize"] * config.grad_accum  # forward and backward fetch, per micro-batch
    host = 8 * shard * CPU_ADAM_TENSORS_PER_PARAM * seen["moment_itemsize"] / host_memory_bandwidth(cluster.gpu.id)
    expected = (down + up) / link + host * cpu_adam_slowdowns()["torch_fused"]
    assert offload_seconds(cluster, config, partition=shard, params=shard, grad_bytes=2) == pytest.approx(
        expected, rel=1e-12)


def test_deepspeed_offload_still_moves_16_bit_gradients_down_and_parameters_up():
    """DeepSpeed keeps 16-bit parameters on the GPU and fp32 masters in CPUAdam: both crossings, 28 bytes a step."""
    cluster = parse_cluster("8xA100")
    config = Config(engine=Engine.DEEPSPEED, zero=2, dp=8, optimizer_offload=Offload.CPU,
                    precision=Precision.BF16_MIXED)
    shard = 10**9
    expected = 2 * shard * 2 / (cluster.gpu.host_bandwidth * 0.88) + \
        8 * shard * CPU_ADAM_TENSORS_PER_PARAM * 4 / host_memory_bandwidth(cluster.gpu.id)
    assert offload_seconds(cluster, config, partition=shard, params=shard, grad_bytes=2) == pytest.approx(
        expected, rel=1e-12)


def test_torchtune_70b_recipe_prices_its_copies_hidden_behind_the_layers_compute(monkeypatch):
    """torchtune's Llama-3.1-70B recipe (examples/recipes: 8xA100, FSDP2 with CPUOffloadPolicy, pure bf16): every
    decoder layer computes longer than the next layer's shard takes to cross PCIe and be gathered, so FSDP2's
    prefetch hides the copies (`offload_schedule`). The priced offload is then below the copies one after another
    plus the host AdamW step, but never below what nothing overlaps: that step and the first layer's copy before
    forward can start."""
    import solver.api as api

    seen = {}
    real = api.estimate_config

    def spy(graph, cluster, workload, config):
        seen.update(graph=graph, cluster=cluster, config=config)
        return real(graph, cluster, workload, config)

    monkeypatch.setattr(api, "estimate_config", spy)
    recipe = next(r for r in recipes() if r.name == "torchtune-llama3_1-70b-full")
    priced = recipe_estimate(recipe).time.offload
    graph, cluster, config = seen["graph"], seen["cluster"], seen["config"]
    assert config.engine is Engine.FSDP2 and config.param_offload is Offload.CPU and config.precision is Precision.BF16
    dims = {"tp": 1, "dp": config.dp, "engine": config.engine, "sharded": True}
    params, owned = local_elements(graph.tensor_groups(), **dims), local_elements(
        graph.tensor_groups(trainable=True), **dims)
    one_after_another = offload_seconds(cluster, config, partition=owned, params=params, grad_bytes=2)
    host = host_step_seconds(cluster, config, partition=owned)
    link = cluster.gpu.host_bandwidth * PCIE_EFFICIENCY
    first_copy = local_elements(graph.decoder_layers()[0].params, **dims) * 2 / link  # bf16 shard of layer 0
    assert host + first_copy <= priced < one_after_another
    assert priced - host < 0.1 * (one_after_another - host)  # mostly hidden: the layers outlast their copies


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
