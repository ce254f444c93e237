"""Hugging Face `TrainingArguments` keyword arguments (transformers 5.x names), plus the per-layer
checkpointing snippet when only some layers are checkpointed."""

from __future__ import annotations

import json
from typing import Any

import yaml

from costmodels import Engine, Offload, Optimizer
from costmodels.config import Loss
from graphs.liger import LIGER_KERNELS
from solver.plan.launchers.common import (
    BETAS,
    EPS,
    LEARNING_RATE,
    MAX_GRAD_NORM,
    WEIGHT_DECAY,
    about,
    all_checkpointed,
    checkpointed_layers,
    launch_environment,
    layer_class,
    precision_flags,
)
from solver.plan.launchers.shell import comment, exports
from solver.plan.launchers.templating import python_file
from solver.plan.record import Plan

# transformers 5.24 `OptimizerNames`; `adamw_hf` no longer exists (removed in 5.x). The paged ones build
# bitsandbytes' PagedAdamW (optim_bits 8 or 32) in `Trainer.get_optimizer_cls_and_kwargs`.
OPTIM = {Optimizer.ADAMW: "adamw_torch", Optimizer.ADAMW_FUSED: "adamw_torch_fused",
         Optimizer.ADAFACTOR: "adafactor", Optimizer.ADAMW_8BIT: "adamw_bnb_8bit", Optimizer.SGD: "sgd",
         Optimizer.PAGED_ADAMW_8BIT: "paged_adamw_8bit", Optimizer.PAGED_ADAMW_32BIT: "paged_adamw_32bit"}
# transformers 5.24 `Trainer.train` passes `liger_kernel_config` to liger-kernel's `_apply_liger_kernel_to_instance`
# as keyword arguments (integrations/liger.py `apply_liger_kernel`). The plan prices the whole patch: the fused
# linear cross-entropy (costmodels/loss.py) and the RMSNorm, SwiGLU and RoPE kernels the layers are lowered with
# (graphs/liger.py `LIGER_KERNELS`, liger-kernel 0.8.5's defaults, spelled out).
LIGER_KERNEL_CONFIG = {"fused_linear_cross_entropy": True, **LIGER_KERNELS}


def training_arguments(plan: Plan) -> dict[str, Any]:
    d = plan.decisions
    kwargs: dict[str, Any] = {
        "output_dir": "fitplan-run",
        "per_device_train_batch_size": d.micro_batch,
        "gradient_accumulation_steps": d.grad_accum,
        "learning_rate": LEARNING_RATE, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_epsilon": EPS,
        "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM,
        "optim": OPTIM[d.optimizer],
        **precision_flags(plan),
        "torch_compile": d.compile,
        "dataloader_num_workers": d.dataloader_num_workers, "dataloader_pin_memory": d.dataloader_pin_memory,
    }
    if d.loss is Loss.FUSED_LINEAR:
        kwargs["use_liger_kernel"] = True
        kwargs["liger_kernel_config"] = dict(LIGER_KERNEL_CONFIG)
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name is a deprecated
    # alias until v6). With FSDP, checkpointing goes through fsdp_config instead (the Trainer flag adds a
    # redundant all-gather: transformers #30404). Only when every layer is checkpointed: Trainer.train() (5.24)
    # turns checkpointing on for every layer when the flag is set, undoing the per-layer snippet.
    every_layer = bool(checkpointed_layers(plan)) and all_checkpointed(plan)
    if every_layer and d.engine is not Engine.FSDP2:
        kwargs["activation_checkpointing"] = True
        kwargs["activation_checkpointing_kwargs"] = {"use_reentrant": False}
    if d.engine is Engine.DEEPSPEED:
        kwargs["deepspeed"] = "ds_config.json"
    elif d.engine is Engine.FSDP2:
        # transformers 5.x: `fsdp=True` with everything in fsdp_config (the string form is deprecated).
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = {
            "version": 2, "reshard_after_forward": d.zero == 3, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": [layer_class(plan)], "cpu_offload": d.param_offload is not Offload.NONE,
            "activation_checkpointing": every_layer, "cpu_ram_efficient_loading": True,
            "state_dict_type": "SHARDED_STATE_DICT"}
    return kwargs


def checkpoint_snippet(plan: Plan) -> str:
    """Python that keeps only the planned layers checkpointed (HF flags are per layer since transformers 4.57)."""
    layers = checkpointed_layers(plan)
    values = {"LAYERS": str(len(plan.decisions.checkpoint)), "CHECKPOINTED": f"{set(layers) or 'set()'}"}
    return python_file(("fitplan_checkpointing.py",), values, name="fitplan_checkpointing.py")


def adapter_config(plan: Plan) -> str:
    """PEFT's adapter_config.json for the plan's LoRA decision (`LoraConfig.to_dict()`, DoRA's use_dora included)."""
    values = plan.decisions.lora.spec().peft_config().to_dict()
    return json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in values.items()}, indent=2,
                      default=str) + "\n"


def quantization_config(plan: Plan) -> str | None:
    """transformers' BitsAndBytesConfig (`to_dict()`) that loads the plan's QLoRA base, computing in the plan's
    16-bit dtype (None without a quantized base): pass it as `quantization_config=BitsAndBytesConfig.from_dict(...)`
    to `from_pretrained`."""
    from costmodels import precision
    from graphs.adapters import Quantization
    from graphs.quantization import bnb_config

    lora = plan.decisions.lora
    if lora is None or lora.quantization is None:
        return None
    config = bnb_config(Quantization(lora.quantization), double_quant=lora.double_quant,
                        compute_dtype=precision.compute_dtype(plan.decisions.precision))
    return json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"


def emit(plan: Plan) -> dict[str, str]:
    files = {"training_args.yaml": yaml.safe_dump(training_arguments(plan), sort_keys=False),
             "training_args.json": json.dumps(training_arguments(plan), indent=2) + "\n"}
    if plan.decisions.lora:  # load with peft.LoraConfig.from_pretrained(folder) and get_peft_model
        files["adapter_config.json"] = adapter_config(plan)
    quantized = quantization_config(plan)
    if quantized:  # from_pretrained(..., quantization_config=BitsAndBytesConfig.from_dict(json.load(f)))
        files["quantization_config.json"] = quantized
    if checkpointed_layers(plan) and not all_checkpointed(plan):
        files["fitplan_checkpointing.py"] = checkpoint_snippet(plan)
    environment = launch_environment(plan)
    if environment:  # the Trainer is started by the user's own command: the variables it needs, to source first
        files["fitplan_env.sh"] = comment(f"{about(plan)}\nSource this file before starting your training script "
                                          "(the plan's memory assumes it).") + exports(environment)
    return files
