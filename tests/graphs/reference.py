"""An independent reference for lowering tests: one direct fake-tensor training pass of the whole model.

It uses only torch's own accounting: `saved_tensors_hooks` (storages deduplicated, attributed to the first
decoder layer that saves them) and `FlopCounterMode` (with formulas for the kernels it counts as 0).
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.flop_counter as flop_counter
import transformers.masking_utils as masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig, AutoModelForCausalLM

aten = torch.ops.aten


def _flash_fwd(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(q, k, v)


def _flash_bwd(go: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(go, q, k, v)


def _grouped(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    raise NotImplementedError((a, b))


# FlopCounterMode wraps custom formulas with `shape_wrapper` itself.
CUSTOM = {
    aten._scaled_dot_product_flash_attention_for_cpu: _flash_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_bwd,
    aten._grouped_mm: _grouped,
}


@dataclass
class Reference:
    layer_saved: list[int]
    layer_forward_flops: list[int]
    total_saved: int
    forward_flops: int
    backward_flops: int
    param_layers: list[int]
    param_total: int


def write_config(tmp: Path, values: dict[str, Any]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(values))
    return tmp


def run_reference(values: dict[str, Any], *, b: int, s: int, dtype: torch.dtype, checkpoint: bool,
                  attention: str | None = None) -> Reference:
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # else a (b,1,s,s) mask appears
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            kwargs: dict[str, Any] = {"dtype": dtype}
            if attention:
                kwargs["attn_implementation"] = attention
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)
            model.train()
            if checkpoint:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return _measure(model, config.num_hidden_layers, b=b, s=s, vocab=config.vocab_size)
    finally:
        masking_utils.find_packed_sequence_indices = original


def _measure(model: torch.nn.Module, num_layers: int, *, b: int, s: int, vocab: int) -> Reference:
    layers_name, layers = next((n, m) for n, m in model.named_modules()
                               if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers)
    existing = {p.untyped_storage()._cdata for p in model.parameters()}
    existing |= {t.untyped_storage()._cdata for t in model.buffers()}
    ids = torch.randint(0, vocab, (b, s))
    labels = torch.randint(0, vocab, (b, s))
    existing |= {ids.untyped_storage()._cdata, labels.untyped_storage()._cdata}
    stack = ["outside"]
    owner: dict[int, str] = {}
    nbytes: dict[int, int] = {}
    keep = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in existing and st._cdata not in owner:
            owner[st._cdata], nbytes[st._cdata] = stack[-1], st.nbytes()
            keep.append(st)
        return t

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: stack.append(f"layer{i}")))
        handles.append(layer.register_forward_hook(lambda m, a, o: stack.pop() and None))
    # FlopCounterMode attributes forward ops to modules reliably but not backward ops, so per-layer FLOPs
    # come from a forward-only counter and backward is compared in total.
    forward_counter = flop_counter.FlopCounterMode(display=False, depth=None, custom_mapping=CUSTOM)
    with forward_counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    backward_counter = flop_counter.FlopCounterMode(display=False, depth=None, custom_mapping=CUSTOM)
    with backward_counter:
        loss.backward()
    for h in handles:
        h.remove()
    counts = {k: sum(v.values()) for k, v in forward_counter.get_flop_counts().items()}
    root = type(model).__name__
    layer_saved = [sum(n for k, n in nbytes.items() if owner[k] == f"layer{i}") for i in range(num_layers)]
    layer_flops = [counts.get(f"{root}.{layers_name}.{i}", 0) for i in range(num_layers)]
    backward_total = sum(sum(v.values()) for k, v in backward_counter.get_flop_counts().items() if k == "Global")
    params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return Reference(layer_saved=layer_saved, layer_forward_flops=layer_flops, total_saved=sum(nbytes.values()),
                     forward_flops=counts.get("Global", 0), backward_flops=backward_total, param_layers=params,
                     param_total=sum(p.numel() for p in model.parameters()))


@contextlib.contextmanager
def no_cache(monkeypatch: Any, tmp: Path) -> Any:
    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp))
    yield
