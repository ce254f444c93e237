"""A lowering variant: which runtime's code is traced, and how (dtype, autocast, LoRA, compiled, Liger, op-level
SAC). One model has several; `lower_variant` lowers one, through the module of its runtime, imported only when a
lowering is needed (a cache hit reads one JSON file and imports no torch)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .adapters import LoraSpec
from .cache import load_cached
from .errors import UnsupportedModel
from .lowering_keys import hf_key, megatron_key, titan_key
from .workers import spawn_context

if TYPE_CHECKING:  # graphs.graph and graphs.sources are light, but only the annotations need them here
    from .graph import LayerGraph
    from .sources import ResolvedModel

RUNTIMES = ("hf", "torchtitan", "megatron")


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """One lowering of a model: the code that runs the plan, traced as that runtime trains it."""

    runtime: str = "hf"
    """"hf" (transformers modeling code), "torchtitan" (its own models) or "megatron" (megatron-core's layers)."""
    dtype: str = "bfloat16"
    """Parameter dtype the module holds."""
    autocast: str | None = None
    """torch.autocast dtype of forward (plain PyTorch mixed precision over fp32 weights), or None."""
    attention: str | None = None
    """The HF attention implementation asked for (None: the model's default)."""
    lora: LoraSpec | None = None
    compiled: bool = False
    """The layers as torch.compile trains them (Inductor's partitioner decides what they save)."""
    liger: bool = False
    """transformers' `use_liger_kernel` patch (Liger's RMSNorm, SwiGLU and RoPE kernels in the layers)."""
    op_selective: bool = False
    """Also trace op-level selective checkpointing (a fourth checkpoint mode)."""
    loss: str = "chunked"
    """torchtitan's loss: its ChunkedLossWrapper ("chunked") or plain cross-entropy over full logits ("plain")."""
    kernels: str = "te"
    """megatron-core's layer spec: Transformer Engine's kernels ("te", what Megatron-LM runs) or "local"."""
    kbit: tuple[str, ...] | None = None
    """A 4-bit base as PEFT's `prepare_model_for_kbit_training` leaves it (every other 16-bit parameter in fp32),
    then the modules whose names contain one of these cast back, as the runtime that calls it does; None: the
    runtime does not call it (`graphs/kbit.py`)."""

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime={self.runtime!r} must be one of {', '.join(RUNTIMES)}")
        if self.runtime != "hf" and (self.lora is not None or self.autocast is not None or self.attention is not None
                                     or self.liger or self.op_selective or self.kbit is not None):
            raise ValueError(f"the {self.runtime} lowering runs its own attention, without LoRA, autocast, Liger or "
                             "op-level SAC tracing")

    def describe(self) -> str:
        """A few words: the runtime and what is traced beyond the eager model."""
        extras = [name for name, on in (("autocast " + str(self.autocast), self.autocast), ("LoRA", self.lora),
                                        ("compiled", self.compiled), ("Liger", self.liger),
                                        ("op-level SAC", self.op_selective),
                                        ("PEFT's k-bit preparation", self.kbit is not None)) if on]
        return ", ".join([f"{self.runtime} {self.dtype}", *extras])

    @property
    def eager(self) -> Variant:
        """The same variant without torch.compile (what a compiled lowering falls back to)."""
        return replace(self, compiled=False)


def variant_key(resolved: ResolvedModel, variant: Variant) -> str:
    """The cache entry of the variant's lowering (what its runtime's module stores it under)."""
    if variant.runtime == "torchtitan":
        return titan_key(resolved, dtype=variant.dtype, loss=variant.loss, compiled=variant.compiled)
    if variant.runtime == "megatron":
        return megatron_key(resolved, dtype=variant.dtype, kernels=variant.kernels)
    return hf_key(resolved, dtype=variant.dtype, autocast=variant.autocast, attention=variant.attention,
                  lora=variant.lora, op_selective=variant.op_selective, compiled=variant.compiled, liger=variant.liger,
                  kbit=variant.kbit)


def lower_all(resolved: ResolvedModel, variants: Iterable[Variant], *, workers: int | None = None) -> None:
    """Lower the variants not in the cache yet, in parallel worker processes (each lowering is one traced model;
    eager variants first, since a compiled one reads its eager lowering's work). Errors surface when the variant
    is lowered for use (`lower_variant`); here a failed worker leaves its variant to that."""
    missing = [v for v in dict.fromkeys(variants) if load_cached(variant_key(resolved, v)) is None]
    workers = min(len(missing), workers or lowering_workers())
    context = spawn_context()
    if workers <= 1 or context is None:  # lowered one by one when used
        return
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for batch in ([v for v in missing if not v.compiled], [v for v in missing if v.compiled]):
            for future in [pool.submit(_lower_quietly, resolved, v) for v in batch]:
                future.result()


def lowering_workers() -> int:
    """How many processes lower at once: $FITPLAN_LOWERING_WORKERS where set (the test suite sets 1: its xdist
    workers already fill the cores, and each lowering process pays torch's and transformers' imports anew), else one
    per core."""
    setting = os.environ.get("FITPLAN_LOWERING_WORKERS", "")
    return int(setting) if setting.isdigit() and int(setting) > 0 else os.cpu_count() or 1


def _lower_quietly(resolved: ResolvedModel, variant: Variant) -> None:
    """A worker's lowering: stored in the disk cache, errors left for the caller's own attempt."""
    with contextlib.suppress(Exception):
        lower_variant(resolved, variant)


def lower_variant(resolved: ResolvedModel, variant: Variant) -> LayerGraph:
    """The variant's layer graph (cached on disk by its runtime's module). A compiled variant whose model AOTAutograd
    cannot trace falls back to its eager lowering: compiling only saves memory, so eager prices it
    conservatively."""
    try:
        return _lower(resolved, variant)
    except UnsupportedModel:
        if not variant.compiled:
            raise
        return _lower(resolved, variant.eager)


def _lower(resolved: ResolvedModel, variant: Variant) -> LayerGraph:
    """The cache first (torchtitan's and megatron-core's tracing modules import torch and their libraries: only on
    a miss), then the runtime's own lowering, which stores what it traces."""
    if variant.runtime == "torchtitan":
        key = titan_key(resolved, dtype=variant.dtype, loss=variant.loss, compiled=variant.compiled)
        if (cached := load_cached(key)) is not None:
            return cached
        from .titan import lower_titan_resolved

        return lower_titan_resolved(resolved, dtype=variant.dtype, loss=variant.loss, compiled=variant.compiled)
    if variant.runtime == "megatron":
        if (cached := load_cached(megatron_key(resolved, dtype=variant.dtype, kernels=variant.kernels))) is not None:
            return cached
        from .megatron import lower_megatron_resolved

        return lower_megatron_resolved(resolved, dtype=variant.dtype, kernels=variant.kernels)
    from .lowering import lower_resolved  # light: it imports the tracing code only to lower

    return lower_resolved(resolved, dtype=variant.dtype, autocast=variant.autocast, attention=variant.attention,
                          lora=variant.lora, op_selective=variant.op_selective, compiled=variant.compiled,
                          liger=variant.liger, kbit=variant.kbit)
