"""The public library calls: `solve(model, gpus, ...) -> Plan` and `estimate(model, gpus, config) -> Estimate`.

A thin facade: arguments become a `search.request.Request` and its pins, the search lives in `solver.search`, and
the lowering that prices a configuration is chosen by `solver.search.route` for both calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from costmodels.breakdown import Estimate
from costmodels.cluster import Cluster
from costmodels.config import Config, Engine
from costmodels.estimator import estimate as estimate_config
from costmodels.packing import Lengths
from costmodels.tasks import PAIR_TASKS
from graphs import Checkpoint, FitplanError, LayerGraph, LoraSpec, resolve
from solver.plan import capability
from solver.plan.launchers.parallelism import parallelism_problems
from solver.plan.launchers.support import USER_SCRIPT_LAUNCHERS, runnable_by
from solver.plan.record import LoraDecision, Plan, decisions_of
from solver.search import post_training as post
from solver.search import strategies
from solver.search.pin_rules import pins_of, prepared
from solver.search.pins import KNOBS, Pins, gpu_defaults
from solver.search.post_training import PostRequest
from solver.search.request import (
    DEFAULT_HEADROOM,
    DEFAULT_TIME_LIMIT,
    PACKINGS,
    Request,
    cluster_from,
    longest_batch,
    plan_inputs,
    spec_of,
    with_batching,
    workload_for,
)
from solver.search.route import MEGATRON_PRICED, TITAN_LOSSES, TITAN_PRICED, Lowerings, Route

__all__ = ["DEFAULT_HEADROOM", "DEFAULT_TIME_LIMIT", "cluster_from", "config_from", "estimate", "solve"]


def solve(model: str, gpus: str | Cluster, *, seq_len: int | None = None, global_batch: int | None = None,
          tokens_per_step: int | None = None, headroom: float = DEFAULT_HEADROOM,
          time_limit: float = DEFAULT_TIME_LIMIT, lora: LoraSpec | None = None, allow_lora: bool = False,
          allow_savers: bool = False, attention: str | None = None, alternatives_count: int = 3,
          input_tokens_per_s: float | None = None, cluster_options: dict[str, Any] | None = None,
          pins: Pins | None = None, dataset_lengths: Lengths | None = None, packing: str = "none",
          progress: Callable[[str], None] | None = None, deterministic: bool = False,
          post_training: PostRequest | None = None, kbit_preparation: bool = False, **knobs: Any) -> Plan:
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
    `progress` is told each long step as it starts (a lowering, the search). `deterministic` searches the whole space
    with `time_limit` as each CP-SAT model's work budget (deterministic seconds, one worker) instead of a wall-clock
    limit: the same request then gives the same plan under any load, for scripted use. `post_training`
    (`solver.search.post_training.PostRequest`) plans a TRL DPO/ORPO/KTO/GRPO job: `global_batch` then counts
    examples (pairs, or GRPO completions) and the plan's `post_training` holds the reference and vLLM decisions.
    `kbit_preparation` plans a QLoRA script of the user's own that calls PEFT's `prepare_model_for_kbit_training`
    (the hf and accelerate files, which leave the script to the user, run it).
    """
    if not 0 <= headroom < 1:
        raise FitplanError(f"headroom={headroom} must be in [0, 1)", "e.g. --headroom 0.1 keeps 10% free.")
    if packing not in PACKINGS:
        raise FitplanError(f"packing={packing!r} is not one of {', '.join(PACKINGS)}",
                           "none pads each micro-batch; wrapped and bfd pack sequences into rows (TRL).")
    resolved = resolve(model)
    cluster = cluster_from(gpus, **(cluster_options or {}))
    seq_len = post.sequence_length(post_training, seq_len, dataset_lengths=dataset_lengths)  # checks the task
    workload, assumed = workload_for(resolved, cluster, seq_len, global_batch, tokens_per_step)
    workload = post.post_workload(post_training, workload, assumed)
    cap = workload.seq_len
    if dataset_lengths is not None:
        workload = longest_batch(workload, dataset_lengths, packing)
        if workload.seq_len < cap:
            assumed.append(f"sequence length {workload.seq_len:,}: the longest in the dataset lengths (padding to "
                           f"the longest in each micro-batch; --seq-len {cap:,} caps it)")
    pin, notes = prepared(pins_of(pins, knobs), allow_savers=allow_savers, lora=lora)
    if kbit_preparation:
        _check_kbit_preparation(lora, pin.launcher, post_training)
    if post_training is not None:  # TRL's trainers extend the HF Trainer: search what it runs
        post.check_launcher(pin.launcher)
        pin = replace(pin, launcher=pin.launcher or "hf")
    request = Request(resolved=resolved, cluster=cluster, workload=workload, gpus=spec_of(gpus, cluster),
                      headroom=headroom, time_limit=time_limit, deterministic=deterministic, lora=lora,
                      kbit_preparation=kbit_preparation, attention=attention,
                      assumed=(*assumed, *notes), alternatives=alternatives_count,
                      input_tokens_per_s=input_tokens_per_s, **({"progress": progress} if progress else {}))
    if post_training is not None:
        return post.solve_post_training(request, post_training,
                                        lambda inner: strategies.plan(inner, pin, allow_lora=allow_lora))
    plan = strategies.plan(request, pin, allow_lora=allow_lora)
    return plan if dataset_lengths is None else with_batching(plan, dataset_lengths, packing, cap)


