"""The search space: every outer configuration the pins, the hardware and the divisibility rules allow.

Pure Python, no CP-SAT. The per-layer checkpoint modes are the inner decision (see `model.py`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from costmodels import Cluster, Config, Engine, Offload, Optimizer, Precision, Workload, precision
from costmodels.compilation import compile_credited
from costmodels.config import ContextParallel
from costmodels.engines import RULES, rules_of
from costmodels.pipeline_schedule import SINGLE_STAGE, Schedule, schedule_problem
from graphs import Checkpoint, FitplanError, LayerGraph
from solver.plan.capability import (
    LAUNCHERS,
    REGISTRY,
    engines_of,
    op_selective_runners,
)
from solver.search.outer import Outer
from solver.search.pins import KNOBS, Pins, gpu_defaults
from solver.search.runnable import Runnable

# The memory savers the search enumerates where the pins allow several values (`pin_rules.SAVER_CHOICES`).
SAVER_KNOBS = ("optimizer_in_backward", "loss", "activation_offload")
# Knobs whose declaration says where the search opens them (`Knob.searched`); unpinned, each takes those values.
SEARCHED = tuple(name for name, declared in KNOBS.items() if declared.knob.searched is not None)
# Optimizer implementations that compute the same update: switching among them is not a training change.
SAME_MATH = {Optimizer.ADAMW: (Optimizer.ADAMW, Optimizer.ADAMW_FUSED)}


DEFAULT_PRECISIONS = (Precision.BF16_MIXED, Precision.FP16_MIXED, Precision.TF32, Precision.FP32)


def default_precisions(cluster: Cluster) -> tuple[Precision, ...]:
    """Mixed and full precisions the GPU runs, with one 16-bit format: bf16-mixed where the GPU has bf16 tensor cores,
    else fp16-mixed (the HF guide's rule). Where bf16 runs, fp16's loss scaling and narrower range, and under
    Megatron its fp16 gradient accumulation, change the training for a few bytes, so fp16-mixed, pure bf16 and fp8
    must be asked for."""
    runs = tuple(p for p in DEFAULT_PRECISIONS if cluster.gpu.peak_flops(precision.matmul_dtype(p)) is not None)
    return tuple(p for p in runs if p is not Precision.FP16_MIXED or Precision.BF16_MIXED not in runs)


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
    pipelines: tuple[Outer, ...] = ()
    """Pipeline-parallel configurations (pp > 1), searched rank by rank (`pipeline_search`)."""


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


def zero_has_work(engine: Engine, zero: int, layout: dict[str, int], offload: tuple[Offload, Offload],
                  pins: Pins) -> bool:
    """Whether a DeepSpeed ZeRO stage above 0 does anything here: shard the states over several data-parallel
    ranks, or offload them (ZeRO-Offload needs stage 1 or more). On one rank with nothing offloaded it runs stage
    0's training with ZeRO's own buffers (issue 35 item 14), so the search leaves it out unless the stage is pinned."""
    if engine is not Engine.DEEPSPEED or zero == 0 or pins.value("zero") is not None:
        return True
    return layout["dp"] * layout["cp"] > 1 or any(target is not Offload.NONE for target in offload)


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
    return pins.keep("tp", degrees)


def _whole_model(engine: Engine, pins: Pins, tp: int) -> bool:
    """Whether a layout without a pipeline, CP or EP is searched with this engine. Megatron's only for --launcher
    megatron: its runs need the model in Megatron's checkpoint format, and the HF stacks run such layouts from the
    HF checkpoint (with a pipeline, CP or EP only Megatron, torchtitan or the torchrun script run them anyway).
    DeepSpeed's never with TP: fitplan emits DeepSpeed plans without AutoTP."""
    if engine is Engine.MEGATRON:
        return pins.launcher == "megatron"
    return tp == 1 or engine is not Engine.DEEPSPEED


def parallel_layouts(graph: LayerGraph, cluster: Cluster, workload: Workload, pins: Pins,
                     engine: Engine) -> list[dict[str, object]]:
    """Every way to divide the GPUs: tp x cp x pp x dp = the world size, the global batch divided by dp, with
    cp's mode and ep (taken from dp x cp) where they apply."""
    layouts: list[dict[str, object]] = []
    for tp in tp_degrees(graph, cluster, pins, engine):
        for cp, cp_mode in context_parallel(graph, cluster, workload, pins, tp):
            for pp in pipeline_degrees(graph, cluster, pins, tp * cp):
                dp = cluster.world_size // (tp * cp * pp)
                if workload.global_batch % dp == 0:
                    layouts += [dict(tp=tp, cp=cp, cp_mode=cp_mode, pp=pp, dp=dp, ep=ep)
                                for ep in expert_degrees(graph, pins, dp * cp)
                                if cp > 1 or pp > 1 or ep > 1 or _whole_model(engine, pins, tp)]
    return layouts


# Context parallelism is searched from this sequence length on (shorter ones with --cp): below it one sequence's
# activations fit a GPU under full recompute for every catalog model that fits at all, and CP only adds its K/V
# exchange (Megatron's guide suggests CP for long-context training, beyond ~8K; two doublings of margin).
LONG_CONTEXT = 32768


def context_parallel(graph: LayerGraph, cluster: Cluster, workload: Workload, pins: Pins,
                     tp: int) -> list[tuple[int, ContextParallel]]:
    """(cp, mode) pairs: degrees that split the sequence into 2 cp load-balanced chunks and divide the GPUs left
    by TP; all-to-all (Ulysses) only where tp x cp divides the query and key/value heads."""
    if graph.attention == "eager" or (pins.allowed("cp") is None and workload.seq_len < LONG_CONTEXT):
        return [(1, ContextParallel.RING)] if pins.allows("cp", 1) else []
    pairs = []
    for cp in pins.keep("cp", divisors(cluster.world_size // tp)):
        if cp > 1 and workload.seq_len % (2 * cp):
            continue
        for mode in pins.keep("cp_mode", list(ContextParallel)):
            heads_split = graph.dims.heads % (tp * cp) == 0 and graph.dims.kv_heads % (tp * cp) == 0
            if cp == 1 and mode is not ContextParallel.RING:
                continue  # the mode means nothing without CP
            if mode is ContextParallel.ALL_TO_ALL and not heads_split:
                continue
            pairs.append((cp, mode))
    return pairs


def pipeline_degrees(graph: LayerGraph, cluster: Cluster, pins: Pins, per_stage: int) -> list[int]:
    """Pipeline degrees that divide the GPUs left by TP and CP and leave a decoder layer per stage."""
    layers = len(graph.decoder_layers())
    return [pp for pp in pins.keep("pp", divisors(cluster.world_size // per_stage)) if pp <= layers]


def expert_degrees(graph: LayerGraph, pins: Pins, ranks: int) -> list[int]:
    """Expert-parallel degrees: divisors of the experts that divide the data- and context-parallel ranks (1 for
    dense models)."""
    experts = graph.dims.experts
    if not experts:
        return [1] if pins.allows("ep", 1) else []
    return [ep for ep in pins.keep("ep", divisors(ranks)) if experts % ep == 0]


# Schedules searched when not pinned: GPipe runs forward all micro-batches before any backward, so it holds all m
# in flight for the bubble 1F1B has with at most pp (Narayanan et al. 2021, section 2.2); --pp-schedule gpipe.
DEFAULT_SCHEDULES = tuple(s for s in Schedule if s is not Schedule.GPIPE)


def virtual_stages(schedule: Schedule, pp: int, m: int, layers: int, pins: Pins, engine: Engine) -> tuple[int, ...]:
    """Stages per rank that torch runs `schedule` with (`schedule_problem`), narrowed by the pins: one for 1F1B and
    GPipe, two for zbv's V, and for the interleaved schedules two (any split, through Megatron's pipeline layout and
    torchtitan's module names per part) and every larger count whose stages hold equal layers, pp x v dividing the
    decoder layers (Megatron's --num-layers-per-virtual-pipeline-stage requires it: arguments.py). More stages per
    rank shrink the bubble (by v, Narayanan et al. 2021 section 2.2) for v times the point-to-point hops and the
    stages' own receive buffers and model-wide tensors, so the cost model decides. The engine's runtime may run
    more (megatron-core's 1F1B with fewer micro-batches than stages)."""
    if schedule in SINGLE_STAGE:
        options: Iterable[int] = (1,)
    elif schedule is Schedule.ZBV:
        options = (2,)
    else:
        pinned = pins.value("pp_virtual")
        options = (pinned,) if pinned is not None else \
            (2, *(v for v in range(3, layers // pp + 1) if layers % (pp * v) == 0))
    return tuple(v for v in options if pins.allows("pp_virtual", v) and pp * v <= layers
                 and schedule_problem(schedule, pp, m, v, megatron=rules_of(engine).megatron_schedules) is None)


def pipeline_schedules(graph: LayerGraph, pins: Pins, pp: int, m: int, engine: Engine) -> list[tuple[Schedule, int]]:
    """(schedule, stages per rank) pairs the engine's runtime runs with `pp` ranks and `m` micro-batches (torch's
    pipelining, or megatron-core's schedules: `virtual_stages`); (1f1b, 1) stands for no pipeline when pp is 1.
    Each schedule comes once, at its fewest stages per rank: the space would grow tenfold with one configuration
    per count (a 405B over 1024 GPUs: pp=2 takes v up to 63), so the pipeline search opens the other counts of a
    configuration (`virtual_variants`) only while its bound can still win."""
    if pp == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    layers = len(graph.decoder_layers())
    return [(schedule, options[0]) for schedule in pins.allowed("pp_schedule") or DEFAULT_SCHEDULES
            if (options := virtual_stages(schedule, pp, m, layers, pins, engine))]


def virtual_variants(outer: Outer, *, layers: int, pins: Pins) -> tuple[Outer, ...]:
    """`outer` at every count of stages per rank its schedule runs (`virtual_stages`), `outer`'s own first: a
    launcher that runs one interleaved count runs the others (their rules read v only to refuse v = 1)."""
    counts = virtual_stages(outer.pp_schedule, outer.pp, outer.grad_accum, layers, pins, outer.engine)
    return (outer, *(replace(outer, pp_virtual=v) for v in counts if v != outer.pp_virtual))


def micro_batches(per_rank: int, pins: Pins) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs whose product is the sequences each data-parallel rank processes."""
    pairs = [(mb, per_rank // mb) for mb in divisors(per_rank)]
    return [(mb, ga) for mb, ga in pairs if pins.allows("micro_batch", mb) and pins.allows("grad_accum", ga)]


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, in O(sqrt(n)) steps (a batch of a million sequences takes 1,000)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@functools.lru_cache(maxsize=16)
def outer_space(graph: LayerGraph, cluster: Cluster, workload: Workload, pins: Pins,
                launchers: tuple[str, ...] = LAUNCHERS, pipeline_launchers: tuple[str, ...] | None = None) -> Space:
    """Every outer configuration, in a fixed order (the order breaks ties: simpler first), that an allowed
    launcher can run as emitted (`capability.unsupported`); `launchers` are those that can run this model, and
    `pipeline_launchers` (default: all of them) those that can cut it into pipeline stages
    (`support.pipeline_problems`).
    Cached: a solve asks again for its fallbacks and diagnosis, and a session for the same inputs."""
    precisions = supported_precisions(cluster, pins.allowed("precision") or default_precisions(cluster))
    # "auto" compiles where the tables find it saves enough (`tables.build_table`); never on the CPU test device.
    compile_pin = pins.value("compile")
    compiled = compile_pin is True or (compile_pin is None and cluster.gpu.vendor != "cpu")
    optimizers = tuple(dict.fromkeys(o for allowed in pins.allowed("optimizer") or (KNOBS["optimizer"].default,)
                                     for o in SAME_MATH.get(allowed, (allowed,))))
    # Knobs the loops below do not enumerate take their pinned value (else their default); those they enumerate
    # override it. So a new knob needs no change here until the search should choose it.
    pinned = {name: pins.value(name) for name in KNOBS if name != "checkpoint" and pins.value(name) is not None}
    pinned.update(gpu_defaults(cluster, pinned))  # e.g. the allocator the GPU's PyTorch build runs
    pinned_mode = pins.value("checkpoint")
    modes = (pinned_mode,) if pinned_mode else graph.checkpoint_modes()
    # which launchers run each outer (QLoRA/DoRA, graph.lora, narrow them further)
    runnable = Runnable(graph, pins, modes, launchers=launchers,
                         pipeline_launchers=launchers if pipeline_launchers is None else pipeline_launchers)
    # Memory savers (optimizer-in-backward, loss computation, activation offload): only the allowed ones (they
    # need liger-kernel or the torchrun script), the default alone when unpinned; `Outer.runs` keeps offloading
    # outers fully checkpointed, and `Config` refuses optimizer-in-backward with accumulation.
    savers = list(itertools.product(*(pins.allowed(name) or (KNOBS[name].default,) for name in SAVER_KNOBS)))
    outers = []
    for engine, zero in engine_stages(pins, launchers):
        compiles = compiled and _compiles(engine, zero, pins)
        for layout in parallel_layouts(graph, cluster, workload, pins, engine):
            if layout["pp"] > 1 and zero not in RULES[engine].pipeline_stages:
                continue  # `Config` refuses every such outer (this stage does not keep parameters for a pipeline)
            for opt_off, param_off in offloads(cluster, engine, zero, pins):
                if not zero_has_work(engine, zero, layout, (opt_off, param_off), pins):
                    continue
                for opened in opened_knobs({**layout, "engine": engine, "zero": zero, "optimizer_offload": opt_off},
                                           cluster, pins):
                    outers += _outers_of(runnable, graph, workload, pins, precisions, optimizers, savers, {
                        **pinned, **layout, **opened, "engine": engine, "zero": zero, "optimizer_offload": opt_off,
                        "param_offload": param_off, "compile": compiles})
    if pinned_mode is not None:
        _check_pinned_mode(graph, pins, pinned_mode, launchers)
    return Space(tuple(o for o in outers if o.pp == 1), _launcher_modes(pins, modes), compile_auto=compile_pin is None,
                 pipelines=tuple(o for o in outers if o.pp > 1))


def opened_knobs(values: dict[str, object], cluster: Cluster, pins: Pins) -> list[dict[str, object]]:
    """Every combination of the values the unpinned `SEARCHED` knobs' declarations offer for this layout, engine and
    stage (`Knob.searched`), narrowed by the pins; a pinned knob keeps its pin (one empty combination if none)."""
    options = [[(name, value) for value in pins.keep(name, KNOBS[name].knob.searched(values, cluster.gpus_per_node))]
               for name in SEARCHED if pins.value(name) is None]
    return [dict(combination) for combination in itertools.product(*options)]


def _outers_of(runnable: Runnable, graph: LayerGraph, workload: Workload, pins: Pins,
               precisions: tuple[Precision, ...], optimizers: tuple[Optimizer, ...], savers: list[tuple[object, ...]],
               values: dict[str, object]) -> list[Outer]:
    """The outers of one layout, engine, stage and offload (`values`): every micro-batch split, precision,
    optimizer, sequence parallelism, pipeline schedule and memory saver the pins and the runtimes allow."""
    engine, zero, layout = values["engine"], values["zero"], values  # the layout among the values
    outers: list[Outer] = []
    for mb, ga in micro_batches(workload.global_batch // layout["dp"], pins):
        if mb % workload.group or mb < workload.min_micro_batch:  # DPO: a pair shares a micro-batch;
            continue  # KTO's KL term needs two examples in one
        if mb >= layout["cp"] > 1:
            continue  # whole sequences per GPU: the same tokens without CP (`context_parallel`)
        schedules = pipeline_schedules(graph, pins, layout["pp"], ga, engine)
        for prec in precisions:
            for optimizer in _runnable_optimizers(optimizers, engine, zero, values["optimizer_offload"],
                                                  values["param_offload"]):
                for sp in _sequence_parallel(layout, engine, pins):
                    for schedule, v in schedules:
                        for saver in savers:
                            outers += runnable({**values, **dict(
                                micro_batch=mb, grad_accum=ga, precision=prec, optimizer=optimizer,
                                sequence_parallel=sp, pp_schedule=schedule, pp_virtual=v,
                                **dict(zip(SAVER_KNOBS, saver, strict=True)))})
    return outers


def _launcher_modes(pins: Pins, modes: tuple[Checkpoint, ...]) -> tuple[Checkpoint, ...]:
    """The per-layer modes the pinned launcher can run (all of `modes` without a launcher pin); an error when it
    cannot run the pinned mode, or when it applies one mode to every layer and none is pinned."""
    if pins.launcher is None:
        return modes
    pinned_mode, entry = pins.value("checkpoint"), REGISTRY[pins.launcher]
    if not entry.per_layer and pinned_mode is None:
        raise FitplanError(f"The {pins.launcher} launcher applies one checkpoint mode to every layer, and the "
                           "search decides per layer.", "Pin one: --checkpoint none, full or op_selective.")
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
    return modes


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


def _sequence_parallel(layout: dict[str, object], engine: Engine, pins: Pins) -> list[bool]:
    """Sequence parallelism where TP runs: searched where only Megatron or torchtitan run the layout (a pipeline,
    CP, or Megatron's engine), which shard the sequence with TP as standard; HF TP plans do not, so
    there it is pin-only."""
    if layout["tp"] == 1:
        return [False]
    if pins.allowed("sequence_parallel") is not None:
        return list(pins.allowed("sequence_parallel"))
    megatron_style = layout["cp"] > 1 or layout["pp"] > 1 or engine is Engine.MEGATRON  # type: ignore[operator]
    return [False, True] if megatron_style else [False]


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
