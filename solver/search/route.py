"""The pricing route: which lowering of the model prices a configuration, given the launchers that may run it.

One function decides it for `solve` and `estimate` alike: torchtitan's own model code when the torchtitan launcher
is pinned, megatron-core's layers for Megatron's engine where megatron-core lowers the model, else the Hugging Face
modeling code, traced in the dtype and autocast the engine trains in, compiled where the configuration compiles,
with Liger's kernels where its loss runs them, and with op-level SAC where an allowed launcher runs it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from costmodels.compilation import compile_credited
from costmodels.config import Config, Engine, Loss
from costmodels.lowering import liger_lowering, shared_lowering
from graphs import LayerGraph, LoraSpec, UnsupportedModel
from graphs.architectures import megatron_kind
from graphs.sources import ResolvedModel
from graphs.variant import Variant, lower_variant
from solver.plan.launchers.axolotl import kbit_preparation
from solver.plan.launchers.support import MEGATRON_PRICED, TITAN_PRICED

__all__ = ["KBIT_NOTE", "MEGATRON_PRICED", "NO_KBIT_NOTE", "TITAN_LOSSES", "TITAN_PRICED", "Lowerings", "Route",
           "titan_loss", "variant_for"]

# What a QLoRA estimate or plan says of the k-bit preparation it priced (none by default, as TRL 1.16 runs; PEFT's
# with --kbit-preparation; axolotl's loader, pinned by its launcher, prepares the base its own way).
KBIT_NOTE = ("4-bit base as PEFT's prepare_model_for_kbit_training leaves it (--kbit-preparation): every 16-bit "
             "parameter outside the 4-bit layers (embeddings, LM head, norms) in fp32, with the wider activations "
             "that follow, traced on the model")
NO_KBIT_NOTE = ("4-bit base without PEFT's prepare_model_for_kbit_training (TRL 1.16 does not call it): if your "
                "script calls it, --kbit-preparation (solve or estimate) prices the fp32 embeddings, head and norms "
                "it leaves")



@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """What decides the lowering beyond a configuration: the model, its adapters and attention, and the runtimes the
    allowed launchers run."""

    resolved: ResolvedModel
    lora: LoraSpec | None = None
    attention: str | None = None
    titan: bool = False
    """The torchtitan launcher is pinned: its own model code prices every configuration."""
    op_selective: bool = False
    """Some allowed launcher runs op-level selective checkpointing: the HF lowering traces it too."""
    axolotl: bool = False
    """The axolotl launcher is pinned: its loader prepares a 4-bit base with PEFT's `prepare_model_for_kbit_training`
    (`axolotl.kbit_preparation`). The Trainer/accelerate launchers' files do not call it, nor do TRL 1.16's
    SFT/DPO/KTO/GRPO trainers, and the torchrun script runs no QLoRA."""
    peft_kbit: bool = False
    """The user's own training script calls PEFT's `prepare_model_for_kbit_training` on the 4-bit base and casts
    nothing back (PEFT's QLoRA examples, TRL's SFTTrainer before 1.0): `--kbit-preparation`."""

    def kbit(self, config: Config) -> tuple[str, ...] | None:
        """How the runtime leaves a 4-bit base for `config` (`graphs.variant.Variant.kbit`): None when it runs no
        PEFT k-bit preparation, else the modules it casts back to the compute dtype afterwards."""
        if self.lora is None or not self.lora.four_bit:
            return None
        if self.axolotl:
            return kbit_preparation(self.resolved.model_type, config)
        return () if self.peft_kbit else None

    def kbit_note(self) -> str | None:
        """What a plan or estimate says of the user's script's k-bit preparation, as priced: None without a 4-bit
        base or under axolotl (its loader, not the user's script, prepares the base)."""
        if self.lora is None or not self.lora.four_bit or self.axolotl:
            return None
        return KBIT_NOTE if self.peft_kbit else NO_KBIT_NOTE

    def megatron_lowers(self) -> bool:
        """Whether Megatron's engine is priced on megatron-core's own GPT layers with the kernels a default
        Megatron-LM run uses (Transformer Engine's): Llama-style models, dense or MoE, without LoRA (Megatron runs
        no PEFT) or a pinned HF attention, with megatron-core installed (fitplan's `dev` extra has it). Other
        models keep the HF lowering, which the plan's notes say."""
        return (self.lora is None and self.attention in (None, MEGATRON_PRICED)
                and megatron_kind(self.resolved.model_type) is not None
                and importlib.util.find_spec("megatron") is not None)


# The loss knob as torchtitan 0.3.0 runs it (torchtitan/components/loss.py), traced on its own code: hf, its plain
# `CrossEntropyLoss` over full fp32 logits (Trainer.Config's loss before ChunkedLossWrapper came, and what older
# torchtitan releases ran); chunked, its `ChunkedLossWrapper` (the head and cross-entropy per sequence chunk, what
# 0.3.0's own llama3 jobs configure). torchtitan has no fused linear cross-entropy.
TITAN_LOSSES = {Loss.HF: "plain", Loss.CHUNKED: "chunked"}


def titan_loss(loss: Loss) -> str:
    """The loss torchtitan's lowering traces for the loss knob; ValueError for one torchtitan does not run."""
    if loss not in TITAN_LOSSES:
        raise ValueError(f"loss={loss} does not run under torchtitan (it runs {', '.join(map(str, TITAN_LOSSES))})")
    return TITAN_LOSSES[loss]


def variant_for(config: Config, route: Route, *, megatron: bool) -> Variant:
    """The lowering that prices `config` on `route` (`megatron`: megatron-core's layers price Megatron's engine)."""
    dtype, autocast = shared_lowering(config, lora=route.lora is not None)
    if route.titan:  # FSDP2 casts the parameters itself (the torchtitan rule keeps autocast out); the loss is the
        # one the emitted job configures (`TITAN_LOSSES`)
        return Variant(runtime="torchtitan", dtype=dtype, compiled=compile_credited(config),
                       loss=titan_loss(config.loss))
    if config.engine is Engine.MEGATRON and megatron:
        return Variant(runtime="megatron", dtype=dtype)
    attention = None if route.attention == MEGATRON_PRICED else route.attention
    return Variant(dtype=dtype, autocast=autocast, attention=attention, lora=route.lora,
                   op_selective=route.op_selective, compiled=compile_credited(config), liger=liger_lowering(config),
                   kbit=route.kbit(config))


@dataclass(slots=True)
class Lowerings:
    """The graphs a search prices, one per variant, lowered on first use. A model megatron-core's layers cannot
    build is priced on the HF code instead (the plan's notes say which code priced it)."""

    route: Route
    lower: Callable[[ResolvedModel, Variant], LayerGraph] = lower_variant
    graphs: dict[Variant, LayerGraph] = field(default_factory=dict)
    megatron: bool = field(init=False)
    """megatron-core's layers price Megatron's engine (until they refuse to build the model)."""

    def __post_init__(self) -> None:
        self.megatron = self.route.megatron_lowers()

    def variant(self, config: Config) -> Variant:
        """The variant that prices `config`."""
        return variant_for(config, self.route, megatron=self.megatron)

    def __call__(self, outer: Any) -> LayerGraph:
        """The graph that prices a search configuration (`space.Outer`: anything with `config()`)."""
        return self.graph(outer.config())

    def graph(self, config: Config) -> LayerGraph:
        """The graph that prices `config`, lowered the first time its variant is asked for."""
        variant = self.variant(config)
        if variant not in self.graphs:
            try:
                self.graphs[variant] = self.lower(self.route.resolved, variant)
            except UnsupportedModel:
                if variant.runtime != "megatron":
                    raise
                self.megatron = False  # a config megatron-core's GPT layers cannot build: the HF code prices it
                return self.graph(config)
        return self.graphs[variant]
