"""Record one fake-tensor training pass: every op's scope, phase and FLOPs, every storage's life, and what
autograd saves for backward.

The recorder is a `TorchDispatchMode` that runs under `FakeTensorMode`, so nothing is allocated. Segments
(which layer an op belongs to, forward or backward) come from module hooks; `lower` turns several such
recordings at different shapes into exact per-layer polynomials.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.flop_counter as flop_counter
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten


@flop_counter.shape_wrapper
def _cpu_flash_forward_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(q, k, v)


@flop_counter.shape_wrapper
def _cpu_flash_backward_flops(grad_out: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None,
                              **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


@flop_counter.shape_wrapper
def _grouped_mm_flops(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of `torch._grouped_mm`, which MoE experts use in transformers 5 (the counter has no formula)."""
    if len(a) == 2 and len(b) == 3:  # (tokens, k) x (experts, k, n): forward and input gradient
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:  # (k, tokens) x (tokens, n) -> (experts, k, n): weight gradient
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    raise NotImplementedError(f"grouped_mm shapes {a} x {b}")


# torch 2.13's FlopCounterMode counts 0 for the CPU flash-attention kernels and for grouped_mm
# (feasibility study §4); these are the formulas it uses for the CUDA kernels / for mm.
_EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
    aten._grouped_mm: _grouped_mm_flops,
}
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {**flop_counter.flop_registry, **_EXTRA_FLOP_FORMULAS}

_ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
    aten._flash_attention_forward, aten._flash_attention_backward,
    aten._efficient_attention_forward, aten._efficient_attention_backward,
}
# Ops that only reinterpret a storage: they move no bytes.
_FREE_OPS = {aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand, aten.unsqueeze,
             aten.squeeze, aten.slice, aten.select, aten.as_strided, aten.alias, aten.detach, aten.split,
             aten.split_with_sizes, aten.unbind, aten.chunk, aten.reshape, aten._reshape_alias, aten.lift_fresh,
             aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}


@dataclass(slots=True)
class OpRecord:
    """One dispatched aten op."""

    name: str
    scope: str
    backward: bool
    recompute: bool
    flops: int
    flop_class: str  # "gemm", "attention" or "" (no FLOPs counted)
    io: list[int]  # bytes of every tensor read or written, by argument position; empty for views


# Ops that read or write tensor data and still launch no device kernel: metadata queries answered on the host.
_HOST_ONLY_OPS = {"aten.is_same_size", "aten._has_compatible_shallow_copy_type", "aten.sym_size", "aten.sym_numel",
                  "aten.sym_stride", "aten.sym_storage_offset", "aten.is_nonzero"}


def launches_kernel(op: OpRecord) -> bool:
    """Whether eager PyTorch launches a device kernel for `op`: every ATen op that reads or writes tensor data
    dispatches to one CUDA kernel (TensorIterator ops, cuBLAS GEMMs, the flash-attention kernels); views,
    uninitialised allocations (`_FREE_OPS`, recorded with no bytes) and host metadata queries launch none."""
    return bool(op.io) and op.name not in _HOST_ONLY_OPS


@dataclass(slots=True)
class StorageRecord:
    """One storage created during the pass."""

    alloc_op: int
    nbytes: int
    free_after: int | None = None  # index of the first op that ran after it was freed
    dropout_mask: bool = False
    grad: bool = False
    savers: list[str] = field(default_factory=list)
    read_by_layer: bool = False
    """Read by an op inside a decoder layer (set for storages made before the layers only)."""


