"""FSDP2's CPU offload traffic and host step from what torch's CPUOffloadPolicy does (issue 35 item 13): a real
one-rank gloo FSDP2 run on CPU shows where its sharded parameters, gradients and AdamW moments live and in which
dtype, and `costmodels.offload` must price exactly those bytes: the gradients come down once (the parameters stay on
the host and go up only in the fetch before each use, not a second time after the step), each in the shard's own
dtype, and the host AdamW streams seven tensors of the moments' dtype per parameter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from costmodels import Config, Engine, Offload, Optimizer, Precision, parse_cluster
from costmodels.offload import (
    CPU_ADAM_TENSORS_PER_PARAM,
    cpu_adam_slowdowns,
    host_memory_bandwidth,
    offload_seconds,
)
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
    down = shard * seen["grad_itemsize"]  # reduce-scattered gradients to the host, once per step
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


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
