"""The generation engine of online RL (TRL's GRPO with vLLM): its memory on a GPU (weights, paged KV cache as vLLM
sizes it), the time to generate a step's completions (prefill compute-bound, decode memory-bound and
batch-dependent), the trainer-to-engine weight sync and the extra log-prob passes; pure functions of numbers.

Not modelled: prefix caching across a prompt's group (vLLM shares the prompt's blocks; we count them per
completion, an upper bound), early stops (every completion runs to max_completion), speculative decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from .compute import DEFAULT_MAMF, MAMF, MEMORY_EFFICIENCY
from .hardware import GPU

# vLLM 0.34.0 (the release pip resolves today; it installs here only as a CUDA wheel, not for this CPU venv):
# `CacheConfig.DEFAULT_BLOCK_SIZE = 64` tokens per KV block and `DEFAULT_GPU_MEMORY_UTILIZATION = 0.92`
# (vllm/config/cache.py), the server's share; TRL colocates at `vllm_gpu_memory_utilization=0.3` by default
# (trl 1.16 trl/trainer/grpo_config.py).
VLLM_BLOCK_SIZE = 64
SERVER_MEMORY_UTILIZATION = 0.92
COLOCATE_DEFAULT_UTILIZATION = 0.3
GIB = 1 << 30


def scheduler_limits(gpu: GPU) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM 0.34.0 defaults to for its `LLM` class, which TRL builds in
    both modes (vllm/engine/arg_utils.py `get_batch_defaults`): 1024 / 16384 from 70 GiB (not A100), else 256 / 8192."""
    if gpu.memory_bytes >= 70 * GIB and "a100" not in gpu.id:
        return 1024, 16384
    return 256, 8192


# The activation peak of vLLM's profile run (a dummy forward of max_num_batched_tokens): per token, the residual
# stream, q/k/v and the attention output (4 x hidden), the MLP's gate/up/act (3 x intermediate), in 16-bit, plus
# the sampler's fp32 logits for max_num_seqs rows. fitplan's own count of `GPUModelRunner.profile_run`'s live
# tensors, not a measurement; vLLM measures it at start-up.
PROFILE_HIDDEN_TERMS, PROFILE_FFN_TERMS = 4, 3


class Placement(StrEnum):
    """Where TRL's vLLM engine runs (`GRPOConfig.vllm_mode`)."""

    COLOCATE = "colocate"
    """Inside each training process, sharing its GPU (a `gpu_memory_utilization` share)."""
    SERVER = "server"
    """`trl vllm-serve` on GPUs of its own; training on the rest."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """What generation cost depends on: sizes of the model (numbers from the lowered graph)."""

    params: int
    weight_bytes: int
    """Bytes of the weights in the engine's dtype (16-bit)."""
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Engine:
    """One vLLM engine's setting."""

    placement: Placement
    tp: int
    """vLLM tensor-parallel size (`vllm_tensor_parallel_size`)."""
    utilization: float
    """`gpu_memory_utilization`: the share of each GPU's memory vLLM may take."""
    sleep: bool = False
    """`vllm_enable_sleep_mode`: weights offloaded and KV cache freed while the trainer runs (colocate only)."""
    kv_itemsize: int = 2


