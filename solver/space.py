"""The search space: every outer configuration the pins, the hardware and the divisibility rules allow.

Pure Python, no CP-SAT. The per-layer checkpoint modes are the inner decision (see `model.py`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from costmodels import Cluster, Config, Engine, Offload, Optimizer, Precision, Workload, precision
from costmodels.compilation import compile_credited
from costmodels.engines import RULES
from costmodels.estimate import model_refusals
from graphs import Checkpoint, FitplanError, LayerGraph

from .capability import LAUNCHERS, REGISTRY, engines_of, op_selective_runners, runnable_by, selective_runners
from .pins import KNOBS, Pins

# Optimizer implementations that compute the same update: switching among them is not a training change.
SAME_MATH = {Optimizer.ADAMW: (Optimizer.ADAMW, Optimizer.ADAMW_FUSED)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Outer(Config):
    """One outer configuration: a `Config` whose per-layer checkpoint modes the inner search decides."""

    selective: bool = True
    """Whether a launcher that runs this configuration can also run selective recompute on the layers the
    search picks (`capability.selective_runners`); without one the search leaves SELECTIVE out."""
    op_selective: bool = True
    """The same for op-level selective checkpointing (`capability.op_selective_runners`, OP_SELECTIVE)."""

    def runs(self, mode: Checkpoint) -> bool:
        """Whether a launcher that runs this configuration can put layers in checkpoint `mode`."""
        return {Checkpoint.SELECTIVE: self.selective, Checkpoint.OP_SELECTIVE: self.op_selective}.get(mode, True)

    def config(self, checkpoint: tuple[Checkpoint, ...] = ()) -> Config:
        """The `Config` of these knobs with per-layer `checkpoint` modes."""
        return Config(**{name: getattr(self, name) for name in KNOBS if name != "checkpoint"}, checkpoint=checkpoint)

    @property
    def family(self) -> tuple[object, ...]:
        """What makes two configurations distinct alternatives: the parallel, sharding and offload strategy
        (micro-batch, checkpointing and same-cost precision/optimizer variants aside)."""
        return (self.tp, self.engine, self.zero, self.optimizer_offload, self.param_offload)


DEFAULT_PRECISIONS = (Precision.BF16_MIXED, Precision.FP16_MIXED, Precision.TF32, Precision.FP32)


def default_precisions(cluster: Cluster) -> tuple[Precision, ...]:
    """Mixed and full precisions the GPU runs; pure bf16 and fp8 change numerics and must be asked for."""
    return tuple(p for p in DEFAULT_PRECISIONS
                 if cluster.gpu.peak_flops(precision.matmul_dtype(p)) is not None)


def supported_precisions(cluster: Cluster, allowed: tuple[Precision, ...]) -> tuple[Precision, ...]:
    """The allowed precisions the GPU runs (fp8 only on GPUs with fp8 tensor cores); an error if none."""
    kept = tuple(p for p in allowed if cluster.gpu.peak_flops(precision.matmul_dtype_on(p, cluster.gpu))
                 is not None)
    if not kept:
        raise FitplanError(f"{cluster.gpu.name} supports none of the allowed precisions "
                           f"({', '.join(p.value for p in allowed)})",
                           "Allow a precision it runs: fp16-mixed on V100/T4, bf16-mixed from Ampere on, fp8 on "
                           "Hopper/Ada/Blackwell/MI300X.")
    return kept


@dataclass(frozen=True, slots=True)
class Space:
    outers: tuple[Outer, ...]
    modes: tuple[Checkpoint, ...]
    """Per-layer modes the solver may use."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    compile_auto: bool = False
    """torch.compile is "auto": each table keeps it only where it saves enough (`tables.build_table`)."""


# Tie-break order of (engine, ZeRO stage): the simplest runtime first (the engines' order in RULES).
ENGINE_STAGES = tuple((engine, zero) for engine, rules in RULES.items() for zero in rules.stages)


