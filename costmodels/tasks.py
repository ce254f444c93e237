"""The post-training task of a workload (SFT, TRL's DPO/ORPO/KTO/GRPO, PPO) and its reference-model strategy:
plain values the workload carries; their costs are in `post_training.py` and `generation.py`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Task(StrEnum):
    """What is trained: supervised fine-tuning, or a preference / RL objective (TRL's trainer of that name)."""

    SFT = "sft"
    DPO = "dpo"
    ORPO = "orpo"
    KTO = "kto"
    GRPO = "grpo"
    PPO = "ppo"


class Reference(StrEnum):
    """Where the frozen reference log-probs come from."""

    COPY = "copy"
    """A second, frozen copy of the model (TRL's `ref_model`, created from the same weights)."""
    ADAPTER = "adapter"
    """LoRA: the policy with its adapters disabled (`use_adapter(model, None)`): no second copy."""
    PRECOMPUTED = "precomputed"
    """DPO's `precompute_ref_log_probs=True`: one pass over the dataset before training, nothing during it."""
    NONE = "none"
    """No reference: ORPO, and GRPO with `beta=0` (TRL 1.16's default)."""


PAIR_TASKS = (Task.DPO, Task.ORPO)
GENERATION_TASKS = (Task.GRPO, Task.PPO)


@dataclass(frozen=True, slots=True, kw_only=True)
class PostTraining:
    """The post-training side of a workload: task, reference and (GRPO/PPO) generation lengths."""

    task: Task
    reference: Reference = Reference.NONE
    prompt_len: int = 0
    """Prompt tokens per sequence (the rest of the workload's seq_len is completion)."""
    num_generations: int = 1
    """Completions per prompt (GRPO's group size); 1 for offline tasks."""
    triton: bool = True
    """The fused head runs TRL's Triton kernels (CUDA/XPU) rather than its torch fallback (CPU)."""

    def __post_init__(self) -> None:
        if self.task in (Task.ORPO,) and self.reference is not Reference.NONE:
            raise ValueError("orpo has no reference model (its odds-ratio term needs none): reference=none")
        if self.reference is Reference.PRECOMPUTED and self.task is not Task.DPO:
            raise ValueError(f"reference=precomputed is DPO's precompute_ref_log_probs; {self.task} computes "
                             "reference log-probs during training")
        if self.num_generations < 1 or self.prompt_len < 0:
            raise ValueError("num_generations must be >= 1 and prompt_len >= 0")

    @property
    def sequences_per_example(self) -> int:
        """Sequences one training example is: chosen + rejected for DPO/ORPO (concatenated in one batch), else 1."""
        return 2 if self.task in PAIR_TASKS else 1

    @property
    def min_micro_batch(self) -> int:
        """Fewest sequences a micro-batch may hold: a whole example, and for KTO two examples (`KTOTrainer` refuses
        `per_device_train_batch_size <= 1` when it computes the KL term from the batch's mismatched completions,
        trl 1.16 trl/trainer/kto_trainer.py)."""
        return 2 if self.task is Task.KTO else self.sequences_per_example

    @property
    def fused_head(self) -> bool:
        """TRL 1.16 runs this task with `add_fused_lm_head` (DPO, KTO, GRPO); ORPO (trl.experimental) keeps full
        logits, priced as the SFT lowering's cross-entropy."""
        return self.task in (Task.DPO, Task.KTO, Task.GRPO, Task.PPO)

    @property
    def reference_pass(self) -> bool:
        """A frozen reference forward runs during each training step."""
        return self.reference in (Reference.COPY, Reference.ADAPTER)


