"""The range of every numeric input: the CLI shows each in --help and refuses values outside it (exit 2), and the
library checks the workload against the same numbers, so no input reaches the solver at a size it cannot plan.
"""

from __future__ import annotations

from graphs import FitplanError
from solver.hardware.limits import MAX_CHECK_STEPS, MAX_CPU_RANKS

__all__ = ["MAX_CHECK_STEPS", "MAX_CPU_RANKS"]  # the local runs' limits, listed here with every other range

# Tokens per sequence: 12x the longest context in the catalog (DeepSeek-V3, 163,840 positions).
MAX_SEQ_LEN = 2**21
# Sequences per optimizer step: 500x the largest published pre-training batch (Llama 3 405B, 16M tokens of
# 8,192 = 2,048 sequences; Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.4.1).
MAX_GLOBAL_BATCH = 2**20
MAX_TOKENS_PER_STEP = MAX_SEQ_LEN * MAX_GLOBAL_BATCH
# GPUs in one cluster: above the largest built (xAI Colossus, 100,000 H100s in 2024).
MAX_GPUS = 2**17
# Tensor-parallel degree, micro-batch and accumulation pins are further checked against the cluster and batch.
MAX_TP = 1024
MAX_DP = 2**20
MAX_ZERO = 3
# Solver time limit, seconds: one hour (every benchmark instance solves in under 5 s).
MAX_TIME_LIMIT = 3600.0
# LoRA rank and alpha: rank 4096 already equals the hidden size of 8B models; PEFT takes integer alphas.
MAX_LORA_RANK = 4096
MAX_LORA_ALPHA = 2**16
# Tokens/s one data-loading worker supplies: 1e12 is a million times a fast tokenizer (~1M tokens/s).
MAX_INPUT_TOKENS_PER_S = 1e12
# `choose`: tokens to train on, 600x Llama 3's 15.6T pre-training tokens (Dubey et al. 2024, section 3.1); a budget
# in USD; and the largest cluster a sweep tries. The sweep solves every whole-node count up to it: 1,024 GPUs of 8
# per node is 128 solves per GPU type, minutes at the default time limit.
MAX_TRAIN_TOKENS = 1e16
MAX_BUDGET_USD = 1e12
MAX_CHOOSE_GPUS = 1024
# `choose --deadline`: a million hours (114 years) is no deadline.
MAX_DEADLINE_HOURS = 1e6
# Longest --gpus string: "2x8xH100-SXM5-80GB" is 18 characters; a long one is a mistake (and slow to match).
MAX_CLUSTER_CHARS = 256
# Longest `fitplan models` filter.
MAX_FILTER_CHARS = 256


def check_workload(seq_len: int, global_batch: int, *, gpus: int = 1) -> None:
    """Refuse a workload beyond `MAX_SEQ_LEN` tokens or `MAX_GLOBAL_BATCH` sequences, or a cluster of more than
    `MAX_GPUS` (library calls; the CLI refuses the numbers while parsing)."""
    if gpus > MAX_GPUS:
        raise FitplanError(f"--gpus describes {gpus:,} GPUs: at most {MAX_GPUS:,} are planned.",
                           "Check the counts in the cluster string or file.")
    if seq_len > MAX_SEQ_LEN:
        raise FitplanError(f"--seq-len {seq_len} is out of range: at most {MAX_SEQ_LEN:,} tokens per sequence.",
                           "Plan with a shorter sequence.")
    if global_batch > MAX_GLOBAL_BATCH:
        raise FitplanError(f"--global-batch {global_batch} is out of range: at most {MAX_GLOBAL_BATCH:,} sequences "
                           "per step (with --tokens-per-step, tokens / seq-len).", "Plan with a smaller batch.")
