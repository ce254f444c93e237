"""A real TRL 1.16 DPO / KTO / GRPO step on CPU with a tiny random-initialised model (no Hub, no weights download),
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


def tracked_peak(step, *tracked, repeated: tuple[torch.nn.Module, ...] = ()) -> int:
    """MemTracker's peak over one call of `step` after a warm-up call (which creates the optimizer states).
    MemTracker refuses a module called twice in one step; the models in `repeated` (KTO's no-grad KL forwards run
    through the policy and the reference) have their per-module statistics dropped after each no-grad forward, which
    keeps the global peak it reports."""
    step()
    tracker = MemTracker()
    tracker.track_external(*tracked)

    def forget(model: torch.nn.Module, _args, _output) -> None:
        if not torch.is_grad_enabled():
            for module in model.modules():
                tracker.memory_tracking.pop(module, None)

    post_backward = tracker._post_bw_hook

    def recorded(module: torch.nn.Module, args) -> None:  # a snapshot only: skipped for a forgotten module
        if module in tracker.memory_tracking:
            post_backward(module, args)

    tracker._post_bw_hook = recorded
    hooks = [model.register_forward_hook(forget) for model in repeated]
    try:
        with tracker:
            step()
    finally:
        for hook in hooks:
            hook.remove()
    return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


def dpo_step_peak(values: dict[str, Any], *, pairs: int, prompt: int, completion: int, reference: str) -> int:
    """Allocated peak of one DPOTrainer step (training_step, then a foreach AdamW step and zero_grad) with
    `pairs` pairs per micro-batch; reference "copy" (a second model) or "precomputed"."""
    trainer = dpo_trainer(values, pairs=pairs, prompt=prompt, completion=completion, reference=reference)
    return _trainer_peak(trainer, [m for m in (trainer.model, trainer.ref_model) if m is not None])


def dpo_trainer(values: dict[str, Any], *, pairs: int, prompt: int, completion: int, reference: str):
    """A DPOTrainer over `pairs` pairs per micro-batch (`dpo_step_peak`)."""
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
    return DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=word_tokenizer(vocab))


def kto_trainer(values: dict[str, Any], *, examples: int, prompt: int, completion: int):
    """A KTOTrainer over `examples` per micro-batch (half desirable) with a reference copy, TRL's default loss
    (`kto`, which computes the KL term from mismatched completions)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    vocab = values["vocab_size"]
    rows = [{"prompt": _words(7 * i, prompt, vocab), "completion": _words(i, completion - 1, vocab),
             "label": i % 2 == 0} for i in range(4 * examples)]
    model, ref = tiny_model(values), tiny_model(values)
    args = KTOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=examples,
                     max_length=prompt + completion, report_to=[], use_cpu=True, save_strategy="no", bf16=False)
    return KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=word_tokenizer(vocab))


def kto_step_peak(values: dict[str, Any], *, examples: int, prompt: int, completion: int) -> int:
    """Allocated peak of one KTOTrainer step (`kto_trainer`), as `dpo_step_peak` measures DPO's."""
    trainer = kto_trainer(values, examples=examples, prompt=prompt, completion=completion)
    return _trainer_peak(trainer, [trainer.model, trainer.ref_model], repeated=(trainer.model, trainer.ref_model))


def forward_calls(trainer) -> dict[str, dict[str, int]]:
    """How many forwards one `training_step` runs through the policy and the reference, with and without grad."""
    counts = {"policy": {"grad": 0, "no_grad": 0}, "reference": {"grad": 0, "no_grad": 0}}
    trainer.current_gradient_accumulation_steps = 1
    batch = next(iter(trainer.get_train_dataloader()))
    hooks = [model.register_forward_pre_hook(_counter(counts[name]))
             for name, model in (("policy", trainer.model), ("reference", trainer.ref_model)) if model is not None]
    try:
        trainer.training_step(trainer.model, batch, None)
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def _counter(counts: dict[str, int]):
    def hook(_module, _args) -> None:
        counts["grad" if torch.is_grad_enabled() else "no_grad"] += 1
    return hook


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


def _trainer_peak(trainer, models: list[torch.nn.Module], *, repeated: tuple[torch.nn.Module, ...] = ()) -> int:
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which this drives by hand
    optimizer = torch.optim.AdamW(trainer.model.parameters(), foreach=True)  # the CUDA default, as fitplan prices
    batch = next(iter(trainer.get_train_dataloader()))

    def step() -> None:
        trainer.training_step(trainer.model, batch, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return tracked_peak(step, *models, optimizer, repeated=repeated)
