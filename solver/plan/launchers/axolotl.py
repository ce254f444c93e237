"""axolotl's YAML config (axolotl 0.19 field names, `axolotl.utils.schemas`) and its launch line; DeepSpeed plans
reuse the emitted ds_config.json, FSDP2 plans axolotl's `fsdp_config`. What axolotl cannot run as decided is refused
by the registry (`solver.plan.capability`), never dropped here."""

from __future__ import annotations

import json
from typing import Any

import yaml

from costmodels import Engine, Offload
from costmodels.config import Config, Loss
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
from solver.plan.launchers.hf import OPTIM
from solver.plan.launchers.nodes import MASTER_ADDR, MASTER_PORT, NODE_RANK, nodes_note
from solver.plan.launchers.shell import Env, launch_script
from solver.plan.launchers.torchtitan import STEPS
from solver.plan.record import Plan

CONFIG = "axolotl_config.yaml"
# axolotl 0.19 datasets of `type: _synthetic` (schemas/datasets.py SyntheticDataset) are random token rows of
# `sequence_length`: the files run as emitted, as the torchrun script trains on random tokens, until the user
# names a dataset.
SYNTHETIC = {"path": "synthetic", "type": "_synthetic"}
# Liger's patch as the plan prices it: the fused linear cross-entropy (costmodels/loss.py) and the kernels the layers
# are lowered with (graphs/liger.py `LIGER_KERNELS`, as HF Trainer's use_liger_kernel applies them). axolotl 0.19's
# LigerPlugin passes each liger_* switch to liger-kernel's apply function (liger_glu_activation as its swiglu), so
# every one is written out.
LIGER_PLUGIN = "axolotl.integrations.liger.LigerPlugin"
LIGER_SWITCHES = {"liger_fused_linear_cross_entropy": True, "liger_rope": LIGER_KERNELS["rope"],
                  "liger_rms_norm": LIGER_KERNELS["rms_norm"], "liger_glu_activation": LIGER_KERNELS["swiglu"],
                  "liger_cross_entropy": LIGER_KERNELS["cross_entropy"], "liger_layer_norm": False}

LORA_KERNELS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")

# axolotl 0.19 loaders/utils.py `get_linear_embedding_layers`: the embedding modules its loader casts, by model type.
EMBEDDING_MODULES = {"gpt_neox": ("embed_in", "embed_out"), "falcon": ("word_embeddings", "lm_head")}


def kbit_preparation(model_type: str, config: Config) -> tuple[str, ...] | None:
    """What axolotl 0.19's loader does to a 4-bit base (loaders/model.py): `_prepare_model_for_quantization` calls
    PEFT's `prepare_model_for_kbit_training` (every 16-bit parameter outside the 4-bit layers to fp32) except under
    FSDP (QLoRA with FSDP, and fitplan's fsdp_config sets cpu_ram_efficient_loading) or DeepSpeed ZeRO-3; then
    `_configure_embedding_dtypes` casts the modules whose names contain "norm" and the model type's embedding
    modules back to the compute dtype (its flash-attention dtype fix, for every LoRA run but QLoRA under FSDP).
    Returns those module-name parts (`graphs.variant.Variant.kbit`), or None where PEFT's preparation is skipped."""
    if config.engine is Engine.FSDP2 or (config.engine is Engine.DEEPSPEED and config.zero == 3):
        return None
    return ("norm", *EMBEDDING_MODULES.get(model_type, ("embed_tokens", "lm_head")))


def model_path(plan: Plan) -> str:
    """What axolotl loads: a Hub id or a folder (a plan made from a config.json names the file; its folder)."""
    model = plan.inputs.model
    if model.endswith(".json"):
        return model.rsplit("/", 1)[0] if "/" in model else "."
    return model


