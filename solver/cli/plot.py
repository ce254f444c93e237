"""`--plot`: a PNG of a plan's memory breakdown and of step time against device memory for its alternatives."""

from __future__ import annotations

from pathlib import Path

from graphs import FitplanError
from solver.plan.record import Plan

GIB = 2**30


def plot_plan(plan: Plan, path: Path) -> None:
    """Two panels: the memory breakdown per GPU, and step time against device memory for the alternatives."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise FitplanError("--plot needs matplotlib", "pip install 'fitplan[plot]'") from error
    from solver.cli.render import memory_parts

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    bottom = 0.0
    for name, nbytes in memory_parts(plan.estimate):
        left.bar(["this plan"], [nbytes / GIB], bottom=[bottom], label=name)
        bottom += nbytes / GIB
    left.axhline(plan.inputs.cluster.gpu_memory_bytes / GIB, color="black", linestyle="--", label="device memory")
    left.set_ylabel("GiB per GPU")
    left.set_title("Memory breakdown (device peak)")
    left.legend(fontsize=8)
    points = [(plan.estimate.memory.device_peak / GIB, plan.estimate.time.step_time, "plan")]
    points += [(a.device_peak / GIB, a.step_time, a.decisions[:40]) for a in plan.alternatives if a.step_time]
    for memory, seconds, label in points:
        right.scatter([memory], [seconds], s=60 if label == "plan" else 30)
        right.annotate(label, (memory, seconds), fontsize=7)
    right.set_xlabel("device peak, GiB per GPU")
    right.set_ylabel("step time, s")
    right.set_title("Time / memory trade-off of the alternatives")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
