"""The adapter record: a PEFT `LoraConfig` subset (rank, targets, dropout, DoRA, rsLoRA, modules_to_save) and the
bitsandbytes format of the frozen base (QLoRA). Plain data; `lora.py` applies it with PEFT."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

ALL_LINEAR = "all-linear"
# A module name as PEFT matches it against `named_modules()` ("q_proj", "mlp.down_proj"), or "all-linear".
_MODULE_NAME = re.compile(r"[A-Za-z_][\w.\-]{0,199}")


class Quantization(str, Enum):
    """bitsandbytes formats of the frozen base weights (transformers `BitsAndBytesConfig`)."""

    NF4 = "nf4"  # 4-bit NormalFloat (QLoRA, Dettmers et al. 2023): load_in_4bit, bnb_4bit_quant_type="nf4"
    FP4 = "fp4"  # 4-bit float: load_in_4bit, bnb_4bit_quant_type="fp4"
    INT8 = "int8"  # LLM.int8() (Dettmers et al. 2022): load_in_8bit

    def __str__(self) -> str:
        return self.value

    @property
    def bits(self) -> int:
        return 8 if self is Quantization.INT8 else 4


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
    quantization: Quantization | None = None
    """Frozen base weights stored by bitsandbytes (QLoRA: nf4/fp4; int8), or None for 16-bit base weights."""
    double_quant: bool = False
    """`bnb_4bit_use_double_quant`: the 4-bit block scales quantized again (8-bit, with fp32 scales per 256)."""
    use_dora: bool = False
    """`use_dora`: DoRA's trainable magnitude vector per adapted layer and its extra activations."""
    use_rslora: bool = False
    """`use_rslora`: scaling alpha/sqrt(r) instead of alpha/r (no effect on cost, kept for the emitted config)."""
    modules_to_save: tuple[str, ...] = ()
    """`modules_to_save`: modules trained in full as a copy beside the frozen original (e.g. lm_head)."""

    def __post_init__(self) -> None:
        if self.quantization is not None and not isinstance(self.quantization, Quantization):
            try:
                object.__setattr__(self, "quantization", Quantization(self.quantization))
            except ValueError:
                raise ValueError(f"LoRA quantization={self.quantization!r} must be one of "
                                 f"{[q.value for q in Quantization]} or None") from None
        if self.double_quant and not self.four_bit:
            raise ValueError("double_quant applies to 4-bit base weights only (quantization nf4 or fp4)")
        for name in ("double_quant", "use_dora", "use_rslora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoRA {name}={getattr(self, name)!r} must be true or false")
        if isinstance(self.modules_to_save, str) or not isinstance(self.modules_to_save, (tuple, list)):
            raise ValueError(f"LoRA modules_to_save={str(self.modules_to_save)[:60]!r} must be a list of module names")
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
        for module in self.modules_to_save:
            if not isinstance(module, str) or not _MODULE_NAME.fullmatch(module) or module == ALL_LINEAR:
                raise ValueError(f"LoRA modules_to_save entry {str(module)[:60]!r} is not a module name")
        self._check_adapter()

    @property
    def four_bit(self) -> bool:
        """A 4-bit base (QLoRA: nf4 or fp4), what double quantisation and PEFT's k-bit preparation apply to."""
        return self.quantization is not None and self.quantization.bits == 4

    def _check_adapter(self) -> None:
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
                          lora_dropout=self.dropout, use_dora=self.use_dora, use_rslora=self.use_rslora,
                          modules_to_save=list(self.modules_to_save) or None, task_type="CAUSAL_LM")

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout,
                "quantization": None if self.quantization is None else self.quantization.value,
                "double_quant": self.double_quant, "use_dora": self.use_dora, "use_rslora": self.use_rslora,
                "modules_to_save": list(self.modules_to_save)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoraSpec:
        """Read `to_json`'s dict; the fields added for QLoRA/DoRA default when absent (plans written before)."""
        return cls(rank=data["rank"], alpha=data["alpha"], targets=tuple(data["targets"]), dropout=data["dropout"],
                   quantization=data.get("quantization"), double_quant=data.get("double_quant", False),
                   use_dora=data.get("use_dora", False), use_rslora=data.get("use_rslora", False),
                   modules_to_save=tuple(data.get("modules_to_save", ())))
