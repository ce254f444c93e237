"""The post-training lines of a rendered plan: the task and reference, vLLM's placement and share, and where the
whole step's time goes (generation, log-prob passes, weight sync, training)."""

from __future__ import annotations

from rich.text import Text

from solver.plan.post_training import PostTrainingPlan

GIB = 1 << 30


def post_training_lines(post: PostTrainingPlan) -> list[Text]:
    """Plain lines for the plan panel (numbers come from the plan record)."""
    lines = [Text(f"Post-training: {post.task}, reference {post.reference} (beta {post.beta:g}), "
                  f"{post.examples_per_step} examples per step, per_device_train_batch_size "
                  f"{post.per_device_train_batch_size}, prompt {post.prompt_len} + completion {post.completion_len} "
                  "tokens", style="bold")]
    if post.reference_bytes_per_gpu:
        lines.append(Text(f"  reference copy: {post.reference_bytes_per_gpu / GIB:.2f} GiB per GPU"))
    if (g := post.generation) is not None:
        lines.append(Text(
            f"  vLLM {g.vllm_mode}: {g.generation_gpus} GPUs (training on {g.training_gpus}), tensor_parallel_size "
            f"{g.vllm_tensor_parallel_size}, gpu_memory_utilization {g.vllm_gpu_memory_utilization:g}"
            f"{', sleep mode' if g.vllm_enable_sleep_mode else ''}; KV cache {g.kv_cache_bytes_per_gpu / GIB:.1f} GiB "
            f"per GPU = {g.kv_blocks:,} blocks of {g.block_size} tokens; {g.concurrent_sequences} sequences at once "
            f"x {g.waves} wave(s); held during training {g.resident_bytes_during_training / GIB:.1f} GiB per GPU"))
    t = post.time
    lines.append(Text(f"  Step time: generation {t.generation:.3f} s + weight sync {t.weight_sync:.3f} + log-prob "
                      f"passes {t.logprob_passes:.3f} + training {t.training:.3f} -> {t.step_time:.3f} s"))
    if post.considered:
        lines.append(Text("  Searched: " + "; ".join(post.considered), style="dim"))
    if post.notes:
        lines.append(Text("  Notes: " + "; ".join(post.notes), style="dim"))
    return lines
