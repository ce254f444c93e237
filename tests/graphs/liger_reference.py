"""The reference for Liger's lowering: a real Liger-patched model trained one step on CPU, its Triton kernels run by
Triton's interpreter. Run as a script (`TRITON_INTERPRET=1` must be set before Triton decorates the kernels, so
never in the pytest process); prints `tests.graphs.reference.Reference` as JSON.

Two shims make Triton 3.9's interpreter run liger-kernel 0.8.5's kernels as compiled Triton would; neither
touches what the kernels' host code allocates or saves:
- the interpreter passes Python float arguments through as floats (interpreter.py `_implicit_cvt` converts only
  bools, ints and pointers), so `eps.to(tl.float32)` in `_rms_norm_forward_kernel` fails; compiled Triton passes
  them as fp32 scalars, which the shim does;
- ops/rms_norm.py and ops/geglu.py import `rsqrt` and `tanh` from `triton.language.extra.libdevice`, extern stubs
  without a body in the interpreter; the shims call `tl.math.rsqrt` and tanh(x) = 2 sigmoid(2x) - 1, which the
  interpreter implements (the values do not change what is allocated or saved).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from typing import Any


def _interpreter_shims() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._implicit_cvt

    def implicit_cvt(arg: Any) -> Any:
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = implicit_cvt
    import liger_kernel.ops.geglu as geglu
    import liger_kernel.ops.rms_norm as rms_norm

    rms_norm.rsqrt = lambda x: tl.math.rsqrt(x)
    geglu.tanh = lambda x: 2 * tl.sigmoid(2 * x) - 1


def run(values: dict[str, Any], *, b: int, s: int, dtype: str, attention: str, kernels: dict[str, bool],
        lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-layer saved bytes and FLOPs of one real training pass of the patched model (`reference._measure`);
    `lora`: PEFT `LoraConfig` arguments, the adapters added first and Liger applied to the base model under them,
    as transformers' `apply_liger_kernel` does (`unwrap_peft_model`)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before starting this script")
    import torch
    import transformers.masking_utils as masking_utils
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.graphs.reference import _measure

    _interpreter_shims()
    torch.manual_seed(0)
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # as run_reference: no packed mask
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=getattr(torch, dtype),
                                             attn_implementation=attention)
    model.train()
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora, task_type="CAUSAL_LM"), autocast_adapter_dtype=False)
    base = model.get_base_model() if lora is not None else model
    _apply_liger_kernel_to_instance(model=base, fused_linear_cross_entropy=False, **kernels)
    return dataclasses.asdict(_measure(model, config.num_hidden_layers, b=b, s=s, vocab=config.vocab_size))


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(run(request["values"], b=request["b"], s=request["s"], dtype=request["dtype"],
                         attention=request["attention"],
                         kernels=request["kernels"], lora=request.get("lora"))))
