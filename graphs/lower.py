"""`lower(model)`: resolve a model name and measure its layer graph on fake tensors (cached on disk).

Probes trace a few representative layers at four shapes (see `fit.py`); every decoder layer of a kind gets the
costs of its kind's trace layers. Nothing is allocated and nothing is downloaded.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from .cache import cache_key, load_cached, store_cached
from .errors import UnsupportedModel
from .graph import LayerGraph, ModelDims, chain_graph
from .layer import Checkpoint, Layer, ModeCost, ParamTensor, Role
from .lora import LoraSpec
from .poly import Poly
from .sources import ResolvedModel, resolve

# Probe shapes: (b0, s0), (b0, 2*s0), (2*b0, s0). Small shapes trace as fast as large ones and are exact
# because every size is a monomial in b and s (checked when fitting).
PROBE_BATCH = 2
PROBE_SEQ = 32
WIDEN_FACTOR = 2


def lower(model: str, *, dtype: str = "bfloat16", autocast: str | None = None, attention: str | None = None,
          lora: LoraSpec | None = None, use_cache: bool = True, op_selective: bool = False,
          runtime: str = "hf", compiled: bool = False, liger: bool = False) -> LayerGraph:
    """Lower `model` (catalog id, local path or cached Hub id) to its `LayerGraph`.

    `dtype` is the parameter dtype; `autocast` ("bfloat16"/"float16") runs forward under torch.autocast, as
    plain PyTorch mixed precision does with fp32 weights. `op_selective` also traces op-level SAC
    (`Checkpoint.OP_SELECTIVE`, torchtitan's policy as the generated torchrun script would pass it).
    `runtime` is the code that will run the plan: "hf" (transformers) or "torchtitan" (`titan.py`). `compiled`
    traces the un-checkpointed layers as torch.compile trains them (`compiled.py`: Inductor's partitioner decides
    what they save). `liger` traces the model as transformers' `use_liger_kernel` patches it (`liger.py`: Liger's
    RMSNorm, SwiGLU and RoPE kernels in the layers; the head keeps HF's loss, which costmodels replaces).
    """
    if runtime == "torchtitan":
        if liger:
            raise ValueError("liger=True patches the transformers modeling code, not torchtitan's")
        return _lower_titan(model, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                            use_cache=use_cache)
    if runtime != "hf":
        raise ValueError(f"runtime={runtime!r} must be 'hf' or 'torchtitan'")
    resolved = resolve(model)
    return lower_resolved(resolved, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                          use_cache=use_cache, op_selective=op_selective, compiled=compiled, liger=liger)


def _lower_titan(model: str, *, dtype: str, autocast: str | None, attention: str | None, lora: LoraSpec | None,
                 use_cache: bool) -> LayerGraph:
    """torchtitan's model code: its own attention and checkpoint modes, FSDP2 mixed precision (no autocast)."""
    from .titan import lower_titan

    if lora is not None or autocast is not None or attention is not None:
        raise UnsupportedModel("torchtitan runs its own attention, without LoRA or torch.autocast",
                               "Drop --lora-rank / --attention, or plan for another launcher.")
    return lower_titan(model, dtype=dtype, use_cache=use_cache)


@functools.lru_cache(maxsize=64)
def lower_resolved(resolved: ResolvedModel, *, dtype: str = "bfloat16", autocast: str | None = None,
                   attention: str | None = None, lora: LoraSpec | None = None, use_cache: bool = True,
                   op_selective: bool = False, compiled: bool = False, liger: bool = False) -> LayerGraph:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
    if autocast not in (None, "bfloat16", "float16"):
        raise ValueError(f"autocast={autocast!r} must be None, bfloat16 or float16")
    if liger and compiled:
        raise ValueError("liger=True with compiled=True: torch.compile over Liger's Triton kernels is not traced")
    key = cache_key(resolved.as_dict(), dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                    probes=(PROBE_BATCH, PROBE_SEQ, WIDEN_FACTOR) + ((1,) if op_selective else ()),
                    variants=("compiled",) if compiled else ("liger",) if liger else ())
    if use_cache and (cached := load_cached(key)) is not None:
        return cached
    graph = _measure(resolved, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                     op_selective=op_selective, compiled=compiled, liger=liger)
    if compiled:
        graph = eager_work(graph, lower_resolved(resolved, dtype=dtype, autocast=autocast, attention=attention,
                                                 lora=lora, use_cache=use_cache, op_selective=op_selective))
    if use_cache:
        store_cached(key, graph)
    return graph


def _measure(resolved: ResolvedModel, *, dtype: str, autocast: str | None, attention: str | None,
             lora: LoraSpec | None, op_selective: bool = False, compiled: bool = False,
             liger: bool = False) -> LayerGraph:
    from . import measure

    config = measure.transformers_config(resolved)
    options = {"dtype": dtype, "autocast": autocast, "attention": attention, "lora": lora, "b0": PROBE_BATCH,
               "s0": PROBE_SEQ, "widen": WIDEN_FACTOR, "compiled": compiled, "liger": liger}
    try:
        study = measure.study(config, **options, op_selective=op_selective)
    except UnsupportedModel as err:
        if not (op_selective and _sac_refused(err)):
            raise
        # torch's SAC refuses to run a model that changes in place a tensor the policy keeps (Mixtral's router
        # divides its kept topk output), so op-level SAC cannot run it: the graph goes without that mode.
        study = measure.study(config, **options, op_selective=False)
    return assemble(resolved, study, dtype=dtype, autocast=autocast, lora=lora)


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


def _sac_refused(err: Exception) -> bool:
    """torch.utils.checkpoint's error for a tensor cached by selective checkpointing and then mutated."""
    return "cached during selective activation checkpoint has been mutated" in str(err.__cause__)


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
        graph=chain_graph(nodes))


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


__all__ = ["lower", "widened_config"]
