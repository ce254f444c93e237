"""LoRA adapters as PEFT defines them: the base weights freeze, the adapters train."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import FitplanError

if TYPE_CHECKING:
    import torch

ALL_LINEAR = "all-linear"
# A module name as PEFT matches it against `named_modules()` ("q_proj", "mlp.down_proj"), or "all-linear".
_MODULE_NAME = re.compile(r"[A-Za-z_][\w.\-]{0,199}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSpec:
    """A PEFT `LoraConfig` subset: what changes memory and compute."""

    rank: int = 16
    """`r`: the adapter rank."""
    alpha: int = 32
    """`lora_alpha` (scaling only; no effect on cost, kept for the emitted config)."""
    targets: tuple[str, ...] = (ALL_LINEAR,)
    """`target_modules`: module names, or "all-linear" (every linear layer except the LM head)."""
    dropout: float = 0.0
    """`lora_dropout`: a nonzero value keeps a dropped copy of each adapted input for backward."""

    def __post_init__(self) -> None:
        for name in ("rank", "alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LoRA {name}={value!r} must be a positive integer")
        if not self.targets:
            raise ValueError("LoRA targets must name at least one module (or 'all-linear')")
        for target in self.targets:
            if not isinstance(target, str) or not _MODULE_NAME.fullmatch(target):
                raise ValueError(f"LoRA target {str(target)[:60]!r} is not a module name (letters, digits, _ . -)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout} must be in [0, 1)")

    def peft_config(self) -> Any:
        from peft import LoraConfig

        targets: str | list[str] = ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets,
                          lora_dropout=self.dropout, task_type="CAUSAL_LM")

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoraSpec:
        return cls(rank=data["rank"], alpha=data["alpha"], targets=tuple(data["targets"]), dropout=data["dropout"])


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """Inject adapters in place (PEFT `inject_adapter_in_model` semantics) and freeze everything else.

    The adapters take the base layer's dtype. PEFT's default (`autocast_adapter_dtype=True`) upcasts them to
    fp32, but the runtimes that train in 16 bits run them in 16 bits: DeepSpeed casts the whole module
    (`module.bfloat16()` under `bf16.enabled`) and FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)` gathers every
    parameter in bf16, so fp32 adapters would save fp32 copies of each adapted input that no real run keeps.
    Under autocast (fp32 weights) both choices give fp32 adapters.
    """
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, spec.peft_config(), autocast_adapter_dtype=False)
    except ValueError as err:
        raise FitplanError(f"LoRA targets {list(spec.targets)} do not fit this model: {err}",
                           "Use module names that exist in the model (e.g. q_proj,v_proj) or 'all-linear'.") from err
    return peft_model.base_model.model
