"""Quantized frozen base weights (QLoRA) as transformers and bitsandbytes build them, on meta and fake tensors.

The model is quantized the way `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` does it:
transformers' own `replace_with_bnb_linear` with its own skip list (LM head, tied and last modules), then PEFT
wraps the bitsandbytes layers with its `lora.bnb` adapters. After the move to fake tensors each 4-bit weight is
packed by bitsandbytes' own `quantize_4bit`, so the trace runs bitsandbytes' `MatMul4Bit` and its saved tensors,
and the graph's parameter bytes are the sizes of bitsandbytes' own packed data and `QuantState` tensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .adapters import Quantization
from .errors import UnsupportedModel


def bnb_config(quantization: Quantization, *, double_quant: bool, compute_dtype: str) -> Any:
    """The transformers `BitsAndBytesConfig` that loads a model with this quantization (what emitters write)."""
    from transformers import BitsAndBytesConfig

    if quantization is Quantization.INT8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization.value,
                              bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=getattr(torch, compute_dtype))


def quantize_linears(model: torch.nn.Module, quantization: Quantization, *, double_quant: bool) -> int:
    """Swap the model's linear layers for bitsandbytes layers on the meta device, as transformers' bnb quantizer
    does before loading weights; returns how many were swapped, and refuses a model where none would be. Weights
    stay plain (N, K) meta parameters until `pack` (bitsandbytes' Params4bit cannot be deep-copied on meta, which
    the trace model needs)."""
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    if quantization is Quantization.INT8:
        raise UnsupportedModel("int8 (LLM.int8) base weights are priced by costmodels.quantization but not traced",
                               "Use nf4 or fp4 (QLoRA) to lower a quantized base.")
    config = bnb_config(quantization, double_quant=double_quant, compute_dtype=str(model.dtype).removeprefix("torch."))
    skip = HfQuantizer.get_modules_to_not_convert(model, config.llm_int8_skip_modules,
                                                  getattr(model, "_keep_in_fp32_modules", None))
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=config)
    swapped = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.compute_dtype = model.dtype
            weight = torch.nn.Parameter(torch.empty(module.weight.shape, dtype=model.dtype, device="meta"),
                                        requires_grad=False)
            # What PEFT's 4-bit dispatcher reads from a Params4bit (peft 0.21 tuners/lora/bnb.py).
            weight.compress_statistics, weight.quant_type = double_quant, quantization.value
            module.weight = weight
            if module.bias is not None:  # made in the default dtype on meta; loading gives it the model's dtype
                module.bias = torch.nn.Parameter(torch.empty_like(module.bias, dtype=model.dtype),
                                                 requires_grad=False)
            swapped += 1
    if swapped == 0:
        raise _nothing_quantized(model)
    # transformers' quantizer marks the model so that PEFT dispatches its bitsandbytes adapters (lora.bnb).
    model.is_loaded_in_4bit = True
    return swapped


def _nothing_quantized(model: torch.nn.Module) -> UnsupportedModel:
    """transformers 5.24's `replace_with_bnb_linear` swaps only modules whose type is exactly `nn.Linear` (or
    Conv1D): a model whose linear layers subclass it (Falcon's FalconLinear) loads with `load_in_4bit` and every
    weight still 16-bit, with only a log line, and PEFT wraps those layers with its plain 16-bit adapters."""
    import transformers

    classes = sorted({type(m).__name__ for m in model.modules()
                      if isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear})
    layers = f"its linear layers are {', '.join(classes)}, subclasses of nn.Linear" if classes else \
        "it has no nn.Linear layer outside the skipped ones"
    return UnsupportedModel(
        f"{type(model).__name__} cannot be loaded in 4 bits: transformers {transformers.__version__} "
        f"(replace_with_bnb_linear) quantizes only layers that are exactly torch.nn.Linear, and {layers}. "
        "A QLoRA run of it would train LoRA over its 16-bit weights.",
        "Plan 16-bit LoRA for this model (drop --lora-quantization).")


def _prime_code_tables() -> None:
    """bitsandbytes builds its 8-bit code table with `.tolist()` on first use, which fake tensors cannot do:
    quantize one real block first (double quantization reads that table)."""
    import bitsandbytes.functional as bnb_f

    bnb_f.quantize_4bit(torch.zeros(64), compress_statistics=True, quant_type="nf4")


def _quantize(weight: torch.Tensor, quantization: Quantization, double_quant: bool) -> tuple[torch.Tensor, Any]:
    import bitsandbytes.functional as bnb_f

    # No block size: bitsandbytes' default (64), which Params4bit uses when transformers quantizes (its
    # BitsAndBytesConfig has no block-size field).
    return bnb_f.quantize_4bit(weight, compress_statistics=double_quant, quant_type=quantization.value,
                               quant_storage=torch.uint8)


def pack(model: torch.nn.Module, mode: Any, quantization: Quantization, *, double_quant: bool) -> None:
    """Pack every 4-bit layer's (fake) weight with bitsandbytes' `quantize_4bit`, as `Params4bit._quantize`
    does when a quantized model moves to its device."""
    import bitsandbytes as bnb

    _prime_code_tables()
    with mode:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit) and getattr(module.weight, "quant_state", None) is None:
                packed, state = _quantize(torch.empty(module.weight.shape, dtype=module.weight.dtype),
                                          quantization, double_quant)
                weight = torch.nn.Parameter(packed, requires_grad=False)
                weight.quant_state = state
                module.weight = weight
                module.quant_state = state


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor a bitsandbytes `QuantState` holds on the device (nested state included)."""
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


@functools.lru_cache(maxsize=256)
def stored_bytes(shape: tuple[int, ...], quantization: Quantization, *, double_quant: bool) -> int:
    """Device bytes of one quantized weight: bitsandbytes' packed data plus its QuantState tensors, measured by
    quantizing a fake tensor of `shape` with bitsandbytes itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _prime_code_tables()
    with FakeTensorMode(allow_non_fake_inputs=True):
        packed, state = _quantize(torch.empty(shape, dtype=torch.bfloat16), quantization, double_quant)
        return sum(t.untyped_storage().nbytes() for t in [packed, *state_tensors(state)])


def quantized_weight_names(model: torch.nn.Module) -> list[str]:
    """Fully qualified names of the weights bitsandbytes stores quantized."""
    import bitsandbytes as bnb

    return [f"{name}.weight" for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)]


class _DequantizeThenMatmul(TorchDispatchMode):
    """Run bitsandbytes' `gemm_4bit` as the CUDA kernel runs it at training sizes.

    bitsandbytes 0.50 backends/cuda/ops.py: for more than `_gemm_4bit_custom_max_m` = 1536 rows (tokens per
    micro-batch) `gemm_4bit` takes `_dequant_linear_fallback`: the whole weight dequantized to the compute dtype
    (nested absmax first), then `F.linear`. Its fake kernel returns only the output, so the trace runs that
    composition, whose ops the recorder (the next mode) sees: the transient dequantized weight, the
    dequantization's memory traffic and the matmul's FLOPs.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.bitsandbytes.gemm_4bit.default:
            return _dequantize_then_linear(*args, **kwargs)
        return func(*args, **kwargs)


def _dequantize_then_linear(a: torch.Tensor, packed: torch.Tensor, shape: list[int], absmax: torch.Tensor,
                            blocksize: int, quant_type: str, bias: torch.Tensor | None = None,
                            absmax_8bit: torch.Tensor | None = None, absmax_code: torch.Tensor | None = None,
                            absmax_offset: torch.Tensor | None = None) -> torch.Tensor:
    """bitsandbytes' `_dequant_linear_fallback` op for op, with `linear` as autograd decomposes it for plain
    layers (view, t, mm), so that the recorder counts the matmul's FLOPs."""
    ops = torch.ops.bitsandbytes
    if absmax_8bit is not None:
        absmax = ops.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256, torch.float32) + absmax_offset
    weight = ops.dequantize_4bit.default(packed, absmax, blocksize, quant_type, shape, a.dtype)
    flat = a.reshape(-1, a.shape[-1])
    out = (torch.ops.aten.mm.default(flat, weight.t()) if bias is None
           else torch.ops.aten.addmm.default(bias, flat, weight.t()))
    return out.view(*a.shape[:-1], shape[0])


