"""torch.compile: fusion of the memory-bound kernels between matmuls.

PyTorch 2 (Ansel et al., ASPLOS 2024, table 3) reports a 1.41x geometric-mean training speed-up on the
Hugging Face suite (A100, AMP), coming from fused pointwise/reduction kernels; matmuls and attention kernels are
the same with or without it. fitplan speeds up the memory-bound part only (one read and one write per fused
group instead of per op), by what fused kernels measure against the eager ops they replace
(`compiled_memory_bound_speedup`, data/fused_kernels.json).
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources

from .config import Config
from .engines import rules_of
from .lowering import liger_lowering

# torch.compile adds compile time and occasional graph breaks; "auto" keeps it only when the cost model expects
# at least this step-time saving. A policy threshold (how much saving is worth the compile), not an efficiency,
# so it is neither cited data nor fitted.
COMPILE_MIN_SAVING = 0.03


@functools.cache
def compiled_memory_bound_speedup() -> float:
    """Speed-up of fused memory-bound kernels over the eager ops they replace: the geometric mean of eager /
    fused time over the kernel benchmarks of data/fused_kernels.json (Liger-Kernel's RMSNorm and RoPE, forward +
    backward, A100)."""
    text = resources.files("costmodels").joinpath("data/fused_kernels.json").read_text(encoding="utf-8")
    rows = json.loads(text)["rows"]
    return math.exp(sum(math.log(r["eager_ms"] / r["fused_ms"]) for r in rows) / len(rows))


def compile_credited(config: Config) -> bool:
    """Whether the engine runs a compiled model as the speed-up assumes (`EngineRules.compile_stages`: not
    DeepSpeed ZeRO-3, issue 12), and the model is not Liger-patched: its layers are lowered eager with Liger's
    Triton kernels (`lowering.liger_lowering`, graphs/liger.py), which are fused already and which fitplan does not
    trace through Dynamo, so a compiled Liger run is priced as eager (its memory and time as upper bounds)."""

    return config.compile and rules_of(config.engine).compiles(config.zero) and not liger_lowering(config)


def uncredited_reason(config: Config) -> str | None:
    """Why a compiled `config` gets no speed-up (None when it does): the engine's rule or the Liger lowering."""

    rules = rules_of(config.engine)
    if not rules.compiles(config.zero):
        if not rules.compile_stages:
            return f"{rules.runtime} does not torch.compile the model"
        return (f"{rules.runtime} runs a compiled model only at ZeRO stage(s) "
                f"{', '.join(map(str, rules.compile_stages))} (zero={config.zero}: its parameter hooks break graphs)")
    if liger_lowering(config):
        return "Liger's kernels are fused already and fitplan prices a compiled Liger run as eager"
    return None


def memory_bound_speedup(config: Config) -> float:
    """Speed-up of memory-bound kernels (activation memory is taken as unchanged: a conservative choice,
    since AOTAutograd's recompute-aware partitioner can also save activations)."""
    return compiled_memory_bound_speedup() if compile_credited(config) else 1.0


# The value the time model applies (about 4x), read once from the data.
COMPILED_MEMORY_BOUND_SPEEDUP = compiled_memory_bound_speedup()
