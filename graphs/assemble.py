"""A layer graph assembled from a study of the model's trace layers: every real layer gets its kind's measured
costs (`assemble`), the architecture numbers of a transformers config (`dims_of`), the widened config whose trace
splits costs into replicated and TP-sharded parts (`widened_config`), and compiled memory with eager work
(`eager_work`). Shared by the HF, torchtitan and Megatron lowerings."""

from __future__ import annotations

import copy
from typing import Any

from .adapters import LoraSpec
from .graph import LayerGraph, ModelDims
from .layer import Checkpoint, Layer, ModeCost, ParamTensor, Role
from .poly import Poly
from .sources import ResolvedModel


def eager_work(compiled: LayerGraph, eager: LayerGraph) -> LayerGraph:
    """A compiled lowering's memory with the eager trace's work (FLOPs, bytes moved, kernels). Inductor fuses the
    pointwise ops its partitioner recomputes in backward, which the unfused ATen graph would count as more kernels
    and traffic; the time model prices compiled work as the eager work fused (costmodels/compilation.py)."""
    data, work = compiled.to_json(), eager.to_json()["kind_modes"]
    for kind, modes in data["kind_modes"].items():
        for mode, cost in modes.items():
            for field in ("forward", "backward", "recompute"):
                cost[field] = work[kind][mode][field]
    return LayerGraph.from_json(data)


def assemble(resolved: ResolvedModel, study: Any, *, dtype: str, autocast: str | None,
             lora: LoraSpec | None) -> LayerGraph:
    """Build the full graph: the measured trace scopes mapped onto every real layer."""
    params_by_node: dict[str, list[ParamTensor]] = {}
    for tensor in study.params:
        params_by_node.setdefault(tensor.node, []).append(tensor)
    boundary = Poly.of({(1, 1, 0): study.dims.hidden * study.itemsize})
    nodes: list[Layer] = []

    def add(name: str, role: Role, cost: ModeCost | None, **extra: Any) -> None:
        if cost is None and not params_by_node.get(name):
            return
        nodes.append(Layer(name=name, role=role, params=tuple(params_by_node.get(name, ())),
                           modes=((Checkpoint.NONE, cost or ModeCost()),), boundary=boundary, **extra))

    add("embed", Role.EMBEDDING, study.costs.get("embed"))
    for index, kind in enumerate(study.kinds):
        name = f"layers.{index}"
        modes = tuple((mode, study.costs[scope]) for (k, mode), scope in study.slot_scopes.items() if k == kind)
        nodes.append(Layer(name=name, role=Role.DECODER, index=index, kind=kind,
                           params=tuple(params_by_node.get(name, ())), modes=modes, boundary=boundary,
                           tp_allreduces=study.rowwise_modules[index], moe=study.moe.get(kind)))
    add("norm", Role.NORM, study.costs.get("norm"))
    add("head", Role.HEAD, study.costs.get("head"))
    nodes.append(Layer(name="loss", role=Role.LOSS, modes=((Checkpoint.NONE, study.costs["loss"]),)))
    return LayerGraph(
        model=resolved.id, source=resolved.source, model_type=resolved.model_type,
        architecture=study.architecture, layer_class=study.layer_class, dtype=dtype, autocast=autocast,
        attention=study.attention, lora=lora,
        dims=study.dims,
        inputs=study.model_wide["inputs"], shared=study.model_wide["shared"],
        checkpoint_shared=study.model_wide["checkpoint_shared"], forward_shared=study.model_wide["forward_shared"],
        tp_splits_activations=study.widened,
        tp_degrees=study.tp_degrees, published_params=_published(resolved), versions=study.versions,
        layers=tuple(nodes))


def _published(resolved: ResolvedModel) -> int | None:
    if resolved.source != "catalog":
        return None
    from .catalog import load_entry

    entry = load_entry(resolved.id)
    return entry.published_params if entry.published_params_exact else None


def dims_of(config: Any) -> ModelDims:
    """Architecture numbers from a transformers config (text part for multimodal wrappers)."""
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or \
        getattr(text, "n_routed_experts", None) or 0
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "num_experts_per_token", None) or 0
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "ffn_dim", None) or \
        getattr(text, "n_inner", None) or 4 * hidden
    return ModelDims(hidden=hidden, layers=int(text.num_hidden_layers), heads=heads,
                     kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                     head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
                     vocab=int(text.vocab_size), intermediate=int(intermediate), experts=int(experts),
                     top_k=int(top_k))


def widened_config(config: Any, factor: int) -> Any:
    """The config with `factor` times the heads and FFN widths and the same head size: the model one TP rank
    would hold at t = 1/factor. Measuring it splits each cost into a replicated and a TP-sharded part."""
    wide = copy.deepcopy(config)
    text = wide.get_text_config()
    text.head_dim = dims_of(config).head_dim
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "ffn_dim"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value:
            setattr(text, name, value * factor)
    return wide
