"""A plan read from a file, checked against the model and cluster it names before `explain` or `check` trust it:
the rule `estimate --config plan.json` applies, so a plan edited by hand (dp=10^9, a checkpoint list shorter than
the model) is refused with exit 2 rather than explained or run. The plan's recorded numbers are not re-derived."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from costmodels import Cluster, Estimate
from costmodels.cluster import load_cluster_file, parse_cluster
from costmodels.hardware import UnknownGPU
from graphs import FitplanError
from solver.plan.record import ClusterInfo, Plan, load_plan
from solver.search.pins import KNOBS


def load_valid_plan(path: Path) -> Plan:
    """The plan at `path`, refused (FitplanError naming the file) unless its decisions run on its model and
    cluster."""
    plan = load_plan(path)
    checked(path)(plan)
    return plan


def checked(path: Path) -> Callable[[Plan], None]:
    """A check of the plan read from `path` against its model and cluster, its errors naming the file."""
    def check(plan: Plan) -> None:
        try:
            validate_plan(plan)
        except (FitplanError, ValueError) as error:  # ValueError: a Config or cluster invariant
            message, hint = (error.message, error.hint) if isinstance(error, FitplanError) else \
                (str(error), "Re-create the plan with `solve ... -o plan.json`.")
            raise FitplanError(f"{path} does not run on the model and cluster it names: {message}", hint) from error
    return check


def validate_plan(plan: Plan) -> Estimate:
    """The estimate of the plan's decisions on the model and cluster it records (as `estimate --config` prices a
    plan); raises FitplanError where they cannot run there."""
    from solver.api import estimate
    from solver.search.post_training import plan_request

    d = plan.decisions
    config = {name: getattr(d, name) for name in KNOBS}
    post_training, examples = plan_request(plan)
    return estimate(plan.inputs.model, plan_cluster(plan.inputs.cluster), config, seq_len=plan.inputs.seq_len,
                    global_batch=examples, lora=None if d.lora is None else d.lora.spec(),
                    attention=d.attention, post_training=post_training,
                    kbit_preparation=d.lora is not None and d.lora.kbit_preparation)


def plan_cluster(info: ClusterInfo) -> Cluster:
    """The cluster a plan records: its GPU, node layout, host RAM, fabric and NVMe as written (cores, which the
    plan does not record, are the GPU's typical host's). A custom GPU (not in the catalog) is read again from the
    cluster file the plan names."""
    try:
        base = parse_cluster(f"{info.nodes}x{info.gpus_per_node}x{info.gpu}")
    except UnknownGPU:
        if not Path(info.spec).is_file():
            raise FitplanError(f"the plan's GPU {info.gpu!r} is not in the catalog, and its cluster file "
                               f"{info.spec} is not here.",
                               "Run from the folder of the cluster file the plan was made with.") from None
        base = load_cluster_file(info.spec)
    return replace(base, cpu_ram_per_node=info.cpu_ram_per_node_bytes, inter_node_bandwidth=info.inter_node_bytes_per_s,
                   nvme_bandwidth=info.nvme_bytes_per_s)