def engine_stages(pins: Pins, launchers: tuple[str, ...] = LAUNCHERS) -> list[tuple[Engine, int]]:
    """(engine, ZeRO stage) pairs the allowed launchers run (`capability.REGISTRY`), narrowed by the pins."""
    runnable = engines_of((pins.launcher,) if pins.launcher else launchers)
    return [(e, z) for e, z in ENGINE_STAGES if (e, z) in runnable and pins.allows("engine", e)
            and pins.allows("zero", z)]


def offloads(cluster: Cluster, engine: Engine, zero: int, pins: Pins) -> list[tuple[Offload, Offload]]:
    """(optimizer, parameter) offload pairs the engine supports; NVMe only where the cluster has NVMe."""
    targets = [Offload.NONE, Offload.CPU] + ([Offload.NVME] if cluster.nvme_bandwidth > 0 else [])
    pairs = []
    for opt in targets:
        for param in targets:
            try:
                Config(engine=engine, zero=zero, optimizer_offload=opt, param_offload=param)
            except ValueError:
                continue
            pairs.append((opt, param))
    return [(o, p) for o, p in pairs
            if pins.allows("optimizer_offload", o) and pins.allows("param_offload", p)]


def _compiles(engine: Engine, zero: int, pins: Pins) -> bool:
    """Compile where it is credited, or where the user pinned it on (`compilation.compile_credited`)."""
    return pins.value("compile") is True or compile_credited(Config(engine=engine, zero=zero, compile=True))


@functools.cache
def _runnable_optimizers(optimizers: tuple[Optimizer, ...], engine: Engine, zero: int, opt_off: Offload,
                         param_off: Offload) -> tuple[Optimizer, ...]:
    """The optimizers `Config` accepts with this engine and offload (8-bit AdamW never under DeepSpeed offload)."""
    kept = []
    for optimizer in optimizers:
        try:
            Config(engine=engine, zero=zero, optimizer_offload=opt_off, param_offload=param_off, optimizer=optimizer)
        except ValueError:
            continue
        kept.append(optimizer)
    return tuple(kept)


def tp_degrees(graph: LayerGraph, cluster: Cluster, pins: Pins, engine: Engine) -> list[int]:
    """TP degrees that divide the heads (the graph's list), fit in a node, and the engine can combine with."""
    degrees = [t for t in graph.tp_degrees if t <= cluster.gpus_per_node and cluster.world_size % t == 0]
    if engine is Engine.DEEPSPEED and pins.launcher != "megatron":
        degrees = [1]  # fitplan emits DeepSpeed plans for HF models without AutoTP
    return pins.keep("tp", degrees)


