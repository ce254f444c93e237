"""The public library calls: `solve(model, gpus, ...) -> Plan` and `estimate(model, gpus, config) -> Estimate`."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from costmodels import (
    Cluster,
    Config,
    Estimate,
    Offload,
    Workload,
    load_cluster_file,
    parse_cluster,
    shared_lowering,
)
from costmodels import estimate as estimate_config
from costmodels.cluster import with_profile
from costmodels.compilation import compile_credited
from costmodels.config import Engine, Loss
from costmodels.estimator import model_refusals
from costmodels.lowering import liger_lowering
from costmodels.packing import Lengths, packed, padded
from costmodels.pipeline_schedule import Schedule
from costmodels.pipeline_stages import stage_layers
from costmodels.profile import load_profile
from costmodels.verdict import fits
from graphs import Checkpoint, FitplanError, LayerGraph, LoraSpec, UnsupportedModel, resolve
from graphs.liger import liger_version
from graphs.lowering import lower_resolved
from graphs.megatron import MEGATRON_TYPES, lower_megatron_resolved
from graphs.positions import sequence_note
from graphs.sources import ResolvedModel
from solver.plan import capability
from solver.plan.advice import advise
from solver.plan.capability import op_selective_runners
from solver.plan.launchers.support import (
    MEGATRON_PRICED,
    TITAN_PRICED,
    model_launchers,
    model_problems,
    pipeline_launchers,
    runnable_by,
)
from solver.plan.model_shape import model_shape
from solver.plan.record import ClusterInfo, Inputs, LoraDecision, Plan, ScheduleOption, SolverStats, decisions_of
from solver.search.alternatives import alternatives
from solver.search.bounds import check_workload
from solver.search.diagnose import Infeasible, NoPlanInTime, diagnose
from solver.search.model import SolveResult
from solver.search.pins import KNOBS, Pins, gpu_defaults
from solver.search.pipeline_search import PipelineResult, pipeline_infeasible, pipeline_search
from solver.search.space import Outer, Space, outer_space
from solver.search.table_search import SearchResult, build_tables, search
from solver.search.tables import TICK_SECONDS

# Common fine-tuning practice when the user gives no workload: 4096-token sequences (or the model's limit)
# and 64 sequences per step (e.g. the Alpaca/Tulu recipes use 64-128), raised to one per data-parallel rank.
DEFAULT_SEQ_LEN = 4096
DEFAULT_GLOBAL_BATCH = 64
DEFAULT_HEADROOM = 0.05
DEFAULT_TIME_LIMIT = 10.0


@dataclass(frozen=True, slots=True)
class Request:
    resolved: ResolvedModel
    cluster: Cluster
    workload: Workload
    assumed: tuple[str, ...]


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


def _workload(resolved: ResolvedModel, cluster: Cluster, seq_len: int | None, global_batch: int | None,
              tokens_per_step: int | None) -> tuple[Workload, list[str]]:
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


def megatron_lowered(resolved: ResolvedModel, lora: LoraSpec | None, attention: str | None) -> bool:
    """Whether Megatron's engine is priced on megatron-core's own GPT layers with the kernels a default Megatron-LM
    run uses (`graphs.megatron`, kernels="te"): Llama-style models, dense or MoE, without LoRA (Megatron runs no
    PEFT) or a pinned HF attention, with megatron-core installed (fitplan's `dev` extra has it, as it has
    torchtitan). Other models keep the HF lowering, which the plan's notes say."""
    return (lora is None and attention in (None, MEGATRON_PRICED)
            and resolved.as_dict().get("model_type") in MEGATRON_TYPES
            and importlib.util.find_spec("megatron") is not None)


def _graph_for(resolved: ResolvedModel, lora: LoraSpec | None, attention: str | None, cache: dict, *,
               runtime: str = "hf", op_selective: bool = False) -> Any:
    """The lowering each configuration needs, through the code that runs it: torchtitan's own model for the
    torchtitan launcher (`graphs.titan`), megatron-core's layers for Megatron's engine where they are lowered
    (`megatron_lowered`), else the Hugging Face modeling code, traced with op-level SAC only when `op_selective`
    (some allowed launcher runs it; the extra trace is not paid otherwise), and as torch.compile trains it where
    the configuration compiles (`graphs.compiled`)."""
    megatron = megatron_lowered(resolved, lora, attention)

    def graph(outer: Outer) -> LayerGraph:
        dtype, autocast = shared_lowering(outer.config(), lora=lora is not None)
        if megatron and outer.engine is Engine.MEGATRON:
            key = ("megatron", dtype)
            if key not in cache:
                try:
                    cache[key] = lower_megatron_resolved(resolved, dtype=dtype, kernels="te")
                except UnsupportedModel:  # a config megatron-core's GPT layers cannot build: priced on the HF code
                    cache[key] = None
            if cache[key] is not None:
                return cache[key]
        compiled, liger = compile_credited(outer.config()), liger_lowering(outer.config())
        if runtime == "torchtitan":  # FSDP2 casts the parameters itself (the torchtitan rule keeps autocast out)
            key = ("torchtitan", dtype, compiled)
            if key not in cache:
                cache[key] = _lower_titan(resolved, dtype=dtype, compiled=compiled)
            return cache[key]
        key = (dtype, autocast, op_selective, compiled, liger)
        if key not in cache:
            cache[key] = _lower_hf(resolved, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                                   op_selective=op_selective, compiled=compiled, liger=liger)
        return cache[key]
    return graph


