"""Paged AdamW (bitsandbytes `PagedAdamW8bit` / `PagedAdamW32bit`) against the library itself.

On CPU bitsandbytes falls back to ordinary state tensors (`get_state_buffer`: "Paged optimizers are not supported
on CPU"), which gives the real state bytes after a step. Which tensors go to unified memory is bitsandbytes' own
`init_state` run on meta-device parameters, with `F.get_paged` (a cudaMallocManaged call) replaced by a tensor
marked `is_paged` as the real one is.
"""

from __future__ import annotations

import json
import warnings
from importlib import resources

import pytest
import torch

from costmodels import parse_cluster
from costmodels.optimizers import PAGED_ADAMW_8BIT, PAGED_ADAMW_32BIT, fixed_state_bytes, state_bytes
from costmodels.paging import paged_states, paging_seconds

bnb = pytest.importorskip("bitsandbytes")

SHAPES = [(7,), (300, 5), (4095,), (4097,), (99_999,), (100_000,), (400, 250), (1000, 333), (3, 200, 300)]
CLASSES = {PAGED_ADAMW_8BIT: "PagedAdamW8bit", PAGED_ADAMW_32BIT: "PagedAdamW32bit"}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_state_bytes_match_bitsandbytes_states_after_a_cpu_step(name, dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in SHAPES]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback warns once
        opt = getattr(bnb.optim, CLASSES[name])(params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    maps = {}
    for p in params:
        state = opt.state[p]
        maps.update({t.data_ptr(): nbytes(t) for key, t in state.items() if key.startswith("qmap")})
        per_tensor = sum(nbytes(t) for key, t in state.items() if torch.is_tensor(t) and not key.startswith("qmap"))
        assert state_bytes(name, tuple(p.shape), p.element_size()) == per_tensor, p.shape
    assert fixed_state_bytes(name) == sum(maps.values())


@pytest.fixture()
def managed(monkeypatch):
    """bitsandbytes' `get_paged` without CUDA: the same shape and dtype, marked as the real one marks it."""
    import bitsandbytes.optim.optimizer as bnb_optimizer

    def get_paged(*shape, dtype=torch.float32, device=None):
        tensor = torch.zeros(shape, dtype=dtype, device="meta")
        tensor.is_paged = True
        return tensor

    monkeypatch.setattr(bnb_optimizer.F, "get_paged", get_paged)
    monkeypatch.setattr(bnb_optimizer.F, "fill", lambda tensor, value: None)


@pytest.mark.parametrize("name", CLASSES)
def test_paged_split_follows_bitsandbytes_init_state(name, managed):
    params = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in SHAPES]
    opt = getattr(bnb.optim, CLASSES[name])(params)
    paged = resident = largest = 0
    maps = {}
    for index, p in enumerate(params):
        opt.init_state(opt.param_groups[0], p, 0, index)
        tensors = {key: t for key, t in opt.state[p].items() if torch.is_tensor(t)}
        maps.update({id(t): nbytes(t) for key, t in tensors.items() if key.startswith("qmap")})
        block = sum(nbytes(t) for t in tensors.values() if getattr(t, "is_paged", False))
        paged += block
        largest = max(largest, block)
        resident += sum(nbytes(t) for key, t in tensors.items()
                        if not getattr(t, "is_paged", False) and not key.startswith("qmap"))
    split = paged_states(name, [(shape, 1) for shape in SHAPES])
    assert (split.paged, split.largest_block, split.resident) == (paged, largest, resident + sum(maps.values()))
    assert split.paged > 0


def test_device_bytes_keep_only_the_largest_block_and_counts_multiply():
    shapes = [((4096, 4096), 4), ((14336, 4096), 3), ((4096,), 2)]
    split = paged_states(PAGED_ADAMW_8BIT, shapes)
    assert split.largest_block == 2 * 14336 * 4096
    assert split.paged == 2 * (4 * 4096 * 4096 + 3 * 14336 * 4096)
    assert split.device == split.resident + split.largest_block
    total = sum(n * state_bytes(PAGED_ADAMW_8BIT, s, 4) for s, n in shapes) + fixed_state_bytes(PAGED_ADAMW_8BIT)
    assert split.resident + split.paged == total
    per_param = paged_states(PAGED_ADAMW_8BIT, shapes, instances=9)
    assert per_param.resident - split.resident == 8 * fixed_state_bytes(PAGED_ADAMW_8BIT)
    with pytest.raises(ValueError, match="not paged"):
        paged_states("adamw-8bit", shapes)


def test_paging_seconds_move_the_paged_bytes_both_ways_over_the_host_link():
    """The RTX 4090's host link from the GPU catalog (PCIe Gen4 x16), at the offload model's measured efficiency."""
    records = json.loads(resources.files("costmodels").joinpath("data/gpus.json").read_text(encoding="utf-8"))
    record = next(r for r in records if "RTX4090" in r["aliases"])
    split = paged_states(PAGED_ADAMW_8BIT, [((14336, 4096), 96), ((4096, 4096), 128)])
    link = record["host_link"]["uni_gbps"] * 1e9 * 0.88
    assert paging_seconds(parse_cluster("1xRTX4090"), split) == pytest.approx(2 * split.paged / link)
