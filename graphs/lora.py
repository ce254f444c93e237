"""LoRA adapters as PEFT defines them: the base weights freeze, the adapters train."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .adapters import LoraSpec
from .errors import FitplanError

if TYPE_CHECKING:
    import torch

def apply_lora(model: torch.nn.Module, spec: LoraSpec, *, autocast: bool) -> torch.nn.Module:
    """Inject adapters in place (PEFT `get_peft_model`) and freeze everything else, in the dtype the runtime trains
    them in.

    - Under torch.autocast (plain PyTorch mixed precision): PEFT's default, `autocast_adapter_dtype=True`, which
      upcasts 16-bit adapters to fp32 (peft 0.21 tuners_utils `_cast_adapter_dtype`), as fitplan's torchrun script
      and the HF/accelerate launchers (adapter_config.json read by `get_peft_model`) build them. PEFT then casts each
      adapted layer's input to the adapters' fp32 (lora/layer.py `_cast_input_dtype`), and autocast casts it back
      to 16 bits for lora_A's matmul: every adapted projection saves its own 16-bit copy of its input.
    - Without autocast the engine runs the adapters in the base layer's 16 bits (DeepSpeed casts the whole module,
      FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)` gathers every parameter in bf16, pure bf16 builds them so).
    """
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, spec.peft_config(), autocast_adapter_dtype=autocast)
    except ValueError as err:
        raise FitplanError(f"LoRA targets {list(spec.targets)} do not fit this model: {err}",
                           "Use module names that exist in the model (e.g. q_proj,v_proj) or 'all-linear'.") from err
    return peft_model.base_model.model


@contextlib.contextmanager
def adapter_tracing(spec: LoraSpec | None) -> Iterator[None]:
    """Run the adapters in the fake-tensor trace as they run in training (enter inside the recorder).

    - 4-bit bases: bitsandbytes' matmul as its CUDA kernel runs it at training sizes (`quantization.dequantizing`).
    - DoRA: PEFT builds each layer's LoRA product from an identity (`DoraLinearLayer.get_lora_weight`:
      lora_B(lora_A(eye(in_features)))) and uses it only detached, so a real run frees the identity and the
      graph at once. The trace's scope tracker (torch's ModTracker) holds the latest module call's outputs until
      the next module runs, which would carry an in_features^2 identity per adapted layer (684 MiB for a 7B
      model's down_proj) into the next layer. Building it without grad allocates the same tensors, frees them
      when a real run does, and gives the same result.
    """
    with contextlib.ExitStack() as stack:
        if spec is not None and spec.quantization is not None:
            from .quantization import dequantizing

            stack.enter_context(dequantizing())
        if spec is not None and spec.use_dora:
            stack.enter_context(_dora_product_without_grad())
        yield


@contextlib.contextmanager
def _dora_product_without_grad() -> Iterator[None]:
    import torch
    from peft.tuners.lora.dora import DoraLinearLayer

    original = DoraLinearLayer.get_lora_weight

    def get_lora_weight(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return original(self, *args, **kwargs)

    DoraLinearLayer.get_lora_weight = get_lora_weight
    try:
        yield
    finally:
        DoraLinearLayer.get_lora_weight = original