def _lower_titan(resolved: ResolvedModel, *, dtype: str, compiled: bool) -> LayerGraph:
    """torchtitan's own model code; a compiled one falls back to eager where its blocks are not traced compiled
    (MoE: compiling saves memory, so eager prices it conservatively)."""
    from graphs.titan import lower_titan_resolved  # imports torch: only when torchtitan is planned

    try:
        return lower_titan_resolved(resolved, dtype=dtype, compiled=compiled)
    except UnsupportedModel:
        if not compiled:
            raise
        return lower_titan_resolved(resolved, dtype=dtype)


def _lower_hf(resolved: ResolvedModel, *, dtype: str, autocast: str | None, attention: str | None,
              lora: LoraSpec | None, op_selective: bool, compiled: bool, liger: bool = False) -> LayerGraph:
    """The HF-code lowering (with Liger's patch where the plan runs it, `costmodels.lowering.liger_lowering`); a
    compiled one falls back to eager where AOTAutograd cannot trace the model (compiling saves memory, so eager
    prices it conservatively)."""
    options = {"dtype": dtype, "autocast": autocast, "attention": attention, "lora": lora,
               "op_selective": op_selective, "liger": liger}
    try:
        return lower_resolved(resolved, **options, compiled=compiled)
    except UnsupportedModel:
        if not compiled:
            raise
        return lower_resolved(resolved, **options)


def _titan_priced(space: Space, *, lora: bool) -> Space:
    """The configurations torchtitan's lowering prices: without FSDP2, torchtitan runs mixed precision under
    torch.autocast (train.py maybe_enable_amp), which its trace (parameters in the compute dtype) does not run."""
    def priced(outers: tuple[Outer, ...]) -> tuple[Outer, ...]:
        return tuple(o for o in outers if shared_lowering(o.config(), lora=lora)[1] is None)

    kept, pipelines = priced(space.outers), priced(space.pipelines)
    note = "DDP with mixed precision left out (torchtitan autocasts it; its lowering traces FSDP2's casting)"
    dropped = len(kept) < len(space.outers) or len(pipelines) < len(space.pipelines)
    return replace(space, outers=kept, pipelines=pipelines, notes=(*space.notes, note) if dropped else space.notes)


def _runtime_lowering(pins: Pins, launchers: tuple[str, ...]) -> dict[str, Any]:
    """The lowering options of `_graph_for` for the allowed launchers: torchtitan's code when pinned, else HF's
    with op-level SAC traced where an allowed launcher can run it and the checkpoint pin allows it."""
    if pins.launcher == "torchtitan":
        return {"runtime": "torchtitan"}
    pinned = pins.value("checkpoint")
    allowed = (pins.launcher,) if pins.launcher else launchers
    wanted = pins.allows("checkpoint", Checkpoint.OP_SELECTIVE) and \
        bool(op_selective_runners(allowed, all_layers=pinned is Checkpoint.OP_SELECTIVE))
    return {"op_selective": wanted}


