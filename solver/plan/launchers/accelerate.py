"""accelerate config YAML (accelerate 1.x keys; FSDP2 via `fsdp_version: 2`, TP via `parallelism_config`)."""

from __future__ import annotations

from typing import Any

import yaml

from costmodels import Engine, Offload
from solver.plan.launchers.common import about, all_checkpointed, checkpointed_layers, launch_environment, layer_class
from solver.plan.launchers.nodes import DEFAULT_PORT, MASTER_ADDR, MASTER_PORT, NODE_RANK, nodes_note
from solver.plan.launchers.shell import launch_script
from solver.plan.record import Plan


def config(plan: Plan) -> dict[str, Any]:
    d, cluster = plan.decisions, plan.inputs.cluster
    cpu = cluster.gpu == "cpu"
    precision = {"bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16", "fp8": "fp8"}.get(d.precision.value, "no")
    result: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0,
        "main_training_function": "main", "mixed_precision": precision,
        "num_machines": cluster.nodes, "num_processes": d.tp * d.dp, "rdzv_backend": "static",
        "main_process_port": int(DEFAULT_PORT),
        "same_network": True, "use_cpu": cpu, "downcast_bf16": "no",
    }
    if d.engine is Engine.FSDP2:
        result["distributed_type"] = "FSDP"
        # FSDP2 replaces fsdp_sharding_strategy by fsdp_reshard_after_forward (accelerate fsdp1_vs_fsdp2 guide).
        result["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_reshard_after_forward": d.zero == 3,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": layer_class(plan),
            "fsdp_offload_params": d.param_offload is not Offload.NONE,
            # FSDP's own checkpointing wraps every layer; a partial plan uses the per-layer snippet instead.
            "fsdp_activation_checkpointing": expresses_checkpointing(plan),
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
    elif d.engine is Engine.DEEPSPEED:
        result["distributed_type"] = "DEEPSPEED"
        result["deepspeed_config"] = {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": d.zero == 3}
        if cluster.nodes > 1:
            # "standard" starts each node like torchrun (num_processes / num_machines per node, this node's
            # machine_rank), instead of pdsh from node 0, which needs a hostfile accelerate does not emit.
            result["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
        if precision != "no":
            result.pop("mixed_precision")  # the DeepSpeed JSON holds the precision block
    else:
        result["distributed_type"] = "MULTI_CPU" if cpu and d.tp * d.dp > 1 else \
            "MULTI_GPU" if d.tp * d.dp > 1 else "NO"
    if precision == "fp8":
        # accelerate 1.15 picks the fp8 backend from fp8_config (ACCELERATE_FP8_BACKEND); AO is torchao float8,
        # which `accelerate launch` requires installed (utils/launch.py: is_fp8_available) rather than running bf16.
        result["fp8_config"] = {"backend": "AO"}
    if d.compile:
        result["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    if d.tp > 1:
        result["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": d.dp,
            "parallelism_config_tp_size": d.tp, "parallelism_config_cp_size": 1}
    return result


def expresses_checkpointing(plan: Plan) -> bool:
    """Whether the config itself checkpoints the planned layers (only FSDP's all-layer switch exists)."""
    return plan.decisions.engine is Engine.FSDP2 and bool(checkpointed_layers(plan)) and all_checkpointed(plan)


def checkpointing_entry(plan: Plan) -> list[str]:
    """The program in front of train.py that applies the plan's layers (fitplan_checkpointing.py, written beside the
    config) where the config cannot express them; none otherwise."""
    return ["fitplan_checkpointing.py"] if checkpointed_layers(plan) and not expresses_checkpointing(plan) else []


def emit(plan: Plan) -> dict[str, str]:
    # The YAML holds what is the same on every node; this node's rank and the rendezvous come from the
    # environment (accelerate launch flags override the config file).
    argv = ["accelerate", "launch", "--config_file", "accelerate_config.yaml", "--num_machines",
            str(plan.inputs.cluster.nodes), "--machine_rank", NODE_RANK, "--main_process_ip", MASTER_ADDR,
            "--main_process_port", MASTER_PORT, *checkpointing_entry(plan), "train.py"]
    launch = launch_script(argv, about=about(plan), environment=launch_environment(plan), forward=True,
                           notes=nodes_note(plan))
    files = {"accelerate_config.yaml": yaml.safe_dump(config(plan), sort_keys=False), "accelerate_launch.sh": launch}
    if plan.decisions.lora:
        from solver.plan.launchers.hf import adapter_config, quantization_config

        files["adapter_config.json"] = adapter_config(plan)
        quantized = quantization_config(plan)
        if quantized:
            files["quantization_config.json"] = quantized
    return files
