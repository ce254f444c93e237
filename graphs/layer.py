"""The per-node record of a lowered model: parameters by role and TP split, and per checkpoint mode the exact
activation bytes, FLOPs and transient peaks as polynomials in (b, s, 1/t).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .poly import ZERO, PeakPoly, Poly


class Checkpoint(str, Enum):
    """Activation checkpointing of one decoder layer."""

    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core only (Korthikanti et al. 2022)
    FULL = "full"  # keep only the layer input, recompute the layer in backward
    # Op-level selective activation checkpointing: PyTorch's `create_selective_checkpoint_contexts` with
    # torchtitan's policy (keep matmul and attention outputs, every second matmul recomputed; `graphs/sac.py`).
    OP_SELECTIVE = "op_selective"

    def __str__(self) -> str:
        return self.value


class Role(str, Enum):
    """What a node of the layer graph is."""

    EMBEDDING = "embedding"
    DECODER = "decoder"
    NORM = "norm"
    HEAD = "head"
    LOSS = "loss"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamTensor:
    """One parameter tensor, counted once even when tied."""

    name: str
    """Fully qualified name in the transformers model."""
    node: str
    """The graph node that owns it."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    trainable: bool
    """False for frozen weights (e.g. the base model under LoRA)."""
    itemsize: int
    """Bytes per element at the lowering dtype."""
    tp_style: str
    """Tensor-parallel style from the model's TP plan ("colwise", "rowwise", ..., or "replicate")."""
    tp_dim: int | None
    """The dimension that tensor parallelism shards, or None if replicated."""
    stored_bytes: int | None = None
    """Device bytes when the tensor is not stored as numel x itemsize: a bitsandbytes-quantized base weight's
    packed data plus its quantisation state, as bitsandbytes lays them out (`graphs.quantization`)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def quantized(self) -> bool:
        return self.stored_bytes is not None

    def local_numel(self, tp: int) -> int:
        """Elements on the largest TP rank: DTensor `Shard` gives each rank ceil(n / tp) rows of the dim."""
        if self.tp_dim is None or tp == 1:
            return self.numel
        rest = self.numel // self.shape[self.tp_dim]
        return -(-self.shape[self.tp_dim] // tp) * rest


@dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """The compute of one phase of a node."""

    flops: Poly = ZERO
    """All counted FLOPs (torch.utils.flop_counter conventions: 2 per multiply-add, full s^2 attention)."""
    attention_flops: Poly = ZERO
    """The part of `flops` done by fused attention kernels."""
    io_bytes: Poly = ZERO
    """Bytes read and written by ops that are not matmuls or attention (memory-bound work)."""
    kernels: Poly = ZERO
    """Device kernels launched: one per dispatched ATen op that reads or writes tensor data
    (`recorder.launches_kernel`); a constant, since the op sequence does not depend on the shape."""

    def __add__(self, other: Work) -> Work:
        return Work(flops=self.flops + other.flops, attention_flops=self.attention_flops + other.attention_flops,
                    io_bytes=self.io_bytes + other.io_bytes, kernels=self.kernels + other.kernels)

    def to_json(self) -> dict[str, Any]:
        return {"flops": self.flops.to_json(), "attention_flops": self.attention_flops.to_json(),
                "io_bytes": self.io_bytes.to_json(), "kernels": self.kernels.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Work:
        return cls(flops=Poly.from_json(data["flops"]), attention_flops=Poly.from_json(data["attention_flops"]),
                   io_bytes=Poly.from_json(data["io_bytes"]), kernels=Poly.from_json(data["kernels"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeCost:
    """What a node costs under one checkpoint mode; bytes are per micro-batch at the lowering dtype.

    Peaks and nets are relative to the live memory when the node's forward (or backward) starts, and leave out
    parameters, their gradients and optimizer states, which the engine models account for.
    """

    saved: Poly = ZERO
    """Activation bytes this node keeps for its backward once its forward is done."""
    forward: Work = field(default_factory=Work)
    backward: Work = field(default_factory=Work)
    """Backward compute, without the recompute."""
    recompute: Work = field(default_factory=Work)
    """Forward work repeated during backward (checkpointed modes)."""
    fwd_peak: PeakPoly = field(default_factory=PeakPoly)
    fwd_net: Poly = ZERO
    released_after_forward: Poly = ZERO
    """Part of `fwd_net` freed when the whole forward returns (autocast's cast cache, locals of the top-level
    forward), before any backward runs."""
    bwd_peak: PeakPoly = field(default_factory=PeakPoly)
    """Backward peak when each new gradient is handed off at once (reduced, or added to an existing one)."""
    bwd_peak_fresh: PeakPoly = field(default_factory=PeakPoly)
    """Backward peak when this node's new gradients stay allocated (first micro-batch, unsharded grads)."""
    bwd_net: Poly = ZERO
    grads: Poly = ZERO
    """Bytes of parameter gradients produced during this node's backward."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            data[name] = value.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModeCost:
        kinds = {"forward": Work, "backward": Work, "recompute": Work,
                 "fwd_peak": PeakPoly, "bwd_peak": PeakPoly, "bwd_peak_fresh": PeakPoly}
        return cls(**{name: kinds.get(name, Poly).from_json(value) for name, value in data.items()})


@dataclass(frozen=True, slots=True, kw_only=True)
class MoE:
    """Mixture-of-experts facts of a decoder layer."""

    experts: int
    """Routed experts in the layer."""
    top_k: int
    """Experts each token is sent to."""
    expert_params: int
    """Parameter elements of all routed experts together."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Layer:
    """A node of the layer graph."""

    name: str
    """"embed", "layers.<i>", "norm", "head" or "loss"."""
    role: Role
    index: int | None = None
    """Position among decoder layers."""
    kind: int | None = None
    """Decoder layers with the same kind are identical (same modules, shapes and settings)."""
    params: tuple[ParamTensor, ...] = ()
    modes: tuple[tuple[Checkpoint, ModeCost], ...] = ()
    """Costs per available checkpoint mode; non-decoder nodes only have NONE."""
    boundary: Poly = ZERO
    """Bytes of the activation this node hands to the next (what a checkpointed successor keeps)."""
    tp_allreduces: int = 0
    """Row-wise parallel modules: each all-reduces its output in forward under tensor parallelism."""
    moe: MoE | None = None

    def cost(self, mode: Checkpoint = Checkpoint.NONE) -> ModeCost:
        for name, cost in self.modes:
            if name == mode:
                return cost
        raise KeyError(f"{self.name} has no checkpoint mode {mode}")

    @property
    def checkpoint_modes(self) -> tuple[Checkpoint, ...]:
        return tuple(mode for mode, _ in self.modes)

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_count(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)