def solve(model: str, gpus: str | Cluster, *, seq_len: int | None = None, global_batch: int | None = None,
          tokens_per_step: int | None = None, headroom: float = DEFAULT_HEADROOM,
          time_limit: float = DEFAULT_TIME_LIMIT, lora: LoraSpec | None = None, allow_lora: bool = False,
          allow_savers: bool = False, attention: str | None = None, alternatives_count: int = 3,
          input_tokens_per_s: float | None = None, cluster_options: dict[str, Any] | None = None,
          pins: Pins | None = None, dataset_lengths: Lengths | None = None, packing: str = "none",
          **knobs: Any) -> Plan:
    """The fastest configuration that fits, proved optimal under fitplan's cost model when CP-SAT finishes.

    Pins: `pins`, or knob values by name (`costmodels.knobs`: tp=2, engine="fsdp2", precision=("bf16-mixed",
    "fp8"), compile="off", checkpoint="full", ...) and `launcher` (see `Pins.of`). `input_tokens_per_s` is the rate one
    data-loading worker supplies (for the input-pipeline check). `cluster_options` override what a cluster
    string assumes (cpu_ram_gib, cpu_cores, gpus_per_node, nvme_gbps, inter_node_gbps; see `parse_cluster`).
    `dataset_lengths` (`costmodels.packing.read_lengths`) with `packing` ("none": each micro-batch padded to its
    longest sequence; "wrapped" or "bfd": TRL's packing into rows of seq_len) plans memory on the longest
    micro-batch the data can make, and the plan says how many of the computed tokens are real. `allow_savers`
    lets the search choose the memory savers that keep the training where they are not pinned: the loss
    computation (hf, torchtune's chunked, Liger's fused-linear) and activation offload (`SAVER_CHOICES`).
    """
    started = time.perf_counter()
    if not 0 <= headroom < 1:
        raise FitplanError(f"headroom={headroom} must be in [0, 1)", "e.g. --headroom 0.1 keeps 10% free.")
    if packing not in PACKINGS:
        raise FitplanError(f"packing={packing!r} is not one of {', '.join(PACKINGS)}",
                           "none pads each micro-batch; wrapped and bfd pack sequences into rows (TRL).")
    resolved = resolve(model)
    cluster = cluster_from(gpus, **(cluster_options or {}))
    workload, assumed = _workload(resolved, cluster, seq_len, global_batch, tokens_per_step)
    cap = workload.seq_len
    if dataset_lengths is not None:
        workload = _longest_batch(workload, dataset_lengths, packing)
        if workload.seq_len < cap:
            assumed = [*assumed, f"sequence length {workload.seq_len:,}: the longest in the dataset lengths "
                                 f"(padding to the longest in each micro-batch; --seq-len {cap:,} caps it)"]
    plan = _plan(resolved, cluster, workload, headroom=headroom, time_limit=time_limit, lora=lora,
                 allow_lora=allow_lora, allow_savers=allow_savers, attention=attention,
                 alternatives_count=alternatives_count,
                 input_tokens_per_s=input_tokens_per_s, pins=pins, knobs=knobs, assumed=assumed, started=started,
                 gpus=gpus)
    return plan if dataset_lengths is None else _with_batching(plan, dataset_lengths, packing, cap)


PACKINGS = ("none", "wrapped", "bfd")


def _longest_batch(workload: Workload, lengths: Lengths, packing: str) -> Workload:
    """The workload memory must be planned on: padded micro-batches are as long as the longest sequence the data
    holds (cut to seq_len); packed rows are seq_len tokens."""
    if packing != "none":
        return workload
    return replace(workload, seq_len=min(workload.seq_len, lengths.longest))


def _with_batching(plan: Plan, lengths: Lengths, packing: str, seq_len: int) -> Plan:
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


def _plan(resolved: ResolvedModel, cluster: Cluster, workload: Workload, *, headroom: float, time_limit: float,
          lora: LoraSpec | None, allow_lora: bool, attention: str | None, alternatives_count: int,
          input_tokens_per_s: float | None, pins: Pins | None, knobs: dict[str, Any], assumed: list[str],
          started: float, gpus: str | Cluster, allow_savers: bool = False) -> Plan:
    if pins is not None and knobs:
        raise FitplanError("Give pins either as `pins=` or as knob keywords, not both.", "Use one of the two.")
    pin = pins if pins is not None else _pins(knobs)
    if allow_savers:
        pin, assumed = _with_savers(pin, assumed)
    pin, assumed = _installed_losses(pin, assumed)
    if lora is not None and (lora.quantization or lora.use_dora or lora.use_rslora or lora.modules_to_save) and \
            pin.launcher not in (None, *capability.PEFT_VARIANT_RUNNERS):
        raise FitplanError(f"The {pin.launcher} launcher cannot load QLoRA/DoRA/rsLoRA adapters or "
                           "modules_to_save.",
                           f"Launchers that can: {', '.join(capability.PEFT_VARIANT_RUNNERS)}.")
    if pin.value("activation_offload") and pin.value("checkpoint") is None:
        pin = _pinned(pin, "checkpoint", Checkpoint.FULL)
        assumed = [*assumed, "full activation checkpointing on every layer (activation offload needs it)"]
    elif pin.value("activation_offload") and pin.value("checkpoint") is not Checkpoint.FULL:
        raise FitplanError(f"--activation-offload on needs full checkpointing on every layer, not "
                           f"--checkpoint {pin.value('checkpoint')} (torchtune refuses it otherwise).",
                           "Use --checkpoint full (or leave it to the solver).")

    def search(adapters: LoraSpec | None, notes: list[str]) -> Plan:
        # a launcher that applies one checkpoint mode to every layer (torchtitan, axolotl) compares whole modes
        run = _fastest_uniform if _uniform_modes(pin) else _solve
        return run(resolved, cluster, workload, pin, headroom=headroom, time_limit=time_limit, lora=adapters,
                   attention=attention, assumed=notes, started=started, alternatives_count=alternatives_count,
                   gpus=gpus, input_rate=input_tokens_per_s)

    try:
        return search(lora, assumed)
    except Infeasible:
        if not allow_lora or lora is not None:
            raise
    return _fastest_adapters(search, assumed)