def page_bytes(shape: ModelShape, engine: Engine, *, block_size: int = VLLM_BLOCK_SIZE) -> int:
    """Bytes of one KV block of one layer on one rank: vLLM's `AttentionSpec.real_page_size_bytes`,
    block_size x num_kv_heads x (head_size + head_size_v) x dtype size (vllm/v1/kv_cache_interface.py), with the KV
    heads split by TP (at least one per rank, replicated below)."""
    heads = max(1, shape.kv_heads // engine.tp)
    return 2 * block_size * heads * shape.head_dim * engine.kv_itemsize


def profile_activation_bytes(shape: ModelShape, engine: Engine, gpu: GPU) -> int:
    """The activation peak vLLM's profile run measures on one rank (see PROFILE_* above)."""
    seqs, tokens = scheduler_limits(gpu)
    per_token = (PROFILE_HIDDEN_TERMS * shape.hidden + PROFILE_FFN_TERMS * shape.intermediate // engine.tp) * 2
    return tokens * per_token + seqs * shape.vocab * 4


def kv_cache_bytes(shape: ModelShape, engine: Engine, gpu: GPU) -> int:
    """KV cache bytes on one rank: vLLM's `Worker.determine_available_memory` (vllm/v1/worker/gpu_worker.py),
    requested = total x gpu_memory_utilization, less the non-KV memory (weights, the profile run's activation
    peak); never negative."""
    requested = math.ceil(gpu.memory_bytes * engine.utilization)  # `request_memory`, vllm/v1/worker/utils.py
    return max(0, requested - shape.weight_bytes // engine.tp - profile_activation_bytes(shape, engine, gpu))


def kv_blocks(shape: ModelShape, engine: Engine, gpu: GPU) -> int:
    """Blocks of the paged KV cache: `available_memory // bytes_per_block`, a block being one page of every
    layer (vLLM 0.34.0 vllm/v1/core/kv_cache_planning.py)."""
    return kv_cache_bytes(shape, engine, gpu) // (page_bytes(shape, engine) * shape.layers)


def concurrent_sequences(shape: ModelShape, engine: Engine, gpu: GPU, *, seq_len: int) -> int:
    """Sequences one engine decodes at once: its KV blocks over each sequence's blocks, at most max_num_seqs."""
    per_sequence = math.ceil(seq_len / VLLM_BLOCK_SIZE)
    return min(scheduler_limits(gpu)[0], kv_blocks(shape, engine, gpu) // per_sequence)


def _rates(gpu: GPU) -> tuple[float, float]:
    """(achievable bf16 matmul FLOP/s, achievable HBM bytes/s) of one GPU."""
    flops = (gpu.peak_flops("bf16") or 1.0) * MAMF.get(gpu.id, DEFAULT_MAMF)
    return flops, gpu.hbm_bandwidth * MEMORY_EFFICIENCY


def decode_step_seconds(shape: ModelShape, engine: Engine, gpu: GPU, *, batch: int, context: int) -> float:
    """One decode step of `batch` sequences at `context` tokens each: roofline of reading the weights and every
    sequence's K/V once (memory-bound at small batch) against 2 x params FLOPs per sequence."""
    flops, bandwidth = _rates(gpu)
    kv_per_token = 2 * shape.kv_heads * shape.head_dim * engine.kv_itemsize * shape.layers
    read = (shape.weight_bytes + batch * context * kv_per_token) / engine.tp
    return max(read / bandwidth, 2 * shape.params * batch / engine.tp / flops)


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationTime:
    """Seconds per optimizer step spent on generation, and the engine's shape."""

    prefill: float
    decode: float
    engines: int
    concurrent: int
    """Sequences each engine decodes at once."""
    waves: int
    """Rounds of `concurrent` sequences each engine runs."""

    @property
    def total(self) -> float:
        return self.prefill + self.decode


def generation_time(shape: ModelShape, engine: Engine, gpu: GPU, *, engine_gpus: int, completions: int,
                    prompt: int, completion: int) -> GenerationTime | None:
    """Time to generate the step's completions on `engine_gpus` GPUs (engines of `engine.tp` GPUs each, data
    parallel): prefill of every prompt (compute-bound), then waves of decode steps; None when one sequence's
    KV cache does not fit."""
    engines = engine_gpus // engine.tp
    concurrent = concurrent_sequences(shape, engine, gpu, seq_len=prompt + completion)
    if engines < 1 or concurrent < 1:
        return None
    per_engine = math.ceil(completions / engines)
    batch = min(concurrent, per_engine)
    waves = math.ceil(per_engine / batch)
    flops, _ = _rates(gpu)
    prefill = 2 * shape.params * prompt * per_engine / engine.tp / flops
    step = decode_step_seconds(shape, engine, gpu, batch=batch, context=prompt + completion // 2)
    return GenerationTime(prefill=prefill, decode=waves * completion * step, engines=engines, concurrent=batch,
                          waves=waves)


def weight_sync_seconds(shape: ModelShape, engine: Engine, gpu: GPU) -> float:
    """Moving the new weights into the engine once per step: colocated, `load_weights` copies them on the GPU
    (read and write at HBM bandwidth), and sleep mode also brings them back from the host and offloads them again;
    in server mode TRL's `VLLMClient.update_named_param` broadcasts them over NCCL (the GPU link)."""
    per_rank = shape.weight_bytes / engine.tp
    if engine.placement is Placement.SERVER:
        return shape.weight_bytes / gpu.intra_node_bandwidth
    seconds = 2 * per_rank / (gpu.hbm_bandwidth * MEMORY_EFFICIENCY)
    if engine.sleep:
        seconds += 2 * per_rank / gpu.host_bandwidth
    return seconds


def engine_resident_bytes(engine: Engine, gpu_bytes: int) -> int:
    """Bytes a colocated engine keeps on the GPU while the trainer runs: its whole `gpu_memory_utilization` share,
    or none with sleep mode (level 1 frees the KV cache and offloads the weights; its CUDA context is the
    runtime overhead the plan already counts per process)."""
    if engine.placement is Placement.SERVER or engine.sleep:
        return 0
    return int(gpu_bytes * engine.utilization)


def logprob_pass_seconds(forward_flops: float, gpu: GPU, *, gpus: int) -> float:
    """A no-grad forward over the step's sequences on the training GPUs (reference or old-policy log-probs),
    at the achievable matmul rate."""
    flops, _ = _rates(gpu)
    return forward_flops / (gpus * flops)
