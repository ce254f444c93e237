"""torch.compile: fusion of the memory-bound kernels between matmuls.

PyTorch 2 (Ansel et al., ASPLOS 2024, table 3) reports a 1.41x geometric-mean training speed-up on the
Hugging Face suite (A100, AMP), coming from fused pointwise/reduction kernels; matmuls and attention kernels are
the same with or without it. fitplan applies a conservative 2x to the memory-bound part only (one read and one
write per fused group instead of per op), which gives 1.05-1.3x end to end on LLM steps.
"""

from __future__ import annotations

from .config import Config
from .engines import rules_of

COMPILED_MEMORY_BOUND_SPEEDUP = 2.0
# torch.compile adds compile time and occasional graph breaks; "auto" keeps it only when the cost model expects
# at least this step-time saving (a policy, not a measurement).
COMPILE_MIN_SAVING = 0.03


def compile_credited(config: Config) -> bool:
    """Whether the engine runs a compiled model as the speed-up assumes (`EngineRules.compile_stages`: not
    DeepSpeed ZeRO-3, issue 12)."""
    return config.compile and rules_of(config.engine).compiles(config.zero)


def memory_bound_speedup(config: Config) -> float:
    """Speed-up of memory-bound kernels (activation memory is taken as unchanged: a conservative choice,
    since AOTAutograd's recompute-aware partitioner can also save activations)."""
    return COMPILED_MEMORY_BOUND_SPEEDUP if compile_credited(config) else 1.0
