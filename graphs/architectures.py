"""Architecture support as one table: which runtimes lower each Hugging Face `model_type`, and the layout facts
lowerings and launchers read, from `data/architectures.json` (one record per model_type, each fact cited).

A model_type the table does not hold is lowered by no runtime but the HF path, and every flag of it is false.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

_RECORD_CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True)
Source = Annotated[str, Field(alias="_source", min_length=1)]
Runtime = Literal["torchtitan", "megatron", "liger"]
FlagName = Literal["fixed_positions", "qkv_bias_only", "qk_norm", "pipeline_stages"]
DATA_FILE = "data/architectures.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """A yes/no layout fact and the library file that states it."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    value: bool
    """The fact."""
    source: Source
    """The library file and version that says so."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Classes:
    """The transformers classes a model_type builds as a causal LM."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    value: tuple[Annotated[str, Field(min_length=1)], ...] = Field(min_length=1)
    """Class names, e.g. LlamaForCausalLM."""
    source: Source
    """The library file and version that says so."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TitanLowering:
    """How torchtitan's own model code runs this model_type (graphs/titan.py builds these families)."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    family: Literal["llama3", "qwen3"]
    """The torchtitan model family (torchtitan/models/<family>)."""
    moe: bool = False
    """Whether its MoE layers are lowered too (a model with experts is refused otherwise)."""
    source: Source
    """The torchtitan file and version that has the model."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronLowering:
    """How megatron-core's local GPT spec runs this model_type (graphs/megatron.py)."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    kind: Literal["dense", "moe"] | None
    """Dense blocks, MoE layers in every block, or null: not lowered (the source says why)."""
    source: Source
    """The megatron-core file and version, or why it is left out."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LigerPatch:
    """liger-kernel's patch for this model_type (what transformers' use_liger_kernel applies)."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    fused_linear_cross_entropy: bool
    """Whether the patch takes fused_linear_cross_entropy=True (fitplan's fused-linear loss)."""
    source: Source
    """The liger-kernel file and version that says so."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Architecture:
    """Everything fitplan knows of one model_type; an omitted fact is false (not lowered, patched or cut)."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    classes: Classes
    """Its causal-LM classes."""
    torchtitan: TitanLowering | None = None
    """torchtitan's lowering, if any."""
    megatron: MegatronLowering | None = None
    """megatron-core's lowering, if any."""
    liger: LigerPatch | None = None
    """liger-kernel's patch, if any."""
    fixed_positions: Flag | None = None
    """Positions index a table of fixed size: a longer sequence fails at run time."""
    qkv_bias_only: Flag | None = None
    """With the config class's defaults, q, k and v carry a bias and no other linear layer does."""
    qk_norm: Flag | None = None
    """Self-attention normalises each head's queries and keys with a learned norm over head_dim."""
    pipeline_stages: Flag | None = None
    """The torchrun script can cut its decoder into pipeline stages."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchitectureTable:
    """The data file: records keyed by Hugging Face model_type."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    source: Source
    """What the table is and how it is checked."""
    architectures: dict[Annotated[str, Field(min_length=1)], Architecture]
    """One record per model_type."""


def table_from_json(text: str, *, origin: str) -> dict[str, Architecture]:
    """Records keyed by model_type from the table's JSON; raises ValueError naming `origin` when it is malformed."""
    try:
        return TypeAdapter(ArchitectureTable).validate_python(json.loads(text)).architectures
    except (ValueError, ValidationError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"architecture table {origin} is malformed: {err}") from err


@lru_cache(maxsize=1)
def load_architectures() -> dict[str, Architecture]:
    """Every record keyed by model_type, in file order (cached: treat as read-only)."""
    text = resources.files("graphs").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return table_from_json(text, origin=f"graphs/{DATA_FILE}")


def architecture(model_type: str | None) -> Architecture | None:
    """The record of `model_type`, or None when the table does not hold it."""
    return load_architectures().get(model_type) if isinstance(model_type, str) else None


def titan_lowering(model_type: str | None) -> TitanLowering | None:
    """torchtitan's lowering of `model_type`, or None when torchtitan has no model for it."""
    record = architecture(model_type)
    return record.torchtitan if record else None


def titan_family(model_type: str | None) -> str | None:
    """The torchtitan model family that runs `model_type` (e.g. "llama3"), or None."""
    lowering = titan_lowering(model_type)
    return lowering.family if lowering else None


def megatron_kind(model_type: str | None) -> str | None:
    """"dense" or "moe" when megatron-core's local GPT spec runs `model_type`, else None."""
    record = architecture(model_type)
    return record.megatron.kind if record and record.megatron else None


def liger_patched(model_type: str | None) -> bool:
    """Whether liger-kernel patches `model_type` at all."""
    record = architecture(model_type)
    return bool(record and record.liger)


def liger_fused_linear(model_type: str | None) -> bool:
    """Whether liger-kernel's patch of `model_type` runs its fused linear cross-entropy."""
    record = architecture(model_type)
    return bool(record and record.liger and record.liger.fused_linear_cross_entropy)


def has_flag(model_type: str | None, name: FlagName) -> bool:
    """The layout fact `name` of `model_type` (false for a model_type the table does not hold)."""
    record = architecture(model_type)
    fact = getattr(record, name) if record else None
    return bool(fact and fact.value)


def supported(runtime: Runtime) -> tuple[str, ...]:
    """The model types `runtime` lowers (torchtitan, megatron) or patches (liger), in table order."""
    lowered = {"torchtitan": titan_family, "megatron": megatron_kind, "liger": liger_patched}[runtime]
    return tuple(t for t in load_architectures() if lowered(t))


def flagged(name: FlagName) -> tuple[str, ...]:
    """The model types whose layout fact `name` is true, in table order."""
    return tuple(t for t in load_architectures() if has_flag(t, name))


def pipeline_classes() -> tuple[str, ...]:
    """The causal-LM classes the torchrun script cuts into pipeline stages."""
    return tuple(name for t in flagged("pipeline_stages") for name in load_architectures()[t].classes.value)


__all__ = ["Architecture", "ArchitectureTable", "Classes", "Flag", "LigerPatch", "MegatronLowering", "TitanLowering",
           "architecture", "flagged", "has_flag", "liger_fused_linear", "liger_patched", "load_architectures",
           "megatron_kind", "pipeline_classes", "supported", "table_from_json", "titan_family", "titan_lowering"]


def router_pre_softmax(model_type: str, norm_topk_prob: bool) -> bool:
    """Whether the router weighs the top k by the softmax over all experts (megatron's `moe_router_pre_softmax`),
    as Qwen3-MoE does with `norm_topk_prob` off; with it on, and in Mixtral, the weights are renormalised over the
    top k, which is megatron's default softmax over the top-k logits. The megatron-core lowering and the Megatron
    launcher's model shape (`solver.plan.model_shape`) both ask here: a fact of the model, read without torch."""
    return model_type == "qwen3_moe" and not norm_topk_prob
