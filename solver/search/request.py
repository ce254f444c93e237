"""What a search is asked: the model, the cluster, the workload (with the defaults it assumed), and the options
that bound the search. Built once by `solver.api` from the caller's arguments; read by every search step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from costmodels.cluster import Cluster, load_cluster_file, parse_cluster, with_profile
from costmodels.config import Workload
from costmodels.packing import Lengths, packed, padded
from costmodels.profile import load_profile
from graphs import FitplanError, LayerGraph, LoraSpec
from graphs.positions import sequence_note
from graphs.sources import ResolvedModel
from solver.plan.model_shape import model_shape
from solver.plan.record import ClusterInfo, Inputs, Plan
from solver.search.bounds import check_workload
from solver.search.pins import Pins

# Common fine-tuning practice when the user gives no workload: 4096-token sequences (or the model's limit)
# and 64 sequences per step (e.g. the Alpaca/Tulu recipes use 64-128), raised to one per data-parallel rank.
DEFAULT_SEQ_LEN = 4096
DEFAULT_GLOBAL_BATCH = 64
DEFAULT_HEADROOM = 0.05
DEFAULT_TIME_LIMIT = 10.0
PACKINGS = ("none", "wrapped", "bfd")


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One search: what is planned, on what, and how long the search may take."""

    resolved: ResolvedModel
    cluster: Cluster
    workload: Workload
    gpus: str
    """The cluster as the caller named it (recorded in the plan)."""
    headroom: float = DEFAULT_HEADROOM
    time_limit: float = DEFAULT_TIME_LIMIT
    deterministic: bool = False
    """Search the whole space with a fixed work budget instead of the wall clock: `time_limit` is then each CP-SAT
    model's budget in deterministic seconds, and the same request gives the same plan under any load."""
    lora: LoraSpec | None = None
    kbit_preparation: bool = False
    """The user's training script calls PEFT's `prepare_model_for_kbit_training` on the 4-bit base (`route.Route`
    prices it; only the hf and accelerate files run such a plan)."""
    attention: str | None = None
    assumed: tuple[str, ...] = ()
    """The defaults the request assumed, each with the flag that changes it."""
    alternatives: int = 3
    input_tokens_per_s: float | None = None
    progress: Callable[[str], None] = field(default=lambda _text: None, compare=False)
    """Told each long step as it starts (a lowering, the search), for a progress display."""

    def with_notes(self, *notes: str) -> Request:
        return replace(self, assumed=(*self.assumed, *notes))


def cluster_from(gpus: str | Cluster, *, profile: str | Path | None = None, **options: Any) -> Cluster:
    """A cluster from a spec string ("8xA100"), "auto" (the local GPUs), a JSON/YAML file path, or a ready
    `Cluster`; `options` override what a spec string assumes (see `parse_cluster`), and a `profile` file from
    `fitplan measure` replaces datasheet rates."""
    if profile is not None:
        return with_profile(cluster_from(gpus, **options), load_profile(profile), origin=str(profile))
    given = {k: v for k, v in options.items() if v is not None}
    if gpus == "auto" and not given:
        from solver.hardware.detect import detect_cluster

        return detect_cluster()
    if given and (isinstance(gpus, Cluster) or gpus == "auto" or _is_cluster_file(gpus)):
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        raise FitplanError(f"{names} apply to a cluster string, not to a cluster file or object.",
                           "Put these values in the cluster file (cpu_ram_gib, cpu_cores, ...), or give --gpus as "
                           "a string such as 8xA100.")
    if isinstance(gpus, Cluster):
        return gpus
    if _is_cluster_file(gpus):
        return load_cluster_file(Path(gpus))
    return parse_cluster(gpus, **given)


def _is_cluster_file(gpus: str) -> bool:
    path = Path(gpus)
    return path.suffix.lower() in (".json", ".yaml", ".yml") or path.is_file()


def spec_of(gpus: str | Cluster, cluster: Cluster) -> str:
    """How the plan records the cluster: the caller's string, or the cluster's size and GPU."""
    return gpus if isinstance(gpus, str) else f"{cluster.world_size}x{cluster.gpu.id}"