def estimate(model: str, gpus: str | Cluster, config: Config | dict[str, Any], *, seq_len: int | None = None,
             global_batch: int | None = None, lora: LoraSpec | None = None, attention: str | None = None,
             launcher: str | None = None, post_training: PostRequest | None = None,
             kbit_preparation: bool = False) -> Estimate:
    """Memory and time of one given configuration, priced on the lowering `solve` would price it on (the same
    route: torchtitan's model code for the torchtitan launcher or a torchtitan plan's attention, megatron-core's
    layers for Megatron's engine where they lower the model, else the HF code).

    `config` may be a `Config` or a dict of its fields; when `global_batch` is None it is micro_batch x
    grad_accum x dp. `launcher` (optional) must be able to run the configuration. `post_training` prices the
    training step of a TRL task as `solve` does (`global_batch` then counts examples, as in `solve`; the reference
    is the one pinned, else the first `solve` searches). `kbit_preparation` prices a QLoRA script of the user's own
    that calls PEFT's `prepare_model_for_kbit_training` (as `solve` does with it).
    """
    if kbit_preparation:
        _check_kbit_preparation(lora, launcher, post_training)
    resolved = resolve(model)
    cluster = cluster_from(gpus)
    seq_len = post.sequence_length(post_training, seq_len)  # checks the task
    if post_training is not None:
        post.check_launcher(launcher)
    if isinstance(config, dict):  # knobs left unset take the defaults `solve` takes on these GPUs
        config = {**config, **gpu_defaults(cluster, config)}
    unsized = config_from(config, layers=None)
    mode = config.get("checkpoint") if isinstance(config, dict) else None
    if attention == MEGATRON_PRICED and unsized.engine is not Engine.MEGATRON:
        raise FitplanError(f"attention={MEGATRON_PRICED} is Transformer Engine's attention on megatron-core's layers, "
                           "which only Megatron's engine runs.", "Pass --engine megatron, or leave --attention out.")
    titan = launcher == "torchtitan" or attention == TITAN_PRICED
    if titan and unsized.loss not in TITAN_LOSSES:
        raise FitplanError(f"loss={unsized.loss} does not run under torchtitan (it has no fused linear "
                           "cross-entropy).", f"Pass --loss {' or '.join(map(str, TITAN_LOSSES))}.")
    route = Route(resolved=resolved, lora=None if titan else lora, attention=None if titan else attention,
                  titan=titan, op_selective=not titan and (Checkpoint.OP_SELECTIVE in unsized.checkpoint
                                                           or str(mode) == Checkpoint.OP_SELECTIVE.value),
                  axolotl=launcher == "axolotl", peft_kbit=kbit_preparation)
    graph = Lowerings(route).graph(unsized)
    cfg = config_from(config, layers=len(graph.decoder_layers()))
    if launcher is not None:
        _check_launcher(launcher, cfg, lora=lora is not None)
    group = 2 if post_training is not None and post_training.task in PAIR_TASKS else 1
    batch = global_batch or max(1, cfg.micro_batch * cfg.grad_accum * cfg.dp // group)
    workload, assumed = workload_for(resolved, cluster, seq_len, batch, None)
    if launcher is not None:  # the model's facts from its HF lowering, as `solve` records them (search/solve.prepare)
        facts = Lowerings(Route(resolved=resolved, lora=lora, attention=attention)).graph(Config()) if titan else graph
        _check_launcher_layout(launcher, Request(resolved=resolved, cluster=cluster, workload=workload,
                                                gpus=spec_of(gpus, cluster)), facts, cfg, lora=lora,
                              attention=graph.attention)
    workload = post.estimated_workload(post_training, workload, assumed, lora=lora is not None)
    if cfg.micro_batch % workload.group or cfg.micro_batch < workload.min_micro_batch:
        raise FitplanError(f"micro_batch={cfg.micro_batch} sequences cannot run {post_training and post_training.task}"
                           f": TRL needs at least {workload.min_micro_batch} per micro-batch, whole examples of "
                           f"{workload.group} sequences.", "Pass --micro-batch as a multiple of that.")
    result = estimate_config(graph, cluster, workload, cfg)
    note = route.kbit_note()
    return result if note is None else replace(result, notes=(*result.notes, note))


def _check_kbit_preparation(lora: LoraSpec | None, launcher: str | None, post_training: PostRequest | None) -> None:
    """A FitplanError where PEFT's k-bit preparation cannot be what the run does: no 4-bit base, or a launcher that
    runs its own loader (axolotl prepares the base its own way; TRL 1.16's trainers and the other runtimes do not
    call it)."""
    if post_training is not None:
        raise FitplanError("--kbit-preparation prices a training script of your own; --task runs TRL 1.16's "
                           "trainers, which do not call PEFT's prepare_model_for_kbit_training.",
                           "Drop --kbit-preparation, or --task.")
    if lora is None or not lora.four_bit:
        raise FitplanError("--kbit-preparation prices PEFT's prepare_model_for_kbit_training on a 4-bit base, and "
                           "this run has none.", "Add --lora-rank R --lora-quantization nf4, or drop "
                           "--kbit-preparation.")
    if launcher is not None and launcher not in USER_SCRIPT_LAUNCHERS:
        raise FitplanError(f"--kbit-preparation prices a training script of your own; the {launcher} launcher runs "
                           "its own loader" + (" (it prepares the base and casts norms and embeddings back)"
                                               if launcher == "axolotl" else "") + ".",
                           f"Drop --launcher, or use {' or '.join(USER_SCRIPT_LAUNCHERS)}, or drop "
                           "--kbit-preparation.")


def _check_launcher(launcher: str, config: Config, *, lora: bool) -> None:
    """A FitplanError naming what of `config` the launcher cannot express."""
    if launcher not in capability.LAUNCHERS:
        raise FitplanError(f"Unknown launcher {launcher!r}.", f"Launchers: {', '.join(capability.LAUNCHERS)}.")
    problems = capability.unsupported(launcher, config, checkpoint=config.checkpoint, lora=lora)
    if problems:
        raise FitplanError(f"The {launcher} launcher cannot run this configuration: {'; '.join(problems)}.",
                           f"Launchers that can: {', '.join(capability.runnable_by(config, lora=lora)) or 'none'}.")


def _check_launcher_layout(launcher: str, request: Request, graph: LayerGraph, config: Config, *,
                          lora: LoraSpec | None, attention: str) -> None:
    """A FitplanError naming what of the model's layout (`graph`: its HF lowering) keeps the launcher from running
    `config`'s parallelism (a torchtitan pipeline over tied embeddings, experts that ep does not divide), as
    `solve`'s launcher filter refuses it. A model with no torchtitan flavour is still priced on torchtitan's code at
    its own dimensions (what the lowering builds; the reference tests use small ones): `solve` refuses it."""
    decisions = decisions_of(config, config.checkpoint, lora=LoraDecision.of(lora) if lora is not None else None,
                             attention=attention)
    inputs = plan_inputs(request, Pins(), graph)
    problems = parallelism_problems(launcher, decisions, inputs)
    if problems:
        raise FitplanError(f"The {launcher} launcher cannot run this configuration of {inputs.model}: "
                           f"{'; '.join(problems)}.",
                           f"Launchers that can: {', '.join(runnable_by(decisions, inputs)) or 'none'}.")


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