def _peft_dequantize(original: Any) -> Any:
    """PEFT's `dequantize_module_weight` tells a 4-bit weight by its class name (Params4bit), which a fake
    tensor cannot have (torch's `_make_subclass` refuses FakeTensor data): dequantize tagged weights as PEFT's
    `dequantize_bnb_weight` does, with `bnb.functional.dequantize_4bit(weight.data, weight.quant_state)`."""
    def dequantize_module_weight(module: torch.nn.Module) -> Any:
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            return original(module)
        import bitsandbytes.functional as bnb_f

        return bnb_f.dequantize_4bit(module.weight.data, state)

    return dequantize_module_weight


@contextlib.contextmanager
def _autocast_seen_as_on_the_gpu() -> Iterator[None]:
    """PEFT's 4-bit adapters ask `torch.is_autocast_enabled()` (no device: CUDA's autocast) whether to cast each
    input to the adapters' dtype and the output back (peft 0.21 tuners/lora/bnb.py `requires_conversion`). A GPU
    run under autocast answers yes and skips both casts; the trace runs CPU autocast in its place, so the question
    without a device is answered for the CPU."""
    original = torch.is_autocast_enabled

    def is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
        return original(*args, **kwargs) if args or kwargs else original("cpu")

    torch.is_autocast_enabled = is_autocast_enabled
    try:
        yield
    finally:
        torch.is_autocast_enabled = original


@contextlib.contextmanager
def dequantizing() -> Iterator[None]:
    """Trace bitsandbytes 4-bit layers and their PEFT adapters as they run on a GPU in training (see the three
    quirks above). Enter it inside the recorder so that the recorder sees the dequantization ops."""
    import peft.tuners.lora.dora as dora

    original = dora.dequantize_module_weight
    dora.dequantize_module_weight = _peft_dequantize(original)
    try:
        with _DequantizeThenMatmul(), _autocast_seen_as_on_the_gpu():
            yield
    finally:
        dora.dequantize_module_weight = original
