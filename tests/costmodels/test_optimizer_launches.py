"""Optimizer-step kernel launches: the multi-tensor op counts recounted from torch's own optimizers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from costmodels import Config, Engine, Optimizer, Workload, estimate, parse_cluster
from costmodels.compute import KERNEL_LAUNCH_SECONDS
from costmodels.optimizer_launches import MAX_TENSORS_PER_LAUNCH, MULTI_TENSOR_OPS, optimizer_tensors, step_kernels
from graphs import lower

from ..graphs.reference import write_config
from ..graphs.tiny_configs import tiny_values


class _ListOps(TorchDispatchMode):
    """Multi-tensor ops of one step, split by whether their first list holds parameter-sized or 0-dim tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.sized = self.scalar = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        first = args[0] if args else None
        if isinstance(first, list | tuple) and first and isinstance(first[0], torch.Tensor):
            if first[0].dim() > 0:
                self.sized += 1
            else:
                self.scalar += 1
        return func(*args, **(kwargs or {}))


MAKERS = {
    Optimizer.ADAMW: lambda ps: torch.optim.AdamW(ps, foreach=True),
    Optimizer.ADAMW_FUSED: lambda ps: torch.optim.AdamW(ps, fused=True),
    Optimizer.SGD: lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    Optimizer.ADAFACTOR: lambda ps: torch.optim.Adafactor(ps, foreach=True),
}


@pytest.mark.parametrize("optimizer", list(MAKERS))
def test_multi_tensor_ops_per_step_equal_torchs_own_optimizer(optimizer):
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = MAKERS[optimizer](params)
    opt.step()  # the first step creates the states
    counter = _ListOps()
    with counter:
        opt.step()
    # Fused AdamW keeps its step counters on the parameters' device, so their increment is a kernel too; foreach
    # keeps them on the host (torch `_get_scalar_dtype`, capturable=False), where the increment launches nothing.
    device_steps = counter.scalar if optimizer is Optimizer.ADAMW_FUSED else 0
    assert MULTI_TENSOR_OPS[optimizer] == counter.sized + device_steps


def test_step_kernels_grow_per_launch_group_or_per_tensor():
    one = step_kernels(Optimizer.ADAMW, tensors=MAX_TENSORS_PER_LAUNCH, elements=1000)
    assert one == MULTI_TENSOR_OPS[Optimizer.ADAMW]
    assert step_kernels(Optimizer.ADAMW, tensors=MAX_TENSORS_PER_LAUNCH + 1, elements=1000) == 2 * one
    assert step_kernels(Optimizer.ADAMW_8BIT, tensors=200, elements=1000) == 200
    assert optimizer_tensors(200, Config(engine=Engine.DEEPSPEED, zero=2)) == 1
    assert optimizer_tensors(200, Config(engine=Engine.FSDP2, zero=3)) == 200


def test_tiny_model_optimizer_step_waits_on_its_launches(tmp_path):
    graph = lower(str(write_config(tmp_path, tiny_values("llama"))), dtype="float32", autocast="bfloat16",
                  use_cache=False)
    tensors = sum(n for _, n in graph.tensor_groups(trainable=True))
    config = Config(engine=Engine.DDP, micro_batch=1, optimizer=Optimizer.ADAMW_8BIT)
    est = estimate(graph, parse_cluster("1xH100"), Workload(seq_len=16, global_batch=1), config)
    assert est.time.optimizer == pytest.approx(tensors * KERNEL_LAUNCH_SECONDS, rel=1e-12)
