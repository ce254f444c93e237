"""Partial optimizer offload: a share of the optimizer's states on the host, stepped there by a CPU optimizer,
while the GPU steps the rest at the same time (megatron-core 0.16.1's `HybridDeviceOptimizer`, which Megatron-LM
runs for --optimizer-cpu-offload with --optimizer-offload-fraction).

The hybrid optimizer (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py, `_get_sub_optimizer_param_groups`)
moves parameters to the host in its groups' order until their elements reach `fraction` of the rank's: the host
steps at least that share, and the GPU at most the rest (the boundary is one parameter shard; a test runs its own
split). Each parameter it keeps on the GPU gets an fp32 copy there (param_update_in_fp32) with fp32 Adam moments;
each it moves gets the same on the host plus a pinned fp32 gradient copy (`cpu_copy_map_grad`). Its step copies the
host share's gradients down (converted to fp32 on the GPU: non_blocking copies convert on the GPU) and the updated
16-bit parameters up, on their own streams beside the CPU step (--overlap-cpu-optimizer-d2h-h2d), while the GPU
share steps on the compute stream.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .choices import Engine, Offload, Optimizer
from .engines import rules_of

# The fractions the search tries where the engine offloads a share: whole quarters (Megatron-LM takes any float;
# a finer grid multiplies the outer configurations for the last few percent of a card).
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
# Bytes per host-stepped element: its fp32 main parameter, both fp32 Adam moments and the pinned fp32 gradient copy.
HOST_BYTES_PER_ELEMENT = 4 + 8 + 4
# Bytes per host-stepped element crossing PCIe each step: its fp32 gradient down (4), its 16-bit parameter up.
GRADIENT_DOWN_BYTES = 4
# The optimizers the hybrid optimizer builds (megatron/core/optimizer/__init__.py: TE's or apex's FusedAdam on the
# GPU, torch.optim.AdamW(fused=True) on the host, both with fp32 states: it passes no state dtypes).
HYBRID_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.ADAMW_FUSED)


def steps_a_share(offload: Offload, engine: Engine) -> bool:
    """Whether the engine steps a share on the host and the rest on the GPU (`EngineRules.hybrid_offload`)."""
    return offload is not Offload.NONE and rules_of(engine).hybrid_offload


def host_share(offload: Offload, engine: Engine, fraction: float) -> float:
    """Share of the optimizer's elements stepped on the host: the fraction where the engine offloads a share, all
    of them under other offloading engines, none without offload."""
    if offload is Offload.NONE:
        return 0.0
    return fraction if rules_of(engine).hybrid_offload else 1.0


def host_elements(share: float, elements: int) -> int:
    """Elements of a rank's `elements` the host steps (at least the share: the split rounds up to a parameter)."""
    return math.ceil(share * elements)


def problem(*, fraction: float, offload: Offload, engine: Engine, optimizer: Optimizer) -> str | None:
    """Why a fraction cannot run with this offload, engine and optimizer, or None."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        return f"optimizer_offload_fraction={fraction!r} must be more than 0 and at most 1"
    if fraction != 1 and offload is Offload.NONE:
        return (f"optimizer_offload_fraction={fraction:g} applies to an offloaded optimizer: set optimizer_offload "
                "(--offload cpu)")
    if fraction != 1 and not rules_of(engine).hybrid_offload:
        return (f"optimizer_offload_fraction={fraction:g}: engine={engine} offloads all of the optimizer's "
                "states (a share is Megatron's --optimizer-offload-fraction: engine=megatron)")
    if steps_a_share(offload, engine) and optimizer not in HYBRID_OPTIMIZERS:
        return (f"optimizer={optimizer} under engine={engine} optimizer offload: its hybrid device optimizer steps "
                "Adam with fp32 states (adamw or adamw-fused)")
    return None


def searched_fractions(values: Mapping[str, Any], gpus_per_node: int) -> tuple[float, ...]:
    """The fractions worth trying: `FRACTIONS` where the engine offloads a share, else all (1)."""
    offload, engine = values.get("optimizer_offload", Offload.NONE), values.get("engine")
    if offload is Offload.NONE or engine is None or not rules_of(engine).hybrid_offload:
        return (1.0,)
    return FRACTIONS


def exposed_host_seconds(*, host_step: float, copies: float, gpu_step: float) -> float:
    """Seconds the host share adds to the step: its CPU step and its copies run beside each other, parameter by
    parameter (their own streams), and beside the GPU share's step; what outlasts the GPU step is exposed."""
    return max(0.0, max(host_step, copies) - gpu_step)
