"""Optimizer state and step-temporary bytes per tensor against the real optimizers' state tensors.

torch.optim AdamW (foreach and fused), Adafactor and SGD run one real step on small CPU tensors; bitsandbytes'
8-bit AdamW is checked against its documented block layout (and against the library itself where installed).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from costmodels import Optimizer, Precision
from costmodels.optimizers import fixed_state_bytes, state_bytes, step_counter_bytes, step_temp_bytes
from costmodels.precision import state_itemsize

# 1-D (a norm weight or bias), 2-D (a linear weight, square-ish and tall-thin) and 3-D (stacked experts).
SHAPES = [(7,), (64, 48), (4, 32, 16), (300, 5)]
DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16}
TORCH_OPTIMIZERS = [Optimizer.ADAMW, Optimizer.ADAMW_FUSED, Optimizer.ADAFACTOR, Optimizer.SGD]


def make_optimizer(optimizer: Optimizer, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer each enum value stands for, as a CUDA run would pick it (foreach unless fused)."""
    match optimizer:
        case Optimizer.ADAMW:
            return torch.optim.AdamW(params, foreach=True)
        case Optimizer.ADAMW_FUSED:
            return torch.optim.AdamW(params, fused=True)
        case Optimizer.ADAFACTOR:
            return torch.optim.Adafactor(params, foreach=True)
        case Optimizer.SGD:
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    raise ValueError(optimizer)


def stepped(optimizer: Optimizer, dtype: torch.dtype, device: str = "cpu") -> tuple[list, torch.optim.Optimizer]:
    """Parameters of SHAPES and their optimizer after one step (which creates the states)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device)) for shape in SHAPES]
    opt = make_optimizer(optimizer, params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("optimizer", TORCH_OPTIMIZERS)
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_state_bytes_match_torch_optimizer_states_after_one_step(optimizer, precision):
    """The `step` counters are left out here; `step_counter_bytes` accounts for them."""
    params, opt = stepped(optimizer, DTYPES[precision])
    itemsize = state_itemsize(precision)
    for p in params:
        states = {name: t for name, t in opt.state[p].items() if name != "step"}
        # States follow the parameter dtype: pure-bf16 training keeps bf16 moments (precision.state_itemsize).
        assert {t.dtype for t in states.values()} == {p.dtype}
        assert p.element_size() == itemsize
        assert state_bytes(optimizer, tuple(p.shape), itemsize) == sum(nbytes(t) for t in states.values()), p.shape


@pytest.mark.parametrize("optimizer", TORCH_OPTIMIZERS)
def test_step_counter_bytes_match_step_tensors_on_the_parameter_device(optimizer, monkeypatch):
    """Fake CUDA tensors show where each implementation keeps `step`: fused AdamW on the device, the foreach
    implementations on the host (capturable=False), SGD keeps none."""
    # Adafactor reads its step counter with .item(); fake tensors have no values and no allocation depends on it.
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: 1.0 if isinstance(self, FakeTensor) else original(self))
    with FakeTensorMode(allow_non_fake_inputs=True):
        params, opt = stepped(optimizer, torch.float32, device="cuda")
        on_device = sum(nbytes(opt.state[p]["step"]) for p in params
                        if "step" in opt.state[p] and opt.state[p]["step"].device == p.device)
    assert step_counter_bytes(optimizer, len(params)) == on_device


@pytest.mark.parametrize("optimizer", TORCH_OPTIMIZERS)
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_step_temp_bytes_match_memtracker_over_a_second_step(optimizer, precision):
    """MemTracker counts what the step allocates beyond the states (the first step creates those)."""
    _, opt = stepped(optimizer, DTYPES[precision])
    tracker = MemTracker()
    tracker.track_external(opt)
    with tracker:
        before = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("current").values())
        opt.step()
    peak = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    itemsize = state_itemsize(precision)
    # Adafactor also divides by each factored tensor's row-variance mean, `row_var.mean(dim=-2, keepdim=True)`:
    # one element per (r, c) matrix, which the model leaves out (24 bytes here against 26,508).
    normalisers = sum(math.prod(s[:-2]) * itemsize for s in SHAPES if len(s) >= 2) \
        if optimizer is Optimizer.ADAFACTOR else 0
    # SGD's foreach step is in place only without weight decay (the torch default used here): with weight decay
    # it allocates `grad + weight_decay * param` for every tensor.
    assert peak - before == pytest.approx(step_temp_bytes(optimizer, SHAPES, itemsize), abs=normalisers)


# bitsandbytes `Optimizer2State.init_state` (bitsandbytes/optim/optimizer.py, bitsandbytes-foundation/bitsandbytes
# main at 51294d9, and the 0.50.2 wheel): a tensor with fewer than `min_8bit_size` elements (AdamW8bit default
# 4096) gets two fp32 states shaped like it; a larger one gets uint8 `state1`/`state2` shaped like it, plus fp32
# `absmax1`/`absmax2` of ceil(numel / 256) blocks (`blocks = n // 256; blocks += 1 if n % 256 > 0`), plus the
# shared 256-entry fp32 maps `qmap1`/`qmap2` (`F.create_dynamic_map`). Older releases used 2048-element blocks
# (the same file at 06029dd). The states are fp32 or uint8 whatever the parameter dtype (`get_state_buffer`).
BNB_SHAPES = [*SHAPES, (4095,), (4096,), (4097,), (70, 70), (1000, 33)]


def bnb_layout_bytes(numel: int) -> int:
    if numel < 4096:
        return 2 * numel * 4
    return 2 * numel + 2 * -(-numel // 256) * 4


@pytest.mark.parametrize("shape", BNB_SHAPES)
@pytest.mark.parametrize("itemsize", [4, 2])
def test_8bit_adamw_state_bytes_follow_bitsandbytes_block_layout(shape, itemsize):
    """The layout of bitsandbytes `Optimizer2State.init_state` (bitsandbytes/optim/optimizer.py at 51294d9;
    `min_8bit_size=4096` is the `AdamW8bit` default in bitsandbytes/optim/adamw.py), quoted above."""
    assert state_bytes(Optimizer.ADAMW_8BIT, shape, itemsize) == bnb_layout_bytes(math.prod(shape))


def test_8bit_adamw_shares_two_256_entry_fp32_quantisation_maps():
    assert fixed_state_bytes(Optimizer.ADAMW_8BIT) == 2 * 256 * 4
    eight_bit = (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)
    assert fixed_state_bytes(Optimizer.PAGED_ADAMW_8BIT) == 2 * 256 * 4
    assert all(fixed_state_bytes(o) == 0 for o in Optimizer if o not in eight_bit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_adamw_state_bytes_match_bitsandbytes_states_after_one_step(dtype):
    """Runs only where bitsandbytes is installed (its CPU backend steps 8-bit AdamW since 0.4x)."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in BNB_SHAPES]
    opt = bnb.optim.AdamW8bit(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    maps = {}
    for p in params:
        state = opt.state[p]
        maps.update({t.data_ptr(): nbytes(t) for name, t in state.items() if name.startswith("qmap")})
        per_tensor = sum(nbytes(t) for name, t in state.items() if torch.is_tensor(t) and not name.startswith("qmap"))
        assert state_bytes(Optimizer.ADAMW_8BIT, tuple(p.shape), p.element_size()) == per_tensor, p.shape
    assert fixed_state_bytes(Optimizer.ADAMW_8BIT) == sum(maps.values())