def micro_batches(per_rank: int, pins: Pins) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs whose product is the sequences each data-parallel rank processes."""
    pairs = [(mb, per_rank // mb) for mb in divisors(per_rank)]
    return [(mb, ga) for mb, ga in pairs if pins.allows("micro_batch", mb) and pins.allows("grad_accum", ga)]


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, in O(sqrt(n)) steps (a batch of a million sequences takes 1,000)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def outer_space(graph: LayerGraph, cluster: Cluster, workload: Workload, pins: Pins,
                launchers: tuple[str, ...] = LAUNCHERS) -> Space:
    """Every outer configuration, in a fixed order (the order breaks ties: simpler first), that an allowed
    launcher can run as emitted (`capability.unsupported`); `launchers` are those that can run this model."""
    precisions = supported_precisions(cluster, pins.allowed("precision") or default_precisions(cluster))
    # "auto" compiles where the tables find it saves enough (`tables.build_table`); never on the CPU test device.
    compile_pin = pins.value("compile")
    compiled = compile_pin is True or (compile_pin is None and cluster.gpu.vendor != "cpu")
    optimizers = tuple(dict.fromkeys(o for allowed in pins.allowed("optimizer") or (KNOBS["optimizer"].default,)
                                     for o in SAME_MATH.get(allowed, (allowed,))))
    # Knobs the loops below do not enumerate take their pinned value (else their default); those they enumerate
    # override it. So a new knob needs no change here until the search should choose it.
    pinned = {name: pins.value(name) for name in KNOBS if name != "checkpoint" and pins.value(name) is not None}
    outers = []
    for engine, zero in engine_stages(pins, launchers):
        for tp in tp_degrees(graph, cluster, pins, engine):
            dp = cluster.world_size // tp
            if workload.global_batch % dp:
                continue
            for opt_off, param_off in offloads(cluster, engine, zero, pins):
                for mb, ga in micro_batches(workload.global_batch // dp, pins):
                    for prec in precisions:
                        for optimizer in _runnable_optimizers(optimizers, engine, zero, opt_off, param_off):
                            for sp in _sequence_parallel(tp, pins):
                                outers += _valid(graph, {**pinned, **dict(
                                    tp=tp, dp=dp, engine=engine, zero=zero, optimizer_offload=opt_off,
                                    param_offload=param_off, micro_batch=mb, grad_accum=ga, precision=prec,
                                    optimizer=optimizer, sequence_parallel=sp,
                                    compile=compiled and _compiles(engine, zero, pins))})
    pinned_mode = pins.value("checkpoint")
    modes = (pinned_mode,) if pinned_mode else graph.checkpoint_modes()
    if pinned_mode is not None:
        _check_pinned_mode(graph, pins, pinned_mode, launchers)
    outers = _runnable(outers, pins, modes, lora=graph.lora, launchers=launchers)  # QLoRA/DoRA: its launchers
    if pins.launcher is not None:
        entry = REGISTRY[pins.launcher]
        if not entry.per_layer and pinned_mode is None:
            raise FitplanError(f"The {pins.launcher} launcher applies one checkpoint mode to every layer, and the "
                               "search decides per layer.", "Pin one: --checkpoint none, full or "
                               "op_selective.")
        whole_layers = entry.selective == "none"  # e.g. HF models checkpoint whole layers
        if whole_layers and pinned_mode is Checkpoint.SELECTIVE:
            raise FitplanError(f"The {pins.launcher} launcher cannot run selective recompute (it checkpoints whole "
                               "layers).", "Use --checkpoint full or auto, or --launcher megatron or torchrun.")
        if whole_layers or (entry.selective == "all-layers" and pinned_mode is None):
            # Megatron's selective recompute covers all layers or none, which the per-layer search does not keep
            # to: without a pin it plans with none/full only.
            modes = tuple(m for m in modes if m is not Checkpoint.SELECTIVE)
        if entry.op_selective != "per-layer" and pinned_mode is None:
            modes = tuple(m for m in modes if m is not Checkpoint.OP_SELECTIVE)
    return Space(tuple(outers), modes, compile_auto=compile_pin is None)


def _check_pinned_mode(graph: LayerGraph, pins: Pins, mode: Checkpoint, launchers: tuple[str, ...]) -> None:
    """A pinned checkpoint mode the lowering traced and some allowed launcher runs, else a clear error."""
    if mode is Checkpoint.OP_SELECTIVE:
        runners = op_selective_runners(launchers, all_layers=True)
        if not op_selective_runners((pins.launcher,) if pins.launcher else launchers, all_layers=True):
            who = f"The {pins.launcher} launcher" if pins.launcher else "No launcher that runs this model"
            raise FitplanError(f"{who} cannot run op-level selective checkpointing (--checkpoint op_selective).",
                               f"Launchers that can: {', '.join(runners)} (--launcher), or --checkpoint full."
                               if runners else "Use --checkpoint full or none.")
    if mode not in graph.checkpoint_modes():
        raise FitplanError(f"{graph.model} cannot be checkpointed in mode {mode} as lowered ({graph.runtime} code).",
                           f"Use one of: {', '.join(str(m) for m in graph.checkpoint_modes())}.")


def _runnable(outers: list[Outer], pins: Pins, modes: tuple[Checkpoint, ...], *, lora: object,
              launchers: tuple[str, ...]) -> list[Outer]:
    """The outers at least one allowed launcher runs as emitted (`--launcher` allows one, else any), each marked
    with whether selective and op-level selective recompute stay runnable. Launcher rules do not depend on the
    micro-batch split, so they are checked once per configuration family, not per outer."""
    allowed = (pins.launcher,) if pins.launcher else launchers
    memo: dict[Outer, tuple[str, ...]] = {}
    kept = []
    for outer in outers:
        key = replace(outer, micro_batch=1, grad_accum=1)
        if key not in memo:
            memo[key] = runnable_by(outer, lora=lora, launchers=allowed)
        runners = memo[key]
        marked = replace(outer, selective=bool(selective_runners(runners, all_layers=modes == (Checkpoint.SELECTIVE,))),
                         op_selective=bool(op_selective_runners(runners,
                                                                all_layers=modes == (Checkpoint.OP_SELECTIVE,))))
        if runners and any(marked.runs(mode) for mode in modes):
            kept.append(marked)
    return kept


def _valid(graph: LayerGraph, values: dict[str, object]) -> list[Outer]:
    """The outer configuration of `values`, or none where `Config` refuses it (e.g. optimizer-in-backward with
    accumulation) or the model does (a fused loss it has no kernel for: `estimate.model_refusals`)."""
    try:
        outer = Outer(**values)  # type: ignore[arg-type]
    except ValueError:
        return []
    return [] if model_refusals(graph, outer, modes_decided=False) else [outer]


def _sequence_parallel(tp: int, pins: Pins) -> list[bool]:
    if tp == 1:
        return [False]
    if pins.allowed("sequence_parallel") is not None:
        return list(pins.allowed("sequence_parallel"))
    return [False]  # HF TP plans do not shard sequences; Megatron/torchtitan users can pin it on


# The checkpointed modes, leanest first: the canonical order within a kind (`canonical_modes`), and the order
# of per-kind counts.
CHECKPOINTED = (Checkpoint.FULL, Checkpoint.OP_SELECTIVE, Checkpoint.SELECTIVE)


def canonical_modes(kinds: list[int], counts: dict[int, tuple[int, ...]]) -> tuple[Checkpoint, ...]:
    """Per-layer modes from per-kind counts (in `CHECKPOINTED` order: full, op-selective, selective; missing
    ones are 0): within each kind the first layers are checkpointed, the leanest mode first. Earlier layers'
    activations live longest (until their backward, last), so checkpointing them first lowers every later peak;
    Megatron's "block" recompute and HF's per-layer flags express this order."""
    seen: dict[int, int] = {}
    modes = []
    for kind in kinds:
        position = seen.get(kind, 0)
        seen[kind] = position + 1
        mode, start = Checkpoint.NONE, 0
        for candidate, count in zip(CHECKPOINTED, counts.get(kind, ()), strict=False):
            if start <= position < start + count:
                mode = candidate
            start += count
        modes.append(mode)
    return tuple(modes)


def leanest_modes(modes: tuple[Checkpoint, ...], layers: int) -> tuple[Checkpoint, ...]:
    """Every layer in the allowed mode that keeps the least activation memory (the first of `CHECKPOINTED`
    allowed)."""
    lean = next((m for m in CHECKPOINTED if m in modes), modes[0])
    return (lean,) * layers


def all_counts(kinds: list[int], modes: tuple[Checkpoint, ...]) -> list[dict[int, tuple[int, ...]]]:
    """Every per-kind count of layers in each `CHECKPOINTED` mode the allowed modes permit (the canonical
    assignments)."""
    per_kind: dict[int, list[tuple[int, ...]]] = {}
    for kind in sorted(set(kinds)):
        n = kinds.count(kind)
        options: list[tuple[int, ...]] = [()]
        for mode in CHECKPOINTED:
            options = [(*o, c) for o in options for c in (range(n + 1 - sum(o)) if mode in modes else (0,))]
        per_kind[kind] = [o for o in options if sum(o) == n or Checkpoint.NONE in modes]
    result: list[dict[int, tuple[int, ...]]] = [{}]
    for kind, options in per_kind.items():
        result = [{**partial, kind: option} for partial in result for option in options]
    return result