class Recorder(TorchDispatchMode):
    """Log ops and storages; scopes are set by `ScopeTracker` hooks."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self.storages: list[StorageRecord] = []
        self._live: dict[int, int] = {}  # storage _cdata -> index in self.storages
        # Parameters and buffers exist before the pass; views of them (weight.t()) allocate nothing.
        self._existing = {t.untyped_storage()._cdata for t in existing}
        self._keep: list[Any] = []
        self.scope = "inputs"
        self.backward = False
        self.recompute_depth = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # metadata queries (prim.device); dispatched more or less often by caches
            return out
        if self.scope.startswith("layers."):
            self._note_layer_reads(args, kwargs)
        packet = func._overloadpacket
        index = len(self.ops)
        for tensor in _tensors(out):
            self._track(tensor, index)
        if packet is aten.bernoulli_:
            self._mark_dropout_mask(args[0])
        if packet is aten.native_layer_norm:
            self._widen_layer_norm_stats(out[1:])
        formula = FLOP_FORMULAS.get(packet)
        flops = formula(*args, **kwargs, out_val=out) if formula else 0
        flop_class = ("attention" if packet in _ATTENTION_OPS else "gemm") if flops else ""
        io = [] if packet in _FREE_OPS else [t.numel() * t.element_size() for t in _tensors((args, kwargs, out))]
        self.ops.append(OpRecord(str(packet), self.scope, self.backward, self.recompute_depth > 0,
                                 int(flops), flop_class, io))
        return out

    def _note_layer_reads(self, args: Any, kwargs: Any) -> None:
        for tensor in _tensors((args, kwargs)):
            position = self._live.get(tensor.untyped_storage()._cdata)
            if position is not None and self.ops[self.storages[position].alloc_op].scope in ("embed", "inputs"):
                self.storages[position].read_by_layer = True

    def _track(self, tensor: torch.Tensor, index: int) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live or key in self._existing:
            return
        self._live[key] = len(self.storages)
        self.storages.append(StorageRecord(alloc_op=index, nbytes=storage.nbytes()))
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        position = self._live.pop(key, None)
        if position is not None:
            self.storages[position].free_after = len(self.ops)

    def _mark_dropout_mask(self, tensor: torch.Tensor) -> None:
        # CPU dropout keeps its mask in the activation dtype (aten `_dropout_impl`: bernoulli_ then mul);
        # CUDA `native_dropout` keeps a 1-byte bool mask. Training runs on GPUs, so count 1 byte per element.
        position = self._live.get(tensor.untyped_storage()._cdata)
        if position is not None:
            record = self.storages[position]
            record.dropout_mask = True
            record.nbytes = tensor.numel()

    def _widen_layer_norm_stats(self, stats: tuple[torch.Tensor, ...]) -> None:
        # The CPU layer-norm kernel returns mean and rstd in the input dtype; the CUDA kernel keeps them in
        # fp32 (its accumulation type), and backward saves them. Count what CUDA holds.
        for tensor in stats:
            position = self._live.get(tensor.untyped_storage()._cdata)
            if position is not None and tensor.element_size() < 4:
                self.storages[position].nbytes = tensor.numel() * 4

    def storage_index(self, tensor: torch.Tensor) -> int | None:
        return self._live.get(tensor.untyped_storage()._cdata)

    def pack_saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """`saved_tensors_hooks` pack: note which scope saved which storage (parameters are not tracked)."""
        position = self.storage_index(tensor)
        if position is not None:
            savers = self.storages[position].savers
            if self.scope not in savers:
                savers.append(self.scope)
        return tensor

    def mark_grads(self, params: Iterator[torch.nn.Parameter]) -> None:
        for p in params:
            if p.grad is not None:
                position = self.storage_index(p.grad)
                if position is not None:
                    self.storages[position].grad = True

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack_saved, lambda t: t):
            yield

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        self.recompute_depth += 1
        try:
            yield
        finally:
            self.recompute_depth -= 1


@contextlib.contextmanager
def marking_recompute(recorder: Recorder, targets: list[torch.nn.Module],
                      owners: dict[torch.nn.Module, str] | None = None) -> Iterator[None]:
    """Mark the ops `targets` rerun in backward (a checkpoint's recompute) as recompute, through forward hooks on
    them; a target in `owners` also sets the recorder's scope when its rerun starts (for runtimes whose
    checkpoint output ModTracker's pre-backward hook does not see)."""
    from .fake import in_backward

    owners = owners or {}
    stack: list[contextlib.AbstractContextManager[None]] = []

    def enter(module: torch.nn.Module, args: Any) -> None:
        context = recorder.recomputing() if in_backward() else contextlib.nullcontext()
        if in_backward() and module in owners:
            recorder.scope = owners[module]
        context.__enter__()
        stack.append(context)

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        stack.pop().__exit__(None, None, None)

    handles = []
    for target in targets:
        handles += [target.register_forward_pre_hook(enter), target.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class ScopeTracker:
    """Set `recorder.scope` from module hooks: the latest scope module whose forward or backward started.

    `scopes` maps each scope module to its name; modules listed in `late_if_after` are named "norm" when they
    run after a decoder layer and "embed" otherwise; ops after the LM head belong to "loss".
    """

    def __init__(self, recorder: Recorder, scopes: dict[torch.nn.Module, str], *,
                 dynamic: set[torch.nn.Module], head: torch.nn.Module) -> None:
        self.recorder = recorder
        self.scopes = scopes
        self.dynamic = dynamic
        self.head = head
        self.tracker = ModTracker()
        self._layers_ran = False
        self.dynamic_names: dict[int, str] = {}

    def _name(self, module: torch.nn.Module | None) -> str | None:
        if module is None:
            return None
        if module in self.dynamic:
            if self.tracker.is_bw:
                return self.dynamic_names.get(id(module))
            name = "norm" if self._layers_ran else "embed"
            self.dynamic_names[id(module)] = name
            return name
        return self.scopes.get(module)

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.tracker.is_bw:
            return
        name = self._name(module)
        if name is not None:
            self._layers_ran |= name.startswith("layers.")
            self.recorder.scope = name

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module is self.head and not self.tracker.is_bw:
            self.recorder.scope = "loss"

    def _pre_backward(self, module: torch.nn.Module | None, grad_output: Any) -> None:
        name = self._name(module)
        if name is not None:
            self.recorder.scope = name

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.tracker.register_user_hooks(pre_fw_hook=self._pre_forward, post_fw_hook=self._post_forward,
                                         pre_bw_hook=self._pre_backward)
        with self.tracker:
            yield
        self.tracker.clear_user_hooks()

    def enter_backward(self) -> None:
        self.recorder.backward = True
        self.recorder.scope = "loss"