def workload_for(resolved: ResolvedModel, cluster: Cluster, seq_len: int | None, global_batch: int | None,
                 tokens_per_step: int | None) -> tuple[Workload, list[str]]:
    """The workload, and the defaults it assumed (sequence length within the model's limit, a global batch of at
    least one sequence per GPU)."""
    assumed = []
    if seq_len is None:
        limit = resolved.as_dict().get("max_position_embeddings") or resolved.as_dict().get("n_positions")
        seq_len = min(DEFAULT_SEQ_LEN, int(limit)) if isinstance(limit, int) and limit > 0 else DEFAULT_SEQ_LEN
        assumed.append(f"sequence length {seq_len} tokens (none given; --seq-len)")
    if tokens_per_step is not None:
        if global_batch is not None:
            raise FitplanError("Give either --global-batch or --tokens-per-step, not both.",
                               "--tokens-per-step N means N // seq_len sequences per step.")
        global_batch = max(1, tokens_per_step // seq_len)
        assumed.append(f"global batch {global_batch} sequences = {tokens_per_step} tokens / {seq_len}")
    if global_batch is None:
        global_batch = max(DEFAULT_GLOBAL_BATCH, cluster.world_size)
        assumed.append(f"global batch {global_batch} sequences per step (none given; --global-batch)")
    try:
        workload = Workload(seq_len=seq_len, global_batch=global_batch)
    except ValueError as err:
        raise FitplanError(str(err), "Pass a positive number.") from err
    check_workload(workload.seq_len, workload.global_batch, gpus=cluster.world_size)
    beyond = sequence_note(resolved.as_dict(), workload.seq_len, location=resolved.id)
    return workload, [*assumed, beyond] if beyond else assumed


def longest_batch(workload: Workload, lengths: Lengths, packing: str) -> Workload:
    """The workload memory must be planned on: padded micro-batches are as long as the longest sequence the data
    holds (cut to seq_len); packed rows are seq_len tokens."""
    if packing != "none":
        return workload
    return replace(workload, seq_len=min(workload.seq_len, lengths.longest))


def with_batching(plan: Plan, lengths: Lengths, packing: str, seq_len: int) -> Plan:
    """The plan with what its batching computes: the real share of its tokens (`costmodels.packing`)."""
    batching = padded(lengths, seq_len, plan.decisions.micro_batch) if packing == "none" else \
        packed(lengths, seq_len, packing)
    # Padded steps are priced at the longest micro-batch (an upper bound on the step), so the real share of what
    # is priced is the mean length over that; packed rows are priced as they run.
    share = lengths.truncated(seq_len).mean() / plan.inputs.seq_len if packing == "none" else \
        batching.useful_fraction
    real = plan.estimate.tokens_per_second * share
    line = (f"Dataset batching, {batching.describe()}; real tokens/s "
            f"{'at least ' if packing == 'none' else ''}{real:,.0f} of the {plan.estimate.tokens_per_second:,.0f} "
            "priced"
            + (" (the step is priced at the longest micro-batch, an upper bound)" if packing == "none" else
               f" (global batch {plan.inputs.global_batch} rows hold about "
               f"{plan.inputs.global_batch * batching.sequences_per_row:,.0f} sequences)"))
    return replace(plan, inputs=replace(plan.inputs, packing=packing), advice=(*plan.advice, line))


def plan_inputs(request: Request, pins: Pins, graph: LayerGraph) -> Inputs:
    """The plan's record of its inputs, every assumption listed."""
    cluster, workload, resolved = request.cluster, request.workload, request.resolved
    info = ClusterInfo(spec=request.gpus, gpu=cluster.gpu.id, gpu_name=cluster.gpu.name, nodes=cluster.nodes,
                       gpus_per_node=cluster.gpus_per_node, gpu_memory_bytes=cluster.gpu.memory_bytes,
                       cpu_ram_per_node_bytes=cluster.cpu_ram_per_node,
                       inter_node_bytes_per_s=cluster.inter_node_bandwidth, nvme_bytes_per_s=cluster.nvme_bandwidth,
                       assumptions=cluster.assumptions)
    defaults = [*request.assumed, f"memory headroom {request.headroom:.0%} of each GPU kept free (--headroom)"]
    if resolved.source == "local":
        defaults.append(f"local model recorded by its absolute path {resolved.id}, so that `fitplan check` and the "
                        "emitted scripts find it from any folder")
    if pins.allowed("precision") is None:
        defaults.append("precisions: any the GPU supports among bf16-mixed, tf32, fp32, and fp16-mixed where it has "
                        "no bf16 (fp16-mixed on bf16 GPUs, pure bf16 and fp8 only when allowed: --precision)")
    return Inputs(model=resolved.id, model_source=resolved.source, architecture=graph.architecture,
                  layer_class=graph.layer_class, hidden_size=graph.dims.hidden, num_layers=graph.dims.layers,
                  cluster=info, seq_len=workload.seq_len, global_batch=workload.global_batch,
                  tokens_per_step=workload.tokens_per_step, headroom=request.headroom, pins=pins.shown(),
                  assumed=tuple(defaults), shape=model_shape(graph, resolved.as_dict(), seq_len=workload.seq_len))
