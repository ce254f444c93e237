"""The post-training part of a plan (DPO/ORPO/KTO/GRPO): task, reference strategy, the generation engine's
placement and memory share, and where the step's time goes beyond the training step (`Plan.estimate`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import ConfigDict

_CONFIG = ConfigDict(use_attribute_docstrings=True)


@dataclass(frozen=True, kw_only=True)
class GenerationPlan:
    """The vLLM engine of GRPO (TRL's `use_vllm=True`)."""

    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    vllm_mode: str
    """colocate (in each training process) or server (`trl vllm-serve` on GPUs of its own)."""
    vllm_gpu_memory_utilization: float
    """Share of each engine GPU's memory vLLM may take (weights, activations, KV cache)."""
    vllm_tensor_parallel_size: int
    vllm_enable_sleep_mode: bool
    """Colocate only: weights offloaded and KV cache freed while the trainer runs."""
    generation_gpus: int
    """GPUs running vLLM (all of them when colocated)."""
    training_gpus: int
    kv_cache_bytes_per_gpu: int
    """vLLM's KV cache on one engine GPU (its own formula: requested memory less weights and profile peak)."""
    kv_blocks: int
    block_size: int
    concurrent_sequences: int
    """Sequences each engine decodes at once (KV blocks and max_num_seqs bound it)."""
    waves: int
    resident_bytes_during_training: int
    """Bytes the engine keeps on each training GPU while the trainer runs (0: server, or sleep mode)."""


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds per optimizer step, by phase; they sum to `step_time`."""

    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    generation: float = 0.0
    """Prefill and decode of the step's completions (decode memory-bound, batch-dependent)."""
    weight_sync: float = 0.0
    """Trainer-to-engine weight transfer (and sleep mode's host round trip)."""
    logprob_passes: float = 0.0
    """No-grad forwards: the reference (beta > 0 or DPO) and GRPO's old-policy pass for vLLM's importance sampling."""
    training: float
    """The policy's forward, backward and optimizer step (the plan's estimate)."""
    step_time: float


@dataclass(frozen=True, kw_only=True)
class PostTrainingPlan:
    """What the post-training task adds to the plan."""

    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    task: str
    reference: str
    """copy (a frozen second model), adapter (LoRA, adapters disabled), precomputed (DPO), none."""
    beta: float
    prompt_len: int
    completion_len: int
    examples_per_step: int
    """Pairs (DPO/ORPO), examples (KTO) or completions (GRPO) per optimizer step."""
    per_device_train_batch_size: int
    """In the trainer's own unit (pairs for DPO/ORPO)."""
    num_generations: int = 1
    reference_bytes_per_gpu: int = 0
    generation: GenerationPlan | None = None
    time: StepTime
    considered: tuple[str, ...] = ()
    """The other placements / reference strategies searched, each with its step time or why it does not fit."""
    notes: tuple[str, ...] = ()
