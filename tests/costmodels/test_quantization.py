"""Quantized base weights: the byte formulas against bitsandbytes' own tensors on CPU."""

from __future__ import annotations

import pytest
import torch

from costmodels.quantization import (
    bits_per_param,
    dequantize_bytes_moved,
    dequantize_seconds,
    dequantized_weight_bytes,
    packed_weight_bytes,
    quant_state_bytes,
    quantized_weight_bytes,
)
from graphs.adapters import Quantization

bnb = pytest.importorskip("bitsandbytes")

SHAPES = [(256, 128), (96, 40), (130, 33)]  # whole blocks, a partial last block, an odd element count


def _state_tensors(state) -> list[torch.Tensor]:
    """Every tensor of a QuantState, found by walking its attributes (not by the layout under test)."""
    found = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    if state.state2 is not None:
        found += _state_tensors(state.state2)
    return found


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("quantization", [Quantization.NF4, Quantization.FP4])
@pytest.mark.parametrize("double_quant", [False, True])
def test_4bit_layout_equals_bitsandbytes_params4bit(shape, quantization, double_quant):
    weight = torch.randn(shape, dtype=torch.bfloat16)
    param = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=double_quant,
                              quant_type=quantization.value).to("cpu")
    state = param.quant_state
    assert state.nested is double_quant
    assert param.untyped_storage().nbytes() == packed_weight_bytes(shape, quantization)
    assert _nbytes(_state_tensors(state)) == quant_state_bytes(shape, quantization, double_quant=double_quant)
    assert quantized_weight_bytes(shape, quantization, double_quant=double_quant) == \
        param.untyped_storage().nbytes() + _nbytes(_state_tensors(state))


def test_int8_layout_equals_bitsandbytes_int8params():
    shape = (96, 40)
    param = bnb.nn.Int8Params(torch.randn(shape, dtype=torch.float16), requires_grad=False,
                              has_fp16_weights=False).to("cpu")
    assert param.dtype == torch.int8
    assert param.untyped_storage().nbytes() == packed_weight_bytes(shape, Quantization.INT8)
    assert param.SCB.untyped_storage().nbytes() == quant_state_bytes(shape, Quantization.INT8, double_quant=False)


def test_bits_per_param_match_the_qlora_paper():
    # Dettmers et al. 2023, §3: blocksize-64 fp32 constants cost 32/64 = 0.5 bits per parameter; double
    # quantization brings them to 8/64 + 32/(64*256) = 0.127 bits.
    shape = (4096, 4096)
    assert bits_per_param(shape, Quantization.NF4, double_quant=False) == pytest.approx(4.5, abs=1e-4)
    assert bits_per_param(shape, Quantization.NF4, double_quant=True) == pytest.approx(4.127, abs=1e-3)
    assert bits_per_param(shape, Quantization.INT8, double_quant=False) == pytest.approx(8.0, abs=1e-2)


class _Outputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the output bytes of bitsandbytes' dequantize ops (real tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.dequantized: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.bitsandbytes.dequantize_4bit.default:
            self.dequantized.append(out.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("double_quant", [False, True])
def test_backward_dequantizes_the_whole_weight_in_the_compute_dtype(double_quant):
    layer = bnb.nn.Linear4bit(128, 256, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=double_quant)
    layer.weight = bnb.nn.Params4bit(torch.randn(256, 128, dtype=torch.bfloat16), requires_grad=False,
                                     compress_statistics=double_quant, quant_type="nf4")
    layer = layer.to("cpu")
    x = torch.randn(4, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    recorder = _Outputs()
    with recorder:
        out.float().sum().backward()
    assert recorder.dequantized == [dequantized_weight_bytes((256, 128), 2)]


def test_dequantize_time_is_bytes_over_bandwidth():
    shape = (14336, 4096)  # Llama-3.1-8B's MLP projections
    moved = dequantize_bytes_moved(shape, Quantization.NF4, double_quant=True, compute_itemsize=2)
    # Read 0.5 byte and write 2 bytes per weight, plus the per-block scales (fp32 per 64 weights, which double
    # quantization first expands from 8 bits and offsets: 17 bytes moved per block, 0.27 byte per weight).
    numel = shape[0] * shape[1]
    assert 2.5 * numel + 17 * numel // 64 <= moved < 2.5 * numel + 17 * numel // 64 + numel // 4096 + 2048
    assert dequantize_seconds(shape, Quantization.NF4, double_quant=True, compute_itemsize=2,
                              memory_bandwidth=600e9) == pytest.approx(moved / 600e9)
    with pytest.raises(ValueError, match="4-bit"):
        dequantize_bytes_moved(shape, Quantization.INT8, double_quant=False, compute_itemsize=2)