def _fastest_adapters(search: Callable[[LoraSpec | None, list[str]], Plan], assumed: list[str]) -> Plan:
    """Full fine-tuning does not fit: the faster of LoRA (r=16 on all linear layers) and QLoRA (the same adapters
    on a 4-bit NF4 base with double quantisation, as the QLoRA paper trains), each searched on its own; QLoRA only
    when it is faster or 16-bit LoRA cannot fit (it changes the training more), and the plan says what the other
    one would have cost."""
    why = "full fine-tuning does not fit"
    lora = qlora = None
    failures: list[Infeasible] = []
    try:
        lora = search(LoraSpec(), [*assumed, f"{why}; LoRA r=16 on all linear layers"])
    except Infeasible as err:
        failures.append(err)
    try:
        qlora = search(LoraSpec(quantization="nf4", double_quant=True),
                       [*assumed, f"{why}; QLoRA r=16 on all linear layers over a 4-bit NF4 base (double "
                        "quantisation)"])
    except Infeasible as err:
        failures.append(err)
    if lora is None and qlora is None:  # QLoRA's diagnosis is the leanest; say that 16-bit LoRA was tried too
        last = failures[-1]
        raise Infeasible(f"Neither full fine-tuning nor 16-bit LoRA nor QLoRA fits. With QLoRA: {last.message}",
                         last.hint, last.diagnosis)
    if qlora is None or (lora is not None and lora.estimate.time.step_time <= qlora.estimate.time.step_time):
        other = "QLoRA does not fit either" if qlora is None else \
            f"QLoRA would take {qlora.estimate.time.step_time:.3g} s per step"
        chosen, note = lora, f"16-bit LoRA chosen: {other}"
    else:
        other = "16-bit LoRA does not fit" if lora is None else \
            f"16-bit LoRA would take {lora.estimate.time.step_time:.3g} s per step"
        chosen, note = qlora, f"QLoRA chosen as the faster: {other} (QLoRA quantizes the frozen base to 4 bits)"
    assert chosen is not None
    return replace(chosen, inputs=replace(chosen.inputs, assumed=(*chosen.inputs.assumed, note)))


def _uniform_modes(pins: Pins) -> tuple[Checkpoint, ...]:
    """The checkpoint modes to compare when the pinned launcher applies one mode to every layer (torchtitan) and
    none is pinned: every mode it runs, least recompute first (ties go to it); empty otherwise."""
    entry = capability.REGISTRY.get(pins.launcher) if pins.launcher else None
    if entry is None or entry.per_layer or pins.value("checkpoint") is not None:
        return ()
    runs = {Checkpoint.NONE: True, Checkpoint.SELECTIVE: entry.selective != "none",
            Checkpoint.OP_SELECTIVE: entry.op_selective != "none", Checkpoint.FULL: True}
    return tuple(m for m in (Checkpoint.NONE, Checkpoint.SELECTIVE, Checkpoint.OP_SELECTIVE, Checkpoint.FULL)
                 if runs[m] and pins.allows("checkpoint", m))


def _fastest_uniform(resolved: ResolvedModel, cluster: Cluster, workload: Workload, pins: Pins, *,
                     time_limit: float, assumed: list[str], **options: Any) -> Plan:
    """The fastest plan over the launcher's whole-model checkpoint modes, each searched with that mode pinned
    (the time limit shared); Infeasible (the leanest mode's diagnosis) when none fits."""
    modes = _uniform_modes(pins)
    note = (f"one checkpoint mode for every layer ({pins.launcher} applies one policy): the fastest that fits "
            f"of {', '.join(map(str, modes))}")
    best: Plan | None = None
    failure: Infeasible | None = None
    for mode in modes:
        try:
            plan = _solve(resolved, cluster, workload, _pinned(pins, "checkpoint", mode),
                          time_limit=time_limit / len(modes), assumed=[*assumed, note], **options)
        except Infeasible as err:
            failure = err
            continue
        if best is None or plan.estimate.time.step_time < best.estimate.time.step_time:
            best = plan
    if best is None:
        raise failure or Infeasible("Nothing fits.", "Relax the pins.")
    return replace(best, inputs=replace(best.inputs, pins=pins.shown()))


# What `allow_savers` opens where the user pinned nothing: the savers that keep the training (same math, other
# kernels or memory placement), chosen by the search jointly with every other knob.
SAVER_CHOICES: dict[str, tuple[Any, ...]] = {"loss": tuple(Loss), "activation_offload": (False, True)}


