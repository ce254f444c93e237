"""A real TRL 1.16 DPO / GRPO step on CPU with a tiny random-initialised model (no Hub, no weights download),
measured by torch's MemTracker: the reference for `costmodels/post_training.py`."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker


def tiny_model(values: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32, attn_implementation="sdpa")


def word_tokenizer(vocab: int):
    """A whitespace word-level tokenizer over tokens t0..t{vocab-1} (t0 pads, t1 ends), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def _words(start: int, count: int, vocab: int) -> str:
    return " ".join(f"t{(start + j) % (vocab - 2) + 2}" for j in range(count))


def tracked_peak(step, *tracked) -> int:
    """MemTracker's peak over one call of `step` after a warm-up call (which creates the optimizer states)."""
    step()
    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        step()
    return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


def dpo_step_peak(values: dict[str, Any], *, pairs: int, prompt: int, completion: int, reference: str) -> int:
    """Allocated peak of one DPOTrainer step (training_step, then a foreach AdamW step and zero_grad) with
    `pairs` pairs per micro-batch; reference "copy" (a second model) or "precomputed"."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    vocab = values["vocab_size"]
    rows = [{"prompt": _words(7 * i, prompt, vocab), "chosen": _words(i, completion - 1, vocab),
             "rejected": _words(3 * i, completion - 1, vocab)} for i in range(4 * pairs)]
    model = tiny_model(values)
    ref = tiny_model(values) if reference == "copy" else None
    args = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=pairs, max_length=prompt + completion,
                     report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                     precompute_ref_log_probs=reference == "precomputed")
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=word_tokenizer(vocab))
    return _trainer_peak(trainer, [m for m in (trainer.model, ref) if m is not None])


def grpo_step_peak(values: dict[str, Any], *, completions: int, generations: int, prompt: int, completion: int,
                   beta: float, folder: Path) -> int:
    """Allocated peak of the training part of one GRPOTrainer step (loss, backward, a foreach AdamW step) after
    its generation without vLLM (transformers' generate on CPU) and reference log-probs (beta > 0), which stay
    allocated: the reference copy and the completions."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    vocab = values["vocab_size"]
    model = tiny_model(values)
    model.save_pretrained(folder)  # the reference is built from the model's path, as TRL does
    tokenizer = word_tokenizer(vocab)
    tokenizer.save_pretrained(folder)
    rows = [{"prompt": _words(5 * i, prompt, vocab)} for i in range(4 * completions)]
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=completions,
                      num_generations=generations, max_completion_length=completion, beta=beta, report_to=[],
                      use_cpu=True, save_strategy="no", bf16=False, use_vllm=False,
                      generation_kwargs={"min_new_tokens": completion})

    def reward(completions, **_):
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(model=str(folder), reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))  # generation, reference log-probs
    optimizer = torch.optim.AdamW(trainer.model.parameters(), foreach=True)

    def step() -> None:  # MemTracker refuses generate's repeated module calls: the training part is tracked
        trainer.accelerator.backward(trainer.compute_loss(trainer.model, inputs))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return tracked_peak(step, *[m for m in (trainer.model, trainer.ref_model) if m is not None], optimizer)


def _trainer_peak(trainer, models: list[torch.nn.Module]) -> int:
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which this drives by hand
    optimizer = torch.optim.AdamW(trainer.model.parameters(), foreach=True)  # the CUDA default, as fitplan prices
    batch = next(iter(trainer.get_train_dataloader()))

    def step() -> None:
        trainer.training_step(trainer.model, batch, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return tracked_peak(step, *models, optimizer)
