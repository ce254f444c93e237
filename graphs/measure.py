"""Measure a model: build it on meta, trace representative layers on fake tensors at the probe shapes, fit.

The result (`Study`) is what `lower.assemble` maps onto the full graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .adapters import LoraSpec
from .errors import MalformedConfig, UnsupportedModel
from .fake import build_model, to_fake
from .fit import Probes, model_wide_bytes, segment_costs
from .graph import ModelDims
from .layer import Checkpoint, ModeCost, MoE, ParamTensor
from .lora import apply_lora
from .poly import Poly
from .probe import TraceSlot, build_trace_model, run_pass, trace_slots
from .sources import ResolvedModel
from .structure import ModelParts, find_parts, layer_kinds, param_tensors, tp_style

_ROWWISE = {"rowwise", "rowwise_split_input", "local_rowwise"}
# TP plan styles whose activations split cleanly per rank (no gathered outputs inside the block).
_CLEAN_STYLES = {"colwise", "rowwise", "packed_colwise", "local_colwise", "local_rowwise", "moe_tp_experts",
                 "replicated_with_grad_allreduce", "replicate", "mla_kv_a_proj"}


@dataclass(slots=True, kw_only=True)
class Study:
    """Everything measured about one model at one dtype / attention / LoRA setting."""

    architecture: str
    layer_class: str
    attention: str
    dims: ModelDims
    itemsize: int
    params: list[ParamTensor]
    kinds: list[int]
    slot_scopes: dict[tuple[int, Checkpoint], str]
    costs: dict[str, ModeCost]
    rowwise_modules: list[int]
    moe: dict[int, MoE]
    model_wide: dict[str, Poly]
    widened: bool
    tp_degrees: tuple[int, ...]
    versions: tuple[tuple[str, str], ...]


def transformers_config(resolved: ResolvedModel) -> Any:
    """Build the transformers config from config.json values (never with remote code)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from .sources import check_architecture

    values = resolved.as_dict()
    check_architecture(values, resolved.location)
    model_type = values.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **values)
    # transformers 5 validates configs as huggingface_hub strict dataclasses, whose errors are not ValueErrors.
    except (TypeError, ValueError, StrictDataclassError) as err:
        raise MalformedConfig(f"{resolved.location}: transformers rejects this {model_type} config: {err}",
                              "Fix the named field in the config file.") from err


def study(config: Any, *, dtype: str, autocast: str | None, attention: str | None, lora: LoraSpec | None,
          b0: int, s0: int, widen: int, op_selective: bool = False, compiled: bool = False,
          liger: bool = False, kbit: tuple[str, ...] | None = None) -> Study:
    """`liger`: the model as transformers' `use_liger_kernel` patches it (`liger.py`); `kbit`: the 4-bit base as
    PEFT's `prepare_model_for_kbit_training` leaves it, with the named modules cast back (`kbit.py`)."""
    with contextlib.ExitStack() as patches:
        return _study(config, dtype=dtype, autocast=autocast, attention=attention, lora=lora, b0=b0, s0=s0,
                      widen=widen, op_selective=op_selective, compiled=compiled,
                      patch=patches.enter_context if liger else None, kbit=kbit)


