"""PEFT's `prepare_model_for_kbit_training` on a 4-bit base, as the runtimes that call it leave the model.

PEFT (peft 0.21 utils/other.py) casts every 16-bit parameter outside bitsandbytes' 4-bit weights to fp32: embeddings,
LM head, norms, the 4-bit layers' biases. The fp32 norm outputs then feed the 4-bit layers (which cast their input to
the compute dtype and their output back to the input's dtype), so the residual stream, the saved activations and,
with an fp32 LM head, the logits grow too. A runtime may cast some modules back to the compute dtype afterwards
(axolotl's loader casts modules named like norms and its embedding modules back: `recast`).
"""

from __future__ import annotations

import torch


def prepare_for_kbit(model: torch.nn.Module, recast: tuple[str, ...]) -> None:
    """Apply PEFT's own `prepare_model_for_kbit_training` to a model `quantization.quantize_linears` has swapped,
    before the adapters attach (where the runtimes call it), then cast the modules whose qualified name contains one
    of `recast` back to the model's dtype. Gradient checkpointing stays the plan's (not PEFT's default)."""
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    dtype = model.dtype
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False, auto_clear_cache=False)
    # Until `quantization.pack`, a 4-bit weight is a 16-bit meta stand-in of its shape, which PEFT would upcast;
    # the real Params4bit holds packed uint8 data, which PEFT leaves alone. A 4-bit layer's bias goes back to the
    # compute dtype at its first forward, for good (bitsandbytes 0.50 nn/modules.py `Linear4bit.forward`:
    # `bias.data = bias.data.to(x.dtype)` after x is cast to the compute dtype).
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            _cast_own(module, dtype)
    for name, module in model.named_modules():
        if any(part in name for part in recast):
            _cast_own(module, dtype)


def _cast_own(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """`module.to(dtype)` for its floating-point parameters (4-bit stand-ins included: they are `dtype` again)."""
    for param in module.parameters():
        if param.dtype.is_floating_point:
            param.data = param.data.to(dtype)

