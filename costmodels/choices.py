"""The knobs' choices as string enums (they print and serialise as their values): the bottom of costmodels, which
every cost module and the engines' rules read."""

from __future__ import annotations

from enum import Enum


def require_positive_int(name: str, value: object) -> None:
    """Raise ValueError unless `value` is an int >= 1 (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


class _Choice(str, Enum):
    def __str__(self) -> str:
        return self.value


class Precision(_Choice):
    """Number formats of weights, gradients and compute."""

    FP32 = "fp32"
    TF32 = "tf32"  # fp32 storage, matmuls on TF32 tensor cores (Ampere and newer)
    FP16_MIXED = "fp16-mixed"  # fp16 compute, fp32 master weights, dynamic loss scaling
    BF16_MIXED = "bf16-mixed"  # bf16 compute, fp32 master weights
    BF16 = "bf16"  # pure bf16: weights, gradients and optimizer states in bf16, no master copy
    FP8 = "fp8"  # bf16-mixed with fp8 matmuls in the linear layers (Transformer Engine / torchao float8)


class Optimizer(_Choice):
    ADAMW = "adamw"  # torch.optim.AdamW, foreach implementation (the CUDA default)
    ADAMW_FUSED = "adamw-fused"  # torch.optim.AdamW(fused=True)
    ADAFACTOR = "adafactor"  # factored second moment, no first moment
    ADAMW_8BIT = "adamw-8bit"  # bitsandbytes AdamW8bit: blockwise-quantised uint8 moments
    SGD = "sgd"  # SGD with momentum
    # bitsandbytes PagedAdamW8bit / PagedAdamW32bit: AdamW8bit's / 32-bit AdamW's states in CUDA unified memory,
    # paged to host RAM under device-memory pressure (costmodels/paging.py)
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"
    PAGED_ADAMW_32BIT = "paged-adamw-32bit"
    # Megatron's precision-aware Adam (--use-precision-aware-optimizer, Transformer Engine's FusedAdam): bf16
    # moments and main gradients, fp32 master weights kept as the 16-bit remainders of the bf16 weights
    ADAMW_BF16 = "adamw-bf16"


# bitsandbytes' optimizers: their CUDA kernels update device (or unified-memory) tensors only.
BNB_OPTIMIZERS = (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT)


class Loss(_Choice):
    """How the LM head's cross-entropy is computed (costmodels/loss.py)."""

    HF = "hf"  # transformers ForCausalLMLoss: 16-bit logits, fp32 upcast, log-softmax saved
    CHUNKED = "chunked"  # torchtune CEWithChunkedOutputLoss: head and upcast per chunk of the sequence
    # Liger's whole patch (use_liger_kernel): LigerFusedLinearCrossEntropyLoss (no full logits, gradients in
    # forward) with its RMSNorm, SwiGLU and RoPE kernels in the layers (graphs/liger.py)
    FUSED_LINEAR = "fused-linear"
    # Runtimes fitplan prices but emits no launcher for (estimate only; the search never opens them):
    # Megatron's vocab-parallel cross-entropy on the 16-bit logits (Megatron-LM's --fp16-lm-cross-entropy in its
    # legacy GPT model, core_r0.4.0; Mist's runtime, fp16_lm_cross_entropy): no fp32 copy, softmax saved, gradient
    # in place. megatron-core 0.16 upcasts always, so fitplan's Megatron launcher cannot run it.
    MEGATRON_FP16 = "megatron-fp16"
    # flash-attn's fused CrossEntropyLoss (llm-foundry's default `loss_fn: fused_crossentropy`): the logits saved in
    # their own dtype with the log-sum-exp, no fp32 copy; its backward writes a gradient like the logits.
    FLASH = "flash"


# The losses of runtimes no fitplan launcher runs: priced by estimate for those runtimes' configurations, never
# searched, and refused by every launcher (solver/plan/capability.py).
RUNTIME_ONLY_LOSSES = (Loss.MEGATRON_FP16, Loss.FLASH)


class Engine(_Choice):
    """Which runtime shards and moves the model states; their buffers differ."""

    DDP = "ddp"  # plain PyTorch (DistributedDataParallel when dp > 1); autocast for mixed precision
    DEEPSPEED = "deepspeed"  # DeepSpeed ZeRO stages 0-3
    FSDP2 = "fsdp2"  # torch.distributed.fsdp.fully_shard; ZeRO-2/3-like via reshard_after_forward
    MEGATRON = "megatron"  # Megatron-LM's DistributedDataParallel; zero=1 is its distributed optimizer


class ContextParallel(_Choice):
    """How attention exchanges keys and values across the context-parallel ranks (costmodels/context_parallel.py)."""

    RING = "ring"  # ring attention: each rank passes its K/V shard around the ring, overlapped with attention
    ALL_TO_ALL = "all-to-all"  # DeepSpeed-Ulysses: all-to-all from sequence shards to head shards and back


class Offload(_Choice):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"