def _study(config: Any, *, dtype: str, autocast: str | None, attention: str | None, lora: LoraSpec | None,
           b0: int, s0: int, widen: int, op_selective: bool, compiled: bool, patch: Any,
           kbit: tuple[str, ...] | None) -> Study:
    from .assemble import dims_of, widened_config

    dims = dims_of(config)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    wide = _parts(config, dtype=dtype, autocast=autocast, attention=attention, lora=lora, layers=dims.layers,
                  patch=patch, kbit=kbit)
    kinds = layer_kinds(wide)
    layer_class = type(wide.layers[0]).__name__
    plan = dict(getattr(wide.model, "_tp_plan", None) or {})
    params = _quantized_sizes(param_tensors(wide.model, _owners(wide), plan), wide, lora)
    rowwise = [_count_rowwise(wide, i, plan) for i in range(dims.layers)]
    moe = _moe(wide, kinds, dims)
    slots = trace_slots(kinds, selective=True, op_selective=op_selective)
    trace = build_trace_model(wide, kinds, slots)
    run = _runner(trace, slots, dims.vocab, fake, autocast, lora, compiled)
    probes = Probes(run(b0, s0), run(b0, 2 * s0), run(b0, 3 * s0), run(2 * b0, s0), None)
    tp_degrees = _tp_degrees(params, dims)
    if _clean(plan) and len(tp_degrees) > 1:
        widened = _parts(widened_config(config, widen), dtype=dtype, autocast=autocast, attention=attention,
                         lora=lora, layers=dims.layers, patch=patch, kbit=kbit)
        if _matches_widening(widened, wide_params=params, factor=widen):
            widened_trace = build_trace_model(widened, kinds, slots)
            probes = Probes(probes.base, probes.longer, probes.longest, probes.wider,
                            _runner(widened_trace, slots, dims.vocab, fake, autocast, lora, compiled)(b0, s0))
    if probes.widened is None:  # no measured 1/TP split: TP > 1 would be priced as if nothing were divided
        tp_degrees = (1,)
    costs = segment_costs(probes)
    _rename_dynamic(params, probes.base)
    slot_scopes = {(slot.kind, slot.mode): f"layers.{j}" for j, slot in enumerate(slots) if slot.kind is not None}
    slot_scopes = {key: scope for key, scope in slot_scopes.items()
                   if key[1] is not Checkpoint.SELECTIVE or costs[scope].recompute.flops}
    return Study(architecture=type(wide.model).__name__, layer_class=layer_class,
                 attention=wide.model.config._attn_implementation,
                 dims=dims, itemsize=torch.finfo(next(wide.model.parameters()).dtype).bits // 8, params=params,
                 kinds=kinds, slot_scopes=slot_scopes, costs=costs, rowwise_modules=rowwise, moe=moe,
                 model_wide=model_wide_bytes(probes), widened=probes.widened is not None, tp_degrees=tp_degrees,
                 versions=_versions(liger=patch is not None))


def _parts(config: Any, *, dtype: str, autocast: str | None, attention: str | None, lora: LoraSpec | None,
           layers: int, patch: Any = None, kbit: tuple[str, ...] | None = None) -> ModelParts:
    """The model to trace; `patch` (an ExitStack's enter_context) keeps Liger's patch on it while the study runs."""
    model = build_model(config, dtype=dtype, attention=attention)
    if lora is not None and lora.quantization is not None:
        from .quantization import quantize_linears

        quantize_linears(model, lora.quantization, double_quant=lora.double_quant)
        if kbit is not None:
            from .kbit import prepare_for_kbit

            prepare_for_kbit(model, kbit)
    if lora is not None:
        model = apply_lora(model, lora, autocast=autocast is not None)
    if patch is not None:
        from .liger import liger_kernels

        patch(liger_kernels(model))
    return find_parts(model, layers)


def _quantized_sizes(params: list[ParamTensor], parts: ModelParts, lora: LoraSpec | None) -> list[ParamTensor]:
    """Quantized base weights get bitsandbytes' stored bytes (packed data and quantisation state)."""
    if lora is None or lora.quantization is None:
        return params
    from .quantization import quantized_weight_names, stored_bytes

    names = set(quantized_weight_names(parts.model))
    return [replace(p, stored_bytes=stored_bytes(p.shape, lora.quantization, double_quant=lora.double_quant))
            if p.name in names else p for p in params]


