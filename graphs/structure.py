"""Find a causal LM's parts (decoder layers, base model, LM head), group identical layers into kinds, and
describe every parameter tensor with its owner and tensor-parallel style.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

import torch

from .errors import UnsupportedModel
from .layer import ParamTensor

# Module attributes that differ between layers without changing what a layer computes.
_IGNORED_ATTRIBUTES = {"layer_idx", "training", "layer_id", "idx", "block_idx", "_fitplan_selective"}


@dataclass(frozen=True, slots=True)
class ModelParts:
    """Where the pieces of a transformers causal LM live."""

    model: torch.nn.Module
    layers_path: str
    base_path: str
    layers: torch.nn.ModuleList
    base: torch.nn.Module
    head: torch.nn.Module


def find_parts(model: torch.nn.Module, num_layers: int) -> ModelParts:
    """Locate the decoder-layer list (the ModuleList of `num_layers` blocks), its parent and the LM head."""
    candidates = [(name, module) for name, module in model.named_modules()
                  if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers and name]
    if not candidates:
        raise UnsupportedModel(f"{type(model).__name__} has no list of {num_layers} decoder layers",
                               "fitplan lowers decoder-only causal LMs whose blocks sit in one ModuleList.")
    layers_path, layers = min(candidates, key=lambda item: item[0].count("."))
    base_path = layers_path.rpartition(".")[0]
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModel(f"{type(model).__name__} has no output embedding (LM head)",
                               "fitplan lowers causal language models with an LM head.")
    return ModelParts(model, layers_path, base_path, layers, model.get_submodule(base_path), head)


def layer_signature(layer: torch.nn.Module) -> tuple[Any, ...]:
    """A hashable description of what a layer computes: module types, parameter shapes and scalar settings."""
    parts: list[Any] = []
    for name, module in layer.named_modules():
        settings = tuple(sorted((key, value) for key, value in vars(module).items()
                                if not key.startswith("_") and key not in _IGNORED_ATTRIBUTES
                                and isinstance(value, (int, float, str, bool, type(None)))))
        parts.append((name, type(module).__name__, settings))
    parts.extend((name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in layer.named_parameters())
    return tuple(parts)


def layer_kinds(parts: ModelParts) -> list[int]:
    """For each decoder layer, the index of its kind (kinds numbered in order of first appearance)."""
    seen: dict[tuple[Any, ...], int] = {}
    return [seen.setdefault(layer_signature(layer), len(seen)) for layer in parts.layers]


def tp_style(fqn: str, plan: dict[str, str]) -> str:
    """The tensor-parallel style of a module from the model's `_tp_plan` (wildcards `*`), or "replicate"."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(fqn, pattern.replace("*", "[0-9]*")):
            return style
    return "replicate"


# How each style in transformers' TP plans splits a parameter: the dimension sharded across ranks
# (None = replicated). Row-wise biases stay replicated. Source: transformers 5.24 `integrations/tensor_parallel.py`.
_SHARD_DIM = {
    "colwise": {"weight": 0, "bias": 0},
    "colwise_gather_output": {"weight": 0, "bias": 0},
    "packed_colwise": {"weight": 0, "bias": 0},
    "local_colwise": {"weight": 0, "bias": 0},
    "rowwise": {"weight": 1},
    "rowwise_split_input": {"weight": 1},
    "local_rowwise": {"weight": 1},
    "embedding_rowwise": {"weight": 0},
}


def shard_dim(style: str, param_name: str, shape: tuple[int, ...]) -> int | None:
    """The dimension TP shards, counted from the end for 3-D expert tensors (experts stay whole)."""
    leaf = param_name.rpartition(".")[2]
    dim = _SHARD_DIM.get(style, {}).get("bias" if leaf == "bias" else "weight")
    if dim is None or not shape:
        return None
    if len(shape) == 3:  # fused experts (experts, out, in): column-wise splits `out`, row-wise splits `in`
        return dim + 1
    return min(dim, len(shape) - 1)


_LORA = re.compile(r"(?P<base>.+)\.lora_(?P<matrix>[AB])\.[^.]+\.weight")


def lora_style(base_style: str, matrix: str) -> str:
    """How TP splits a LoRA matrix, following its base layer as PEFT's `LoraParallelLinear` does
    (peft/tuners/lora/tp_layer.py): a column-parallel base gets a column-parallel B (A replicated), a
    row-parallel base a row-parallel A (B replicated), so the adapter's output is split like the base's."""
    column = _SHARD_DIM.get(base_style, {}).get("weight") == 0 and base_style != "embedding_rowwise"
    row = _SHARD_DIM.get(base_style, {}).get("weight") == 1
    if column and matrix == "B":
        return "colwise"
    if row and matrix == "A":
        return "rowwise"
    return "replicate"


def param_tensors(model: torch.nn.Module, owner_of: dict[str, str], plan: dict[str, str]
                  ) -> list[ParamTensor]:
    """Every parameter tensor once (tied weights on their first owner), with owner node and TP split."""
    seen: dict[int, str] = {}
    tensors: list[ParamTensor] = []
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen[id(param)] = fqn
        plain = fqn.replace(".base_layer", "")  # PEFT wraps adapted modules; the plan names the originals
        style = tp_style(plain, plan)  # fused expert tensors are named in the plan directly
        if style == "replicate":
            style = tp_style(plain.rpartition(".")[0], plan)
        if style == "moe_tp_experts":
            style = "replicate"
        adapter = _LORA.fullmatch(plain)
        if adapter is not None:
            style = lora_style(tp_style(adapter["base"], plan), adapter["matrix"])
        shape = tuple(int(d) for d in param.shape)
        tensors.append(ParamTensor(name=fqn, node=_owner(fqn, owner_of), shape=shape,
                                   trainable=param.requires_grad, itemsize=param.element_size(),
                                   tp_style=style, tp_dim=shard_dim(style, fqn, shape)))
    return tensors


def _owner(fqn: str, owner_of: dict[str, str]) -> str:
    best = ""
    for prefix in owner_of:
        if (fqn == prefix or fqn.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return owner_of.get(best, "embed")


def tied_parameters(model: torch.nn.Module) -> list[tuple[str, str]]:
    """Pairs (alias, owner) of parameter names that share one tensor."""
    seen: dict[int, str] = {}
    ties = []
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            ties.append((fqn, seen[id(param)]))
        else:
            seen[id(param)] = fqn
    return ties
