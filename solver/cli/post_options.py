"""The post-training options of `solve` and `estimate` (`--task dpo|orpo|kto|grpo` and what goes with it), one
option group."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from solver.cli.options import number

if TYPE_CHECKING:
    from solver.search.post_training import PostRequest

PANEL = "Post-training (TRL)"


@dataclasses.dataclass(frozen=True)
class PostTrainingOptions:
    """TRL's preference and RL trainers: the task, its reference model and GRPO's vLLM engine."""

    OPTION_GROUP = True
    task: Annotated[Literal["sft", "dpo", "orpo", "kto", "grpo", "ppo"], typer.Option(
        help="What is trained: sft (default), or TRL's dpo, orpo, kto, grpo (ppo exits 2: TRL 1.16 has no PPO "
             "trainer). With a post-training task --global-batch counts pairs (dpo/orpo), examples (kto) or "
             "completions (grpo).",
        rich_help_panel=PANEL)] = "sft"
    reference: Annotated[Literal["auto", "copy", "adapter", "precomputed", "none"], typer.Option(
        help="Reference log-probs: a frozen copy, LoRA with adapters disabled, precomputed (DPO), none; auto "
             "searches the task's.", rich_help_panel=PANEL)] = "auto"
    beta: Annotated[float | None, number(float, 0, 100, "KL/preference coefficient (TRL's defaults: 0.1 DPO/KTO, "
                                         "0.0 GRPO: no reference).", rich_help_panel=PANEL)] = None
    max_prompt: Annotated[int | None, number(int, 1, 1 << 20, "Prompt tokens per sequence (default: half of "
                                             "--seq-len offline, 512 for grpo).", rich_help_panel=PANEL)] = None
    max_completion: Annotated[int | None, number(int, 1, 1 << 20, "Completion tokens per sequence (with "
                                                 "--max-prompt it sets the sequence length).",
                                                 rich_help_panel=PANEL)] = None
    num_generations: Annotated[int, number(int, 1, 1024, "GRPO: completions per prompt.",
                                           rich_help_panel=PANEL)] = 8
    vllm_mode: Annotated[Literal["auto", "colocate", "server"], typer.Option(
        help="GRPO: where vLLM runs (auto searches both).", rich_help_panel=PANEL)] = "auto"
    vllm_gpu_memory_utilization: Annotated[float | None, number(
        float, 0, 1, "GRPO: vLLM's share of each of its GPUs (default: searched).", lo_open=True,
        rich_help_panel=PANEL)] = None
    vllm_tp: Annotated[int | None, number(int, 1, 64, "GRPO: vLLM tensor-parallel size (default: searched).",
                                          rich_help_panel=PANEL)] = None

    def spec(self) -> PostRequest | None:
        """The post-training request, or None for supervised fine-tuning."""
        from costmodels.tasks import Task
        from solver.search.post_training import PostRequest

        if self.task == "sft":
            return None
        return PostRequest(task=Task(self.task), reference=self.reference, beta=self.beta,
                           prompt_len=self.max_prompt, completion_len=self.max_completion,
                           num_generations=self.num_generations, vllm_mode=self.vllm_mode,
                           utilization=self.vllm_gpu_memory_utilization, vllm_tp=self.vllm_tp)


NO_POST = PostTrainingOptions()