def _with_savers(pins: Pins, assumed: list[str]) -> tuple[Pins, list[str]]:
    """`pins` with the unpinned `SAVER_CHOICES` knobs allowed all their values, and the note that says so."""
    opened = [name for name in SAVER_CHOICES if pins.allowed(name) is None]
    for name in opened:
        pins = _pinned_set(pins, name, SAVER_CHOICES[name])
    if opened:
        assumed = [*assumed, "memory savers searched (--allow-savers): " + ", ".join(
            f"{KNOBS[name].option} {','.join(_shown(v) for v in SAVER_CHOICES[name])}" for name in opened)
            + " (the guide line says what each chosen one runs on)"]
    return pins, assumed


def _installed_losses(pins: Pins, assumed: list[str]) -> tuple[Pins, list[str]]:
    """Liger's fused-linear loss is priced by tracing liger-kernel's own patch, so it needs the package here:
    without it, dropped from a list of allowed losses (said in the plan), an error when it is the only one."""
    allowed = pins.allowed("loss")
    if allowed is None or Loss.FUSED_LINEAR not in allowed or liger_version() is not None:
        return pins, assumed
    install = ("pip install liger-kernel (fitplan traces its patch to price it; the run needs it too), or plan "
               "another --loss.")
    kept = tuple(loss for loss in allowed if loss is not Loss.FUSED_LINEAR)
    if not kept:
        raise FitplanError("--loss fused-linear needs liger-kernel, which is not installed here.", install)
    return _pinned_set(pins, "loss", kept), [*assumed, "--loss fused-linear left out: liger-kernel is not "
                                                       "installed here (" + install + ")"]