def _runner(parts: ModelParts, slots: list[TraceSlot], vocab: int, fake: FakeTensorMode,
            autocast: str | None, lora: LoraSpec | None, compiled: bool = False) -> Any:
    to_fake(parts.model, fake)
    if lora is not None and lora.quantization is not None:
        from .quantization import pack

        pack(parts.model, fake, lora.quantization, double_quant=lora.double_quant)

    def run(b: int, s: int) -> Any:
        try:
            with fake:
                return run_pass(parts, slots, b=b, s=s, vocab=vocab, autocast=autocast, lora=lora,
                                compiled=compiled)
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
            raise UnsupportedModel(f"{type(parts.model).__name__} could not be traced on fake tensors: {err}",
                                   "Try --attention eager, or report the architecture.") from err
    return run


def _owners(parts: ModelParts) -> dict[str, str]:
    """Parameter-name prefixes to graph nodes; base-model children are resolved after tracing."""
    owners = {f"{parts.layers_path}.{i}": f"layers.{i}" for i in range(len(parts.layers))}
    for name, child in parts.base.named_children():
        if child is not parts.layers:
            owners[f"{parts.base_path}.{name}"] = f"child:{name}"
    head_name = next(name for name, module in parts.model.named_modules() if module is parts.head)
    owners[head_name] = "head"
    return owners


def _rename_dynamic(params: list[ParamTensor], recording: Any) -> None:
    """Base-model children are "embed" or "norm" depending on whether they ran before the decoder layers."""
    names = recording.dynamic_scopes
    for i, p in enumerate(params):
        if p.node.startswith("child:"):
            node = names.get(p.node.removeprefix("child:"), "embed")
            params[i] = ParamTensor(**{**{k: getattr(p, k) for k in p.__slots__}, "node": node})


def _count_rowwise(parts: ModelParts, index: int, plan: dict[str, str]) -> int:
    """Row-wise modules of layer `index`, each once: PEFT's wrapper and its `base_layer` are one module of the
    plan (counting both doubled LoRA's TP all-reduces). A row-parallel LoRA A adds an all-reduce of only
    rank-sized outputs (PEFT `LoraParallelLinear`), left out."""
    prefix = f"{parts.layers_path}.{index}"
    names = {f"{prefix}.{name}".replace(".base_layer", "") for name, _ in parts.layers[index].named_modules() if name}
    return sum(1 for name in names if tp_style(name, plan) in _ROWWISE)


def _moe(parts: ModelParts, kinds: list[int], dims: ModelDims) -> dict[int, MoE]:
    return dims.moe_by_kind({kind: sum(p.numel() for name, p in parts.layers[kinds.index(kind)].named_parameters()
                                       if ".experts." in f".{name}") for kind in set(kinds)})


def _clean(plan: dict[str, str]) -> bool:
    layer_styles = {style for pattern, style in plan.items() if "layers" in pattern or ".h." in pattern}
    return bool(layer_styles) and layer_styles <= _CLEAN_STYLES


def _tp_degrees(params: list[ParamTensor], dims: ModelDims) -> tuple[int, ...]:
    if not any(p.tp_dim is not None and p.node.startswith("layers.") for p in params):
        return (1,)
    return tuple(t for t in (1, 2, 4, 8, 16, 32, 64) if dims.heads % t == 0 and dims.kv_heads % t == 0)


def _matches_widening(widened: ModelParts, *, wide_params: list[ParamTensor], factor: int) -> bool:
    """The widened model stands for TP rank 1/factor iff exactly the TP-sharded decoder tensors grew."""
    expected = {p.name: p.numel * (factor if p.tp_dim is not None else 1)
                for p in wide_params if p.node.startswith("layers.")}
    got = {name: p.numel() for name, p in widened.model.named_parameters() if name in expected}
    return got.keys() == expected.keys() and all(got[name] == expected[name] for name in got)


def _versions(*, liger: bool = False) -> tuple[tuple[str, str], ...]:
    """The traced libraries' versions; liger-kernel's only where its code was traced (`LayerGraph.liger`)."""
    found = []
    for package in ("fitplan", "torch", "transformers", "peft") + (("liger-kernel",) if liger else ()):
        try:
            found.append((package, version(package)))
        except PackageNotFoundError:
            found.append((package, "unknown"))
    return tuple(found)
