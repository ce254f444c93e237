"""Explaining infeasibility: the least memory any configuration needs, what binds, and concrete ways out."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from costmodels import Offload, load_gpus, precision
from costmodels.memory import allocated_peak
from graphs import Checkpoint, FitplanError
from solver.plan.record import Inputs
from solver.search.pins import KNOBS, Pins
from solver.search.space import DEFAULT_PRECISIONS, LONG_CONTEXT, Space, leanest_modes
from solver.search.table_search import SearchResult

GIB = 2**30


class Infeasible(FitplanError):
    """No configuration fits; `diagnosis` holds the numbers behind the message."""

    def __init__(self, message: str, hint: str = "", diagnosis: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint)
        self.diagnosis = diagnosis or {}


class NoPlanInTime(FitplanError):
    """The time limit ended the search before any plan was found; nothing was proven infeasible."""

    def __init__(self, time_limit: float, explored: int, configurations: int) -> None:
        super().__init__(f"No plan found within the time limit of {time_limit:g} s ({explored} of {configurations} "
                         "configurations explored); this does not mean nothing fits.",
                         "Raise --time-limit (e.g. --time-limit 60), or pin knobs (--engine, --zero, --micro-batch, "
                         "--tp) to shrink the search.")
        self.diagnosis = {"binding": "time limit", "time_limit_seconds": time_limit, "explored": explored,
                          "configurations": configurations}


def diagnose(found: SearchResult | None, inputs: Inputs, pins: Pins, space: Space, *, lora: bool = False,
             quantized: bool = False, rebuild: Callable[[Pins], Space] | None = None, tp_degrees: tuple[int, ...] = (1,)
             ) -> tuple[str, str, dict[str, Any]]:
    """(message, hint, diagnosis) for a request with no feasible configuration (the whole space searched);
    `rebuild` makes the space for other pins, to name the pins that leave nothing; `tp_degrees` are the model's
    (more GPUs help activations only through more tensor parallelism)."""
    cluster = inputs.cluster
    if found is None or not found.tables:
        culprits = list(blocking_pins(pins, rebuild)) if rebuild is not None else []
        named = "; ".join(f"{KNOBS[name].option if name in KNOBS else '--' + name} {value}" for name, value in culprits)
        message = (f"No configuration is possible for {inputs.model} on {cluster.spec}: "
                   + (f"the pins leave nothing; dropping any one of these would leave some: {named}." if culprits else
                      f"the pins and divisibility rules leave nothing (global batch {inputs.global_batch} over the "
                      "data-parallel ranks, TP degrees that divide the heads and fit a node, what the launcher "
                      "runs)."))
        hint = ("Drop or change one of the pins named (NVMe offload also needs --nvme-gbps; TP at most a node)."
                if culprits else
                "Relax the pins, or pick a global batch divisible by the number of GPUs / TP degree.")
        return message, hint, {"binding": "pins", "pins": inputs.pins, "blocking": [n for n, _ in culprits]}
    lean = leanest_modes(space.modes, len(found.tables[0].layer_ticks))
    peaks = [t.peak_of(lean) for t in found.tables]
    device_fits = [t for t, peak in zip(found.tables, peaks, strict=True) if peak <= t.budget]
    host_binds = bool(device_fits) and not any(t.host_ok for t in device_fits)
    # What the GPUs would need within the host's RAM (all configurations when none fits the host).
    hosted = [(t, peak) for t, peak in zip(found.tables, peaks, strict=True) if t.host_ok] or \
        list(zip(found.tables, peaks, strict=True))
    need, least = min(hosted, key=lambda pair: (pair[1] - pair[0].budget, pair[0].rank))
    budget = need.budget
    binding = "host RAM for offloaded states" if host_binds else "GPU memory"
    # What sharding over more GPUs cannot remove: the peak less the (fully shardable) persistent states. More GPUs
    # still help where they allow more tensor parallelism (which divides activations) than this cluster does.
    floor = least - need.states.gpu_total
    catalog_gpu = load_gpus().get(cluster.gpu)  # a custom GPU from a cluster file is not in the catalog
    node = catalog_gpu.typical_node if catalog_gpu else None
    node_gpus = max(cluster.gpus_per_node, node.gpus_per_node if node else 1)
    more_tp = max((t for t in tp_degrees if t <= node_gpus), default=1) > max(t.outer.tp for t in found.tables)
    activations = allocated_peak(need.memory, lean)[1].activations
    ways = _ways_out(inputs, pins, least, budget, lora=lora, host_binds=host_binds,
                     sharding_helps=floor <= budget or more_tp, floor=floor, activations=activations,
                     quantized=quantized)
    checkpointed = "every layer checkpointed" if lean[0] is Checkpoint.FULL else f"checkpointing pinned to {lean[0]}"
    message = (f"Nothing fits {inputs.model} on {cluster.spec} ({cluster.gpu_name}): the leanest configuration "
               f"the host can hold ({need.outer.engine}, zero={need.outer.zero}, tp={need.outer.tp}, micro-batch "
               f"{need.outer.micro_batch}, {checkpointed}) needs {least / GIB:.1f} GiB allocated per GPU; "
               f"{budget / GIB:.1f} GiB is available after overhead and {inputs.headroom:.0%} headroom. "
               f"Binding resource: {binding}.")
    if host_binds:
        host = min(t.host_bytes for t in device_fits)
        message += (f" The configurations that would fit the GPUs offload states to host RAM and need at least "
                    f"{host / GIB:.0f} GiB of it per node; the node has "
                    f"{cluster.cpu_ram_per_node_bytes / GIB:.0f} GiB.")
    binding_assumptions = [a for a in cluster.assumptions if "host" in a] if host_binds else []
    hint = "Ways out: " + "; ".join(ways)
    return message, hint, {"binding": binding, "least_allocated_bytes": least, "budget_bytes": budget,
                           "ways_out": ways, "assumptions": binding_assumptions}


def blocking_pins(pins: Pins, rebuild: Callable[[Pins], Space]) -> Iterator[tuple[str, object]]:
    """Pins whose removal alone makes the space non-empty: the ones to name when nothing is possible."""
    names = [name for name, _ in pins.fixed] + (["launcher"] if pins.launcher else [])
    for name in names:
        try:
            relaxed = rebuild(pins.without(name))
        except FitplanError:
            continue
        if relaxed.outers:
            value = pins.launcher if name == "launcher" else pins.allowed(name)
            shown = ",".join(str(v) for v in value) if isinstance(value, tuple) else value
            yield name, shown


def _ways_out(inputs: Inputs, pins: Pins, least: int, budget: int, *, lora: bool, host_binds: bool,
              sharding_helps: bool, floor: int, activations: int, quantized: bool = False) -> list[str]:
    ways = []
    cluster = inputs.cluster
    if host_binds:
        ways.append("more host RAM: if the node has more than assumed, pass its real RAM with --cpu-ram-gib")
    allowed = pins.allowed("precision") or DEFAULT_PRECISIONS
    bigger = sorted((g.memory_bytes, g.name) for g in load_gpus().values()
                    if g.vendor != "cpu" and g.memory_bytes > cluster.gpu_memory_bytes
                    and any(g.peak_flops(precision.matmul_dtype_on(p, g)) is not None for p in allowed))
    enough = [name for memory, name in bigger if memory * (budget / max(1, cluster.gpu_memory_bytes)) >= least]
    if enough:
        ways.append(f"larger GPUs: {', '.join(enough[:3])} would hold {least / GIB:.1f} GiB")
    ratio = least / max(1, budget)
    gpus = cluster.nodes * cluster.gpus_per_node
    if quantized:  # `EngineRules.quantized_base`: bitsandbytes' 4-bit layers run under DDP only
        ways.append("not more GPUs: a quantized (QLoRA) base runs under DDP with tp=1 only, a whole copy on every GPU")
    elif sharding_helps:
        ways.append(f"more GPUs: model states shard with ZeRO-3/FSDP; try about {max(2 * gpus, int(gpus * ratio) + 1)}"
                    " GPUs of this kind")
    else:  # activations and temporaries alone exceed a GPU: data parallelism cannot divide them
        ways.append(f"not more GPUs for data parallelism: even with the model states sharded away, activations and "
                    f"temporaries need {floor / GIB:.1f} GiB per GPU; context parallelism (--cp N, searched from "
                    f"{LONG_CONTEXT:,} tokens) splits each sequence over N GPUs")
    if Offload.NONE in (pins.value("optimizer_offload"), pins.value("param_offload")):
        ways.append("offload: --offload cpu / --offload-params cpu (ZeRO-3) were pinned off")
    if not lora and sharding_helps:  # adapters drop states, not activations
        ways.append("LoRA: --lora-rank 16 (or --allow-lora) trains adapters only and drops most gradient and "
                    "optimizer memory")
    # Activation-side ways out only where the leanest configuration's activations (at its peak) are a material
    # share of a GPU: when model states are thousands of GiB, halving a few GiB of activations is noise.
    activations_matter = 4 * activations >= budget
    savers = [way for name, way, matters in (
        ("optimizer_in_backward", "--optimizer-in-backward on (each gradient freed as soon as its parameter steps; "
         "one micro-batch per step, no gradient clipping; the torchrun script)", not lora and sharding_helps),
        ("loss", "--loss fused-linear (Liger's fused cross-entropy: no full logits; HF Trainer, axolotl, torchrun)",
         activations_matter),
        ("activation_offload", "--activation-offload on (saved activations to host memory; the torchrun script)",
         activations_matter))
        if pins.allowed(name) is None and matters]
    if savers:  # the same training, less memory: allowed by the user (liger-kernel, or the torchrun script only)
        ways.append("memory savers that keep the training (--allow-savers lets the search choose them): "
                    + ", ".join(savers))
    if not pins.allows("checkpoint", Checkpoint.FULL):
        ways.append(f"activation checkpointing: --checkpoint auto or full (pinned to {pins.value('checkpoint')})")
    if activations_matter:
        ways.append(f"shorter sequences: --seq-len {max(128, inputs.seq_len // 2)} halves activation memory")
    if (pins.value("micro_batch") or 1) > 1:
        ways.append(f"a smaller micro-batch: --micro-batch {pins.value('micro_batch') // 2}")
    return ways
