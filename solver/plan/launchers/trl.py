"""TRL's `SFTConfig` keyword arguments (trl 1.16 names): the plan's `TrainingArguments` (SFTConfig extends them)
plus the sequence length and packing the plan's rows were priced with, for `SFTTrainer`."""

from __future__ import annotations

import json
import shlex
from typing import Any

from solver.plan.launchers.hf import training_arguments
from solver.plan.record import Plan

# Launchers whose files start TRL's trainers: the Trainer/TRL configs (hf), and accelerate or DeepSpeed launching
# the user's TRL script with them.
POST_TRAINING_RUNNERS = ("hf", "accelerate", "deepspeed")


def sft_config(plan: Plan) -> dict[str, Any]:
    """`SFTConfig(**kwargs)`. Rows are priced full at seq_len tokens unless the plan came from dataset lengths
    without packing (then each micro-batch is padded to its longest sequence, with no rounding up); TRL's "bfd"
    packing also runs padding-free (sequences flattened into one row, which needs a FlashAttention
    `attn_implementation`)."""
    packing = plan.inputs.packing
    packed = packing != "none"
    kwargs: dict[str, Any] = {**training_arguments(plan), "max_length": plan.inputs.seq_len, "packing": packed}
    if packed:
        kwargs["packing_strategy"] = "wrapped" if packing == "wrapped" else "bfd"
    else:
        kwargs["pad_to_multiple_of"] = None  # trl's "auto" would round each micro-batch up to 128 tokens
    return kwargs


def dpo_config(plan: Plan) -> dict[str, Any]:
    """`DPOConfig(**kwargs)` (KTO's `KTOConfig` takes the same keys): per_device_train_batch_size counts pairs
    (the plan's micro-batch counts the sequences, chosen and rejected), the reference strategy as TRL spells it."""
    post = plan.post_training
    assert post is not None
    kwargs: dict[str, Any] = {**training_arguments(plan),
                              "per_device_train_batch_size": post.per_device_train_batch_size,
                              "max_length": plan.inputs.seq_len, "beta": post.beta,
                              "precompute_ref_log_probs": post.reference == "precomputed"}
    if post.task == "orpo":
        kwargs.pop("precompute_ref_log_probs")
    return kwargs


def grpo_config(plan: Plan) -> dict[str, Any]:
    """`GRPOConfig(**kwargs)`: completions per device, the group size, completion length, beta, and the vLLM engine
    as planned (trl 1.16 names: `vllm_mode`, `vllm_gpu_memory_utilization`, `vllm_tensor_parallel_size`,
    `vllm_enable_sleep_mode`). Generation happens once per optimizer step (`steps_per_generation` = accumulation),
    as priced."""
    post = plan.post_training
    assert post is not None and post.generation is not None
    engine = post.generation
    kwargs: dict[str, Any] = {**training_arguments(plan), "num_generations": post.num_generations,
                              "max_completion_length": post.completion_len, "beta": post.beta,
                              "steps_per_generation": plan.decisions.grad_accum, "use_vllm": True,
                              "vllm_mode": engine.vllm_mode}
    if engine.vllm_mode == "colocate":
        kwargs.update(vllm_gpu_memory_utilization=engine.vllm_gpu_memory_utilization,
                      vllm_tensor_parallel_size=engine.vllm_tensor_parallel_size,
                      vllm_enable_sleep_mode=engine.vllm_enable_sleep_mode)
    return kwargs


def vllm_serve_command(plan: Plan) -> str:
    """The `trl vllm-serve` line for a server-mode plan: its own GPUs, tensor- and data-parallel sizes and share."""
    post = plan.post_training
    assert post is not None and post.generation is not None
    g = post.generation
    words = ["trl", "vllm-serve", "--model", plan.inputs.model, "--tensor-parallel-size",
             str(g.vllm_tensor_parallel_size), "--data-parallel-size",
             str(g.generation_gpus // g.vllm_tensor_parallel_size), "--gpu-memory-utilization",
             str(g.vllm_gpu_memory_utilization), "--max-model-len", str(plan.inputs.seq_len)]
    first = g.training_gpus
    devices = ",".join(str(i) for i in range(first, first + g.generation_gpus))
    return f"CUDA_VISIBLE_DEVICES={devices} " + " ".join(shlex.quote(w) for w in words) + "\n"


def emit(plan: Plan) -> dict[str, str]:
    """TRL's config files beside the Trainer's: `trl.SFTConfig(**json.load(open("sft_config.json")))`, or the
    post-training trainer's (`dpo_config.json`, `kto_config.json`, `orpo_config.json`, `grpo_config.json`, and
    for a vLLM server `vllm_serve.sh`, started on its GPUs before training on the others)."""
    post = plan.post_training
    if post is None:
        return {"sft_config.json": json.dumps(sft_config(plan), indent=2) + "\n"}
    if post.task != "grpo":
        return {f"{post.task}_config.json": json.dumps(dpo_config(plan), indent=2) + "\n"}
    files = {"grpo_config.json": json.dumps(grpo_config(plan), indent=2) + "\n"}
    if post.generation is not None and post.generation.vllm_mode == "server":
        files["vllm_serve.sh"] = "#!/usr/bin/env bash\nset -euo pipefail\n" + vllm_serve_command(plan)
    return files