def _shown(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


# The knobs that save memory without changing the training (besides the optimizer): pinned, they can leave no
# configuration for a reason of their own (the model, or no launcher), which is said instead of a pin search.
_SAVERS = ("optimizer_in_backward", "loss", "activation_offload")


def _check_memory_savers(pins: Pins, graph: LayerGraph, launchers: tuple[str, ...]) -> None:
    """A FitplanError naming why the pinned memory savers cannot run on this model or any allowed launcher."""
    knobs = {name: pins.value(name) for name in _SAVERS if pins.value(name) not in (None, False, KNOBS[name].default)}
    if not knobs:
        return
    config = Config(**knobs, checkpoint=(Checkpoint.FULL,) * len(graph.decoder_layers()))
    reasons = model_refusals(graph, config)
    if not reasons and not capability.runnable_by(config, launchers=launchers):
        reasons = sorted({p for name in launchers for p in capability.unsupported(name, config)
                          if any(word in p for word in ("optimizer-in-backward", "cross-entropy", "activation"))})
    if reasons:
        flags = " ".join(f"{KNOBS[n].option} {'on' if v is True else v}" for n, v in knobs.items())
        raise FitplanError(f"{flags} cannot run here: {'; '.join(reasons)}.",
                           "Leave these knobs to the solver, or estimate them with `fitplan estimate`.")


def _pinned(pins: Pins, name: str, value: Any) -> Pins:
    """`pins` with knob `name` pinned to `value` as well."""
    return _pinned_set(pins, name, (value,))


def _pinned_set(pins: Pins, name: str, values: tuple[Any, ...]) -> Pins:
    """`pins` with knob `name` allowed exactly `values`."""
    fixed = {**pins.as_dict, name: values}
    return Pins(tuple((n, fixed[n]) for n in KNOBS if n in fixed), pins.launcher)


def _pins(pins: dict[str, Any]) -> Pins:
    try:
        return Pins.of(**pins)
    except ValueError as err:
        raise FitplanError(f"Invalid pin: {err}", "Check the value against `solve --help`.") from err


def _solve(resolved: ResolvedModel, cluster: Cluster, workload: Workload, pins: Pins, *, headroom: float,
           time_limit: float, lora: LoraSpec | None, attention: str | None, assumed: list[str], started: float,
           alternatives_count: int, gpus: str | Cluster, input_rate: float | None) -> Plan:
    cache: dict = {}
    hf_graph = _graph_for(resolved, lora, attention, cache)(Outer())
    inputs = _inputs(resolved, cluster, workload, pins, headroom, assumed, gpus, hf_graph)
    launchers = model_launchers(inputs, hf_graph.attention)
    if pins.launcher is not None and pins.launcher not in launchers:
        raise FitplanError(f"The {pins.launcher} launcher cannot run this model: "
                           f"{'; '.join(model_problems(pins.launcher, inputs, hf_graph.attention))}.",
                           f"Launchers that can: {', '.join(launchers)}.")
    # The runtime is part of the lowering: price the code the allowed launchers run.
    graph_of = _graph_for(resolved, lora, attention, cache, **_runtime_lowering(pins, launchers))
    any_graph = graph_of(Outer())
    pipelined = pipeline_launchers(inputs, launchers)
    space = outer_space(any_graph, cluster, workload, pins, launchers, pipelined)
    if any_graph.runtime == "torchtitan":
        space = _titan_priced(space, lora=lora is not None)
    if not space.outers and not space.pipelines:
        _check_memory_savers(pins, any_graph, (pins.launcher,) if pins.launcher else launchers)
        raise Infeasible(*diagnose(None, inputs, pins, space, rebuild=lambda relaxed: outer_space(
            any_graph, cluster, workload, relaxed, launchers, pipelined)))
    # Lowering (cached on disk after the first run) is not counted. Of the limit, table building gets half,
    # the search runs until 85%, and the rest is for the report (alternatives stop at the limit).
    lowered = set()
    for outer in (*space.outers, *space.pipelines):  # lower every needed variant first: outside the time limit
        # what `graph_of` reads (through `lowering_for`, `compile_credited`, `liger_lowering`): one call per variant
        variant = (outer.precision, outer.engine, outer.zero, outer.compile, outer.loss)
        if variant in lowered:
            continue
        lowered.add(variant)
        graph_of(outer)
        if space.compile_auto and outer.compile:  # the table may keep it eager (`tables.build_table`)
            graph_of(replace(outer, compile=False))
    begin = time.perf_counter()
    deadline = begin + time_limit
    tables = build_tables(space, graph_of, cluster, workload, headroom=headroom, deadline=begin + 0.5 * time_limit)
    kinds = [layer.kind for layer in any_graph.decoder_layers()]
    search_limit = max(0.01, begin + 0.85 * time_limit - time.perf_counter())
    found = search(tables, kinds, space.modes, time_limit=search_limit, configurations=len(space.outers))
    result = found.result
    adapters = None if lora is None else LoraDecision.of(lora)

    def runs(config: Config) -> bool:  # the launchers the plan will list run it (its model's limits included)
        d = decisions_of(config, config.checkpoint, lora=adapters, attention=any_graph.attention)
        return any(pins.launcher in (None, name) for name in runnable_by(d, inputs))

    piped, pipeline_status = _pipeline(space, graph_of, cluster, workload, found, headroom=headroom,
                                       deadline=begin + 0.85 * time_limit, runs=runs)
    configurations = len(space.outers) + len(space.pipelines)
    if not space.outers and piped is not None and piped.outer is None and pipeline_status == "INFEASIBLE":
        raise Infeasible(*pipeline_infeasible(space.pipelines, graph_of, cluster, workload, headroom=headroom,
                                              model=inputs.model, gpus=inputs.cluster.spec))
    if (piped is None or piped.outer is None) and result.table is None and result.status == "INFEASIBLE" \
            and pipeline_status in ("INFEASIBLE", None):  # proven over the whole space
        message, hint, diagnosis = diagnose(found, inputs, pins, space, lora=lora is not None,
                                            quantized=lora is not None and lora.quantization is not None,
                                            tp_degrees=any_graph.tp_degrees)
        raise Infeasible(message, hint, {**diagnosis, "explored": len(tables), "configurations": configurations})
    if (piped is None or piped.outer is None) and result.table is None:
        raise NoPlanInTime(time_limit, len(tables), configurations)
    if piped is not None and piped.outer is not None:  # a pipeline configuration beats every whole-model one
        status = "OPTIMAL" if result.status in ("OPTIMAL", "INFEASIBLE") and piped.status == "OPTIMAL" else "FEASIBLE"
        outer, modes = piped.outer, piped.modes
        result = SolveResult(status, piped.step_ticks * found.weight, None, result.wall_seconds, None, modes)
    else:
        outer, modes = tables[result.table].outer, result.modes
        if pipeline_status not in (None, "OPTIMAL", "INFEASIBLE") and result.status == "OPTIMAL":
            result = replace(result, status="FEASIBLE")  # a pipeline configuration left unsearched might be faster
    graph = graph_of(outer)
    if outer.pp > 1:  # the plan records the split it was priced with
        outer = replace(outer, pp_split=stage_layers(graph, workload, outer.config()))
    config = outer.config(modes)
    estimate = estimate_config(graph, cluster, workload, config)
    guide = advise(graph, cluster, workload, config, estimate, compile_pin=pins.value("compile"),
                   input_tokens_per_s=input_rate, allowed_optimizers=pins.allowed("optimizer") or
                   (Config().optimizer,), lora=lora is not None,
                   savers_allowed=len(pins.allowed("loss") or ()) > 1
                   or len(pins.allowed("activation_offload") or ()) > 1, headroom=headroom)
    if guide.compile != config.compile:  # not expected: the tables decide "auto" (tables.build_table)
        config = replace(config, compile=guide.compile)
        estimate = estimate_config(graph, cluster, workload, config)
    decisions = replace(decisions_of(outer, modes, lora=adapters, attention=graph.attention),
                        compile=guide.compile, dataloader_num_workers=guide.workers)
    objective = result.objective // found.weight * TICK_SECONDS if result.objective is not None else \
        estimate.time.step_time
    bound = result.bound // found.weight * TICK_SECONDS if result.bound is not None else None
    stats = SolverStats(status=result.status, objective_seconds=objective, bound_seconds=bound,
                        gap=None if bound is None or objective == 0 else max(0.0, (objective - bound) / objective),
                        wall_seconds=0.0, configurations=configurations,
                        considered=len(found.candidates), time_limit_seconds=time_limit, explored=len(tables))
    alts = alternatives(found, kinds, space.modes, graph_of, cluster, workload, chosen=result.table,
                        pipeline=(outer, estimate.time.step_time) if piped is not None else None,
                        count=alternatives_count, deadline=deadline)
    stats = replace(stats, wall_seconds=time.perf_counter() - started)
    fastest_fits = all(m is Checkpoint.NONE for m in modes) and outer.optimizer_offload is Offload.NONE \
        and outer.param_offload is Offload.NONE
    binding = "none: the fastest settings already fit" if fastest_fits else \
        "device memory: faster settings (less recompute, less sharding or offload) do not fit"
    runners = runnable_by(decisions, inputs)  # a plan priced on torchtitan's code runs there only (its attention)
    if not runners:  # the space keeps only what some allowed launcher runs (`space._runnable`)
        raise FitplanError(f"No launcher runs the chosen configuration as emitted: {decisions.summary()}.",
                           "This is a fitplan bug; please report it with the command line.")
    schedules = _schedule_options(space, outer, modes, graph, cluster, workload, headroom, estimate) \
        if outer.pp > 1 else ()
    return Plan(inputs=inputs, decisions=decisions, estimate=estimate, solver=stats, alternatives=alts,
                schedules=schedules,
                launchers=runners, binding=binding, advice=guide.lines)


def _schedule_options(space: Space, outer: Outer, modes: tuple[Checkpoint, ...], graph: LayerGraph,
                      cluster: Cluster, workload: Workload, headroom: float,
                      chosen: Estimate) -> tuple[ScheduleOption, ...]:
    """The chosen pipeline configuration's layout and per-layer recompute priced under every other schedule the
    search had for it (each with its own balanced split), the chosen one first, then, where the search chose
    another split, the chosen schedule at the FLOP-balanced split: why the schedule and the split won."""
    def same(o: Outer) -> Outer:
        return replace(o, pp_schedule=Schedule.GPIPE, pp_virtual=1, pp_split=())  # GPipe: any m (1F1B needs m >= pp)

    def option(config: Config, priced: Estimate, *, is_chosen: bool) -> ScheduleOption:
        split = priced.pipeline.stage_layers if priced.pipeline is not None else ()
        return ScheduleOption(schedule=str(config.pp_schedule), virtual=config.pp_virtual, split=split,
                              step_time=priced.time.step_time, bubble=priced.time.bubble,
                              device_peak=priced.memory.device_peak, fits=fits(priced, cluster, headroom).fits,
                              chosen=is_chosen)

    options = [option(outer.config(modes), chosen, is_chosen=True)]
    balanced = replace(outer, pp_split=()).config(modes)
    if stage_layers(graph, workload, balanced) != outer.pp_split:
        options.append(option(balanced, estimate_config(graph, cluster, workload, balanced), is_chosen=False))
    for other in space.pipelines:
        if same(other) == same(outer) and (other.pp_schedule, other.pp_virtual) != \
                (outer.pp_schedule, outer.pp_virtual):
            config = other.config(modes)
            options.append(option(config, estimate_config(graph, cluster, workload, config), is_chosen=False))
    return tuple(options)


def _pipeline(space: Space, graph_of: Callable[[Outer], LayerGraph], cluster: Cluster, workload: Workload,
              found: SearchResult, *, headroom: float, deadline: float,
              runs: Callable[[Config], bool]) -> tuple[PipelineResult | None, str | None]:
    """The pipeline search over the space's pipeline configurations, against the whole-model search's plan
    (`pipeline_search`), and its status (None without pipeline configurations)."""
    if not space.pipelines:
        return None, None
    result = found.result
    incumbent = result.objective // found.weight if result.objective is not None else None
    piped = pipeline_search(space.pipelines, graph_of, cluster, workload, headroom=headroom, modes=space.modes,
                            incumbent=incumbent, deadline=deadline, runs=runs)
    return piped, piped.status


def _inputs(resolved: ResolvedModel, cluster: Cluster, workload: Workload, pins: Pins, headroom: float,
            assumed: list[str], gpus: str | Cluster, graph: LayerGraph) -> Inputs:
    info = ClusterInfo(spec=gpus if isinstance(gpus, str) else f"{cluster.world_size}x{cluster.gpu.id}",
                       gpu=cluster.gpu.id, gpu_name=cluster.gpu.name, nodes=cluster.nodes,
                       gpus_per_node=cluster.gpus_per_node, gpu_memory_bytes=cluster.gpu.memory_bytes,
                       cpu_ram_per_node_bytes=cluster.cpu_ram_per_node,
                       inter_node_bytes_per_s=cluster.inter_node_bandwidth, nvme_bytes_per_s=cluster.nvme_bandwidth,
                       assumptions=cluster.assumptions)
    defaults = [*assumed, f"memory headroom {headroom:.0%} of each GPU kept free (--headroom)"]
    if pins.allowed("precision") is None:
        defaults.append("precisions: any the GPU supports among bf16-mixed, fp16-mixed, tf32, fp32 "
                        "(pure bf16 and fp8 only when allowed: --precision)")
    return Inputs(model=resolved.id, model_source=resolved.source, architecture=graph.architecture,
                  layer_class=graph.layer_class, hidden_size=graph.dims.hidden, num_layers=graph.dims.layers,
                  cluster=info, seq_len=workload.seq_len,
                  global_batch=workload.global_batch, tokens_per_step=workload.tokens_per_step, headroom=headroom,
                  pins=pins.shown(),
                  assumed=tuple(defaults), shape=model_shape(graph, resolved.as_dict(), seq_len=workload.seq_len))


def estimate(model: str, gpus: str | Cluster, config: Config | dict[str, Any], *, seq_len: int | None = None,
             global_batch: int | None = None, lora: LoraSpec | None = None, attention: str | None = None) -> Estimate:
    """Memory and time of one given configuration (names resolved, the model lowered as the config needs).

    `config` may be a `Config` or a dict of its fields; when `global_batch` is None it is micro_batch x
    grad_accum x dp.
    """
    resolved = resolve(model)
    cluster = cluster_from(gpus)
    if isinstance(config, dict):  # knobs left unset take the defaults `solve` takes on these GPUs
        config = {**config, **gpu_defaults(cluster, config)}
    cfg = config_from(config, layers=None)
    dtype, autocast = shared_lowering(cfg, lora=lora is not None)
    mode = config.get("checkpoint") if isinstance(config, dict) else None
    op_selective = Checkpoint.OP_SELECTIVE in cfg.checkpoint or str(mode) == Checkpoint.OP_SELECTIVE.value
    outer = Outer(**{name: getattr(cfg, name) for name in KNOBS if name != "checkpoint"})
    if attention == TITAN_PRICED:  # a torchtitan plan's decisions: priced on torchtitan's own model code
        graph = _graph_for(resolved, lora, None, {}, runtime="torchtitan")(outer)
    elif cfg.engine is Engine.MEGATRON and megatron_lowered(resolved, lora, attention):
        graph = _graph_for(resolved, lora, attention, {})(outer)  # megatron-core's layers, as solve prices them
    elif attention == MEGATRON_PRICED:
        raise FitplanError(f"attention={MEGATRON_PRICED} is Transformer Engine's attention on megatron-core's layers, "
                           f"which only Megatron's engine runs, for {', '.join(MEGATRON_TYPES)} models.",
                           "Pass --engine megatron, or leave --attention out.")
    else:
        graph = _lower_hf(resolved, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                          op_selective=op_selective, compiled=compile_credited(cfg), liger=liger_lowering(cfg))
    cfg = config_from(config, layers=len(graph.decoder_layers()))
    batch = global_batch or cfg.micro_batch * cfg.grad_accum * cfg.dp
    workload, _ = _workload(resolved, cluster, seq_len, batch, None)
    return estimate_config(graph, cluster, workload, cfg)


def config_from(config: Config | dict[str, Any], *, layers: int | None) -> Config:
    """A `Config` from a dict of knob values (CLI flags, a JSON file), each parsed as the knob record declares;
    a single checkpoint mode applies to every layer."""
    if isinstance(config, Config):
        return config
    values = dict(config)
    try:
        unknown = set(values) - set(KNOBS)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        mode = values.get("checkpoint")
        if isinstance(mode, str):
            values["checkpoint"] = () if layers is None else (Checkpoint(mode),) * layers
        return Config(**{name: KNOBS[name].parse(value) for name, value in values.items()})
    except (TypeError, ValueError) as err:
        raise FitplanError(f"Invalid configuration: {err}", f"Fields: {', '.join(KNOBS)}.") from err