def config(plan: Plan) -> dict[str, Any]:
    """axolotl's config for the plan, every key as axolotl spells it."""
    d, inputs = plan.decisions, plan.inputs
    result: dict[str, Any] = {
        "base_model": model_path(plan), "model_type": "AutoModelForCausalLM", "tokenizer_type": "AutoTokenizer",
        "datasets": [{**SYNTHETIC, "length": inputs.global_batch * STEPS, "sequence_length": inputs.seq_len,
                      "seed": 0}],
        "val_set_size": 0.0, "output_dir": "fitplan-run",
        "sequence_len": inputs.seq_len, **_packing(plan),
        "micro_batch_size": d.micro_batch, "gradient_accumulation_steps": d.grad_accum,
        "num_epochs": 1, "max_steps": STEPS,
        "optimizer": OPTIM[d.optimizer], "learning_rate": LEARNING_RATE, "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1], "adam_epsilon": EPS, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM,
        **precision_flags(plan),
        "attn_implementation": d.attention,
        "torch_compile": d.compile,
        "dataloader_num_workers": d.dataloader_num_workers, "dataloader_pin_memory": d.dataloader_pin_memory,
    }
    every_layer = bool(checkpointed_layers(plan)) and all_checkpointed(plan)
    if every_layer and d.engine is not Engine.FSDP2:  # FSDP2 checkpoints through fsdp_config instead
        result["gradient_checkpointing"] = True
        result["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if d.loss is Loss.FUSED_LINEAR:
        result["plugins"] = [LIGER_PLUGIN]
        result.update(LIGER_SWITCHES)
    result.update(_adapters(plan))
    result.update(_engine(plan, every_layer=every_layer))
    return result


def _packing(plan: Plan) -> dict[str, Any]:
    """Sample packing as the plan's rows were priced: full rows of seq_len tokens unless the plan was made from
    dataset lengths without packing (then each micro-batch is padded to its longest sequence)."""
    packed = plan.inputs.packing != "none"
    return {"sample_packing": packed, "pad_to_sequence_len": packed, "eval_sample_packing": False}


def _adapters(plan: Plan) -> dict[str, Any]:
    """LoRA/QLoRA/DoRA as axolotl 0.19 loads them (loaders/adapter.py load_lora builds PEFT's LoraConfig from
    these keys; loaders/model.py builds BitsAndBytesConfig for 4-bit bases, nf4 with double quantisation unless
    `bnb_config_kwargs` says otherwise)."""
    lora = plan.decisions.lora
    if lora is None:
        return {}
    four_bit, eight_bit = lora.quantization in ("nf4", "fp4"), lora.quantization == "int8"
    result: dict[str, Any] = {
        "adapter": "qlora" if four_bit else "lora", "load_in_4bit": four_bit, "load_in_8bit": eight_bit,
        "lora_r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        # passed to PEFT as given: "all-linear" is PEFT's own rule (every linear layer but the output head)
        "lora_target_modules": "all-linear" if list(lora.targets) == ["all-linear"] else list(lora.targets),
        "peft_use_dora": lora.use_dora, "peft_use_rslora": lora.use_rslora,
        # PEFT's default, fp32 adapters, as the lowering prices them under autocast (graphs.lora.apply_lora;
        # DeepSpeed and FSDP2 run them in 16 bits either way)
        "peft_autocast_adapter_dtype": True,
        # axolotl 0.19 swaps PEFT's LoRA forward for its own fused Triton kernels unless these are false
        # (schemas/config.py auto-enables them on one GPU, DDP and FSDP2); fitplan traced PEFT's modules
        **dict.fromkeys(LORA_KERNELS, False),
    }
    if lora.modules_to_save:
        result["lora_modules_to_save"] = list(lora.modules_to_save)
    if four_bit:
        result["bnb_config_kwargs"] = {"bnb_4bit_quant_type": lora.quantization,
                                       "bnb_4bit_use_double_quant": lora.double_quant}
    return result


def _engine(plan: Plan, *, every_layer: bool) -> dict[str, Any]:
    """DeepSpeed through the emitted ds_config.json; FSDP2 through axolotl's fsdp_config (0.19 names, without the
    fsdp_ prefix); DDP needs nothing."""
    d = plan.decisions
    if d.engine is Engine.DEEPSPEED:
        return {"deepspeed": "ds_config.json"}
    if d.engine is Engine.FSDP2:
        return {"fsdp_version": 2, "fsdp_config": {
            "reshard_after_forward": d.zero == 3, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": layer_class(plan), "offload_params": d.param_offload is not Offload.NONE,
            "activation_checkpointing": every_layer, "cpu_ram_efficient_loading": True,
            "state_dict_type": "SHARDED_STATE_DICT"}}
    return {}


def launch_argv(plan: Plan) -> list[str | Env]:
    """`accelerate launch -m axolotl.cli.train` (what `axolotl train` runs), one process per GPU on each node."""
    cluster, d = plan.inputs.cluster, plan.decisions
    world = d.tp * d.dp
    return ["accelerate", "launch", "--num_processes", str(world), "--num_machines", str(cluster.nodes),
            "--machine_rank", NODE_RANK, "--main_process_ip", MASTER_ADDR, "--main_process_port", MASTER_PORT,
            *(["--multi_gpu"] if world > 1 else []), "-m", "axolotl.cli.train", CONFIG]


def emit(plan: Plan) -> dict[str, str]:
    from solver.plan.launchers.deepspeed import config as deepspeed_config

    notes = nodes_note(plan) + "\nOn one node `axolotl train axolotl_config.yaml` runs the same."
    files = {CONFIG: yaml.safe_dump(config(plan), sort_keys=False),
             "axolotl_launch.sh": launch_script(launch_argv(plan), about=about(plan),
                                                environment=launch_environment(plan), notes=notes)}
    if plan.decisions.engine is Engine.DEEPSPEED:
        files["ds_config.json"] = json.dumps(deepspeed_config(plan, hidden=plan.inputs.hidden_size), indent=2) + "\n"
    return files
