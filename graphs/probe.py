"""Run one fake training pass (forward + backward) of a trace model at a probe shape and record it.

A trace model keeps the real model's embedding, final norm and head, but replaces its decoder stack by a few
representative layers: a leading "dummy" layer (absorbs what only the first real layer does, such as releasing
the shared rotary tables) and, for each layer kind, one layer per checkpoint mode.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch

from .adapters import LoraSpec
from .compiled import compile_forward
from .fake import full_checkpoint_function, quirks
from .layer import Checkpoint
from .lora import adapter_tracing
from .recorder import OpRecord, Recorder, ScopeTracker, StorageRecord
from .sac import SacRecorder, op_sac_context_fn
from .structure import ModelParts


@dataclass(frozen=True, slots=True)
class TraceSlot:
    """Which real layer kind and checkpoint mode a trace-model layer stands for (kind None = dummy)."""

    kind: int | None
    mode: Checkpoint


@dataclass(slots=True)
class Recording:
    """Everything one probe pass recorded."""

    b: int
    s: int
    ops: list[OpRecord]
    storages: list[StorageRecord]
    global_storages: dict[int, str]
    """Storages that outlive their segment for model-wide reasons, by lifetime (`MODEL_WIDE`)."""
    dynamic_scopes: dict[str, str]
    """Base-model children (by attribute name) and the scope they ran in: "embed" or "norm"."""


def trace_slots(kinds: list[int], selective: bool, op_selective: bool = False) -> list[TraceSlot]:
    modes = [Checkpoint.NONE, Checkpoint.FULL] + ([Checkpoint.SELECTIVE] if selective else [])
    modes += [Checkpoint.OP_SELECTIVE] if op_selective else []
    slots = [TraceSlot(None, Checkpoint.NONE)]
    for kind in sorted(set(kinds)):
        slots.extend(TraceSlot(kind, mode) for mode in modes)
    return slots


def build_trace_model(parts: ModelParts, kinds: list[int], slots: list[TraceSlot]) -> ModelParts:
    """Swap the decoder stack of `parts.model` for one layer per slot (call under the same FakeTensorMode)."""
    first_of_kind = {kind: kinds.index(kind) for kind in set(kinds)}
    used: set[int] = set()
    layers, indices = [], []
    for slot in slots:
        kind = kinds[0] if slot.kind is None else slot.kind
        candidates = [i for i, k in enumerate(kinds) if k == kind and i not in used]
        index = candidates[0] if candidates else first_of_kind[kind]
        layer = parts.layers[index] if index not in used else copy.deepcopy(parts.layers[index])
        used.add(index)
        layers.append(layer)
        indices.append(index)
    stack = torch.nn.ModuleList(layers)
    parent_path, _, attribute = parts.layers_path.rpartition(".")
    setattr(parts.model.get_submodule(parent_path), attribute, stack)
    for config in {id(c): c for c in (parts.model.config, parts.model.config.get_text_config())}.values():
        config.num_hidden_layers = len(stack)
        # Some models look masks up by position (`config.layer_types[i]`): keep each trace layer's own type.
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = [config.layer_types[i] for i in indices]
    return ModelParts(parts.model, parts.layers_path, parts.base_path, stack, parts.base, parts.head)


def run_pass(parts: ModelParts, slots: list[TraceSlot], *, b: int, s: int, vocab: int,
             autocast: str | None = None, lora: LoraSpec | None = None, compiled: bool = False) -> Recording:
    """Record a forward and backward pass of the trace model at micro-batch b and sequence length s.

    `lora`: the adapters the model carries; bitsandbytes 4-bit bases and DoRA are traced as they run in training
    (`lora.adapter_tracing`). `compiled`: layers without checkpointing run as torch.compile trains them
    (`compiled.compile_forward`); checkpointed ones save their inputs either way.
    """
    for param in parts.model.parameters():
        param.grad = None
    recorder = SacRecorder([*parts.model.parameters(), *parts.model.buffers()])
    _set_modes(parts, slots, recorder)
    if compiled:
        for layer, slot in zip(parts.layers, slots, strict=True):
            if slot.mode is Checkpoint.NONE and not getattr(layer, "_fitplan_compiled", False):
                compile_forward(layer)
                layer._fitplan_compiled = True
    scopes: dict[torch.nn.Module, str] = {layer: f"layers.{i}" for i, layer in enumerate(parts.layers)}
    scopes[parts.head] = "head"
    dynamic = {child for child in parts.base.children() if child is not parts.layers}
    tracker = ScopeTracker(recorder, scopes, dynamic=dynamic, head=parts.head)
    boundary: list[int | None] = []

    def note_boundary(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not boundary and isinstance(hidden, torch.Tensor):
            boundary.append(recorder.storage_index(hidden))

    handle = parts.layers[0].register_forward_pre_hook(note_boundary, with_kwargs=True)
    with quirks(recorder.recomputing), recorder, adapter_tracing(lora):
        ids = torch.randint(0, vocab, (b, s))
        labels = torch.randint(0, vocab, (b, s))
        with tracker.active():
            with recorder.saving(), _autocast(autocast):
                loss = parts.model(input_ids=ids, labels=labels, use_cache=False).loss
            tracker.enter_backward()
            loss.backward()
        del loss, ids, labels
    handle.remove()
    recorder.mark_grads(parts.model.parameters())
    lifetimes = model_wide(recorder, slots, boundary[0] if boundary else None)
    names = {name: tracker.dynamic_names[id(child)] for name, child in parts.base.named_children()
             if id(child) in tracker.dynamic_names}
    return Recording(b, s, recorder.ops, recorder.storages, lifetimes, names)


# Lifetimes of model-wide tensors (made before the layers and read by them, or saved by several layers):
# "inputs" (token ids, labels) and "shared" live through the whole pass; "checkpoint_shared" too, when some
# layer is checkpointed (the recompute needs them), else like "forward_shared", which goes once forward ends.
MODEL_WIDE = ("inputs", "shared", "checkpoint_shared", "forward_shared")


def model_wide(recorder: Recorder, slots: list[TraceSlot], boundary: int | None) -> dict[int, str]:
    """Classify the storages whose lifetime is set by the whole model, not by the node that made them."""
    mode_of = {f"layers.{j}": slot.mode for j, slot in enumerate(slots)}
    result = {}
    for i, st in enumerate(recorder.storages):
        scope = recorder.ops[st.alloc_op].scope
        if scope == "inputs":
            result[i] = "inputs"
        elif len(st.savers) > 1 or (scope == "embed" and st.read_by_layer and i != boundary):
            modes = {mode_of.get(saver, Checkpoint.NONE) for saver in st.savers}
            if Checkpoint.NONE in modes:
                result[i] = "shared"
            else:
                result[i] = "checkpoint_shared" if modes else "forward_shared"
    return result


def _autocast(dtype: str | None) -> contextlib.AbstractContextManager[None]:
    """Forward under torch.autocast, as plain PyTorch mixed precision runs it (CPU op lists; see lower)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, dtype))


def _set_modes(parts: ModelParts, slots: list[TraceSlot], recorder: SacRecorder) -> None:
    checkpoint_function = full_checkpoint_function(recorder.recomputing)
    # Op-level SAC: the whole layer checkpointed with torchtitan's policy as `context_fn` (graphs/sac.py).
    op_sac_function = full_checkpoint_function(recorder.recomputing, context_fn=op_sac_context_fn(recorder))
    for layer, slot in zip(parts.layers, slots, strict=True):
        layer.gradient_checkpointing = slot.mode in (Checkpoint.FULL, Checkpoint.OP_SELECTIVE)
        layer._gradient_checkpointing_func = (op_sac_function if slot.mode is Checkpoint.OP_SELECTIVE
                                              else checkpoint_function)
        for module in layer.modules():
            module._fitplan_selective = slot.mode is Checkpoint.SELECTIVE
