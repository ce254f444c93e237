"""DeepSpeed config JSON (keys as in DeepSpeed 0.19 `docs/_pages/config-json.md`), every value explicit."""

from __future__ import annotations

import json
from typing import Any

from costmodels import Engine, Offload, Optimizer
from costmodels.zero import persistence_threshold, prefetch_bucket_elements, reduce_bucket_elements
from solver.plan.launchers.common import (
    BETAS,
    EPS,
    LEARNING_RATE,
    MAX_GRAD_NORM,
    WEIGHT_DECAY,
    about,
    launch_environment,
)
from solver.plan.launchers.nodes import MASTER_PORT, hostfile
from solver.plan.launchers.shell import Env, env, launch_script
from solver.plan.launchers.templating import python_file
from solver.plan.record import Plan

NVME_PATH = "/local_nvme"


def config(plan: Plan, *, hidden: int) -> dict[str, Any]:
    d = plan.decisions
    world = d.tp * d.dp
    zero: dict[str, Any] = {
        "stage": d.zero, "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
        "reduce_bucket_size": reduce_bucket_elements(hidden), "allgather_partitions": True,
        "allgather_bucket_size": reduce_bucket_elements(hidden), "round_robin_gradients": False,
    }
    if d.zero == 3:
        zero.update({"stage3_prefetch_bucket_size": prefetch_bucket_elements(hidden),
                     "stage3_param_persistence_threshold": persistence_threshold(hidden),
                     "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                     "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 1_000_000_000})
    if d.optimizer_offload is not Offload.NONE:
        # pin_memory's default flipped to true in DeepSpeed PR #8207 (v0.19.5): written explicitly.
        zero["offload_optimizer"] = _offload(d.optimizer_offload)
    if d.param_offload is not Offload.NONE:
        zero["offload_param"] = _offload(d.param_offload)
    result: dict[str, Any] = {
        "train_batch_size": d.micro_batch * d.grad_accum * d.dp,
        "train_micro_batch_size_per_gpu": d.micro_batch,
        "gradient_accumulation_steps": d.grad_accum,
        "gradient_clipping": MAX_GRAD_NORM,
        "zero_optimization": zero,
        # Only Megatron-style code calls deepspeed.checkpointing; HF models checkpoint with their own flags.
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False, "number_checkpoints": None,
                                     "synchronize_checkpoint_boundary": False, "profile": False},
        "steps_per_print": 10, "wall_clock_breakdown": False,
    }
    result.update(_precision(plan))
    optimizer = _optimizer(d.optimizer)
    if optimizer:
        result["optimizer"] = optimizer
    else:
        result["zero_allow_untested_optimizer"] = True  # the trainer builds Adafactor / 8-bit / SGD itself
    if world != d.dp:
        result["tensor_parallel"] = {"autotp_size": d.tp}
    return result


def _offload(kind: Offload) -> dict[str, Any]:
    block: dict[str, Any] = {"device": kind.value, "pin_memory": True}
    if kind is Offload.NVME:
        block["nvme_path"] = NVME_PATH
    return block


def _precision(plan: Plan) -> dict[str, Any]:
    p = plan.decisions.precision.value
    if p == "fp16-mixed":
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                         "hysteresis": 2, "min_loss_scale": 1}, "bf16": {"enabled": False}}
    if p == "fp8":  # refused by `capability.unsupported`: DeepSpeed's config has no fp8 field
        raise ValueError("DeepSpeed's config has no fp8 field; the Megatron launcher runs fp8 plans")
    if p == "bf16-mixed":
        return {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
    if p == "bf16":  # pure bf16: no fp32 master weights
        return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                "fp16": {"enabled": False}}
    return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}


def _optimizer(optimizer: Optimizer) -> dict[str, Any] | None:
    if optimizer not in (Optimizer.ADAMW, Optimizer.ADAMW_FUSED):
        return None
    return {"type": "AdamW", "params": {"lr": LEARNING_RATE, "betas": list(BETAS), "eps": EPS,
                                        "weight_decay": WEIGHT_DECAY}}


def _nodes_note(nodes: int) -> str:
    if nodes == 1:
        return ""
    return (f"{nodes} nodes: fill in hostfile, then run this script on node0 only (deepspeed starts the other nodes "
            "over ssh); MASTER_ADDR defaults to node0.")


def moe_leaves(plan: Plan) -> bool:
    """ZeRO-3 on an MoE model: DeepSpeed needs each MoE block marked a ZeRO-3 leaf (`set_z3_leaf_modules`)."""
    shape = plan.inputs.shape
    return plan.decisions.zero == 3 and shape is not None and shape.experts > 0


def entry_point(plan: Plan) -> str | None:
    """fitplan_deepspeed.py, which runs the user's script with what ds_config.json cannot say (torch.compile, MoE
    leaves under ZeRO-3), or None when the config says it all."""
    if not (plan.decisions.compile or moe_leaves(plan)):
        return None
    values = {"COMPILE": repr(bool(plan.decisions.compile)), "MOE_LEAVES": repr(moe_leaves(plan))}
    return python_file(("fitplan_deepspeed.py",), values, name="fitplan_deepspeed.py")


def emit(plan: Plan, *, hidden: int) -> dict[str, str]:
    if plan.decisions.engine is not Engine.DEEPSPEED:
        return {}
    cluster = plan.inputs.cluster
    # Beyond one node the deepspeed runner reads the hosts from a hostfile (pdsh/ssh from node 0); one node
    # runs locally without one ("Num nodes is >1 but no extra nodes available via hostfile" otherwise).
    hosts: list[str | Env] = ["--hostfile", "hostfile", "--master_addr", env("MASTER_ADDR", "node0"),
                              "--master_port", MASTER_PORT] if cluster.nodes > 1 else []
    entry = entry_point(plan)
    program = ["fitplan_deepspeed.py"] if entry else []
    argv = ["deepspeed", *hosts, "--num_nodes", str(cluster.nodes), "--num_gpus", str(cluster.gpus_per_node),
            *program, "train.py", "--deepspeed", "ds_config.json"]
    files = {"ds_config.json": json.dumps(config(plan, hidden=hidden), indent=2) + "\n",
             "deepspeed_launch.sh": launch_script(argv, about=about(plan), environment=launch_environment(plan),
                                                  notes=_nodes_note(cluster.nodes))}
    if entry:
        files["fitplan_deepspeed.py"] = entry
    if cluster.nodes > 1:
        files["hostfile"] = hostfile(plan)
        environment = launch_environment(plan)
        if environment:  # the pdsh runner passes NCCL_* and a few others on; the rest from .deepspeed_env
            files[".deepspeed_env"] = "".join(f"{name}={value}\n" for name, value in environment.items())
    return files
