"""Option groups: options that travel together (the cluster's host, the adapters, the outputs) declared once as a
dataclass of typer options, expanded into a command's signature and handed to the command as one value."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from costmodels import cluster as C
from graphs import FitplanError
from graphs.adapters import LoraSpec
from solver.cli.options import number, text
from solver.search import bounds as B


def option_groups(command: Callable[..., Any]) -> Callable[..., Any]:
    """Expand each parameter of `command` annotated with an option-group dataclass into that dataclass's fields
    (typer parses them as options), and call `command` with one instance per group."""
    hints = typing.get_type_hints(command, include_extras=True)
    signature = inspect.signature(command)
    groups = {name: hints[name] for name in signature.parameters
              if dataclasses.is_dataclass(hints.get(name)) and getattr(hints[name], "OPTION_GROUP", False)}
    params, fields_of = [], {}
    for param in signature.parameters.values():
        if param.name not in groups:
            params.append(param.replace(annotation=hints.get(param.name, param.annotation)))
            continue
        group = groups[param.name]
        group_hints = typing.get_type_hints(group, include_extras=True)
        fields_of[param.name] = [f.name for f in dataclasses.fields(group)]
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=group_hints[f.name],
                                     default=f.default) for f in dataclasses.fields(group)]

    @functools.wraps(command)
    def run(**kwargs: Any) -> Any:
        for name, group in groups.items():
            kwargs[name] = group(**{field: kwargs.pop(field) for field in fields_of[name]})
        return command(**kwargs)

    keyword_first = sorted(params, key=lambda p: p.kind)
    run.__signature__ = inspect.Signature(keyword_first)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    del run.__wrapped__  # typer must read the expanded signature
    return run


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
    """What a cluster string leaves out; each default is printed with the plan and in every diagnosis it decides."""

    OPTION_GROUP = True
    cpu_ram_gib: Annotated[float | None, number(float, 0, C.MAX_CPU_RAM_GIB, "Host RAM per node in GiB (default: "
                                                "the GPU's typical host, its share for fewer GPUs).", lo_open=True,
                                                rich_help_panel="Cluster")] = None
    cpu_cores: Annotated[int | None, number(int, 1, C.MAX_CPU_CORES, "CPU cores per node (default: the typical "
                                            "host's share).", rich_help_panel="Cluster")] = None
    gpus_per_node: Annotated[int | None, number(int, 1, C.MAX_GPUS_PER_NODE, "GPUs per node (default: the GPU's "
                                                "typical node).", rich_help_panel="Cluster")] = None
    nvme_gbps: Annotated[float | None, number(float, 0, C.MAX_GBPS, "NVMe read GB/s per node; allows NVMe offload "
                                              "(default: none).", rich_help_panel="Cluster")] = None
    inter_node_gbps: Annotated[float | None, number(float, 0, C.MAX_GBPS, "Network GB/s per GPU per direction "
                                                    "between nodes (default: the typical node's fabric).",
                                                    rich_help_panel="Cluster")] = None
    profile: Annotated[Path | None, typer.Option(help="A profile from `fitplan measure` on this GPU: its measured "
                                                 "rates replace the datasheet's.", rich_help_panel="Cluster")] = None

    def as_dict(self) -> dict[str, Any]:
        """The `cluster_options` of `solver.api.solve` / `cluster_from`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class AdapterOptions:
    """LoRA and its variants (QLoRA, DoRA, rsLoRA, modules_to_save), as PEFT's LoraConfig spells them."""

    OPTION_GROUP = True
    lora_rank: Annotated[int | None, number(int, 1, B.MAX_LORA_RANK, "Train LoRA adapters of this rank.")] = None
    lora_alpha: Annotated[int | None, number(int, 1, B.MAX_LORA_ALPHA, "LoRA alpha (default 2 x rank; needs "
                                             "--lora-rank).")] = None
    lora_targets: Annotated[str, text(1000, "LoRA target modules, comma-separated (needs --lora-rank).")
                            ] = "all-linear"
    lora_quantization: Annotated[Literal["nf4", "fp4"] | None, typer.Option(
        help="QLoRA: the frozen base in bitsandbytes 4-bit, nf4 or fp4 (needs --lora-rank; DDP and tp=1 only).")
    ] = None
    double_quant: Annotated[bool, typer.Option("--double-quant", help="QLoRA: quantize the 4-bit block scales again "
                                               "(bnb_4bit_use_double_quant; needs --lora-quantization).")] = False
    use_dora: Annotated[bool, typer.Option("--use-dora", help="DoRA: train a magnitude vector per adapted layer "
                                           "(LoraConfig(use_dora=True); needs --lora-rank).")] = False
    use_rslora: Annotated[bool, typer.Option("--use-rslora", help="rsLoRA: scale the adapters by alpha/sqrt(rank) "
                                             "(LoraConfig(use_rslora=True); no memory or time change; needs "
                                             "--lora-rank).")] = False
    modules_to_save: Annotated[str | None, text(1000, "Modules trained in full beside the adapters, comma-separated, "
                                                "e.g. lm_head,embed_tokens (LoraConfig(modules_to_save=...); their "
                                                "gradients and optimizer states are priced; needs --lora-rank).",
                                                "--modules-to-save")] = None
    kbit_preparation: Annotated[bool, typer.Option(
        "--kbit-preparation", help="QLoRA: your training script calls PEFT's prepare_model_for_kbit_training (every "
        "16-bit parameter outside the 4-bit layers in fp32, as PEFT's QLoRA examples and TRL's SFTTrainer before "
        "1.0 do); hf and accelerate files only; needs --lora-quantization.")] = False

    def spec(self) -> LoraSpec | None:
        """The adapters asked for, or None; a flag that describes adapters without --lora-rank is refused (it would
        be dropped silently)."""
        named = {"--lora-quantization": self.lora_quantization, "--double-quant": self.double_quant,
                 "--use-dora": self.use_dora, "--use-rslora": self.use_rslora,
                 "--modules-to-save": self.modules_to_save, "--kbit-preparation": self.kbit_preparation}
        flags = [flag for flag, value in named.items() if value]
        if self.lora_rank is None and (self.lora_alpha is not None or self.lora_targets != "all-linear" or flags):
            given = "--lora-alpha" if self.lora_alpha is not None else flags[0] if flags else \
                f"--lora-targets {self.lora_targets!r}"
            raise FitplanError(f"{given} needs --lora-rank: without it no adapters are trained.",
                               "Add --lora-rank R (e.g. 16), or drop the option.")
        if self.double_quant and not self.lora_quantization:
            raise FitplanError("--double-quant needs --lora-quantization nf4 or fp4 (it quantizes the 4-bit scales).",
                               "Add --lora-quantization nf4, or drop --double-quant.")
        if self.lora_rank is None:
            return None
        return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha or 2 * self.lora_rank,
                        targets=tuple(t.strip() for t in self.lora_targets.split(",")),  # "" refused by name
                        quantization=self.lora_quantization, double_quant=self.double_quant,
                        use_dora=self.use_dora, use_rslora=self.use_rslora,
                        modules_to_save=_listed(self.modules_to_save or ""))


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """Where `solve` writes besides stdout."""

    OPTION_GROUP = True
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the plan JSON here.")] = None
    emit: Annotated[str | None, text(200, "Launcher files to write, comma-separated: torchrun, accelerate, hf, "
                                     "deepspeed, axolotl, torchtitan, megatron (alone, it also restricts the search "
                                     "to what the first one runs).")] = None
    emit_dir: Annotated[Path, typer.Option(help="Where --emit writes.")] = Path("fitplan-out")
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the memory breakdown and the trade-off.")] = None
    force: Annotated[bool, typer.Option(help="Overwrite existing files (-o, --emit-dir, --plot).")] = False


# The groups' defaults as command defaults (the wrapper always passes the parsed values).
NO_ADAPTERS, NO_OUTPUTS, STRING_CLUSTER = AdapterOptions(), OutputOptions(), ClusterOptions()


def _listed(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())
