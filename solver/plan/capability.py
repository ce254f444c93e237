"""The launcher registry: what each launcher runs as emitted, the one place launcher capabilities are written.

Each `Launcher` states the engines it runs, a rule naming what it cannot express of a configuration (with the
reason), which selective recompute it runs, and what the user must add to its files (its caveats: the default
order prefers the fewest). `space.py` asks it per outer configuration (so the search only considers what some
allowed launcher runs) and `launchers` per plan, both `Config`s; it imports neither, so there is no import cycle.
The emitters register under the same names in `solver.plan.launchers.EMITTERS` (a test checks the two agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from costmodels import Config, Engine, Offload, Optimizer, Precision
from costmodels.choices import RUNTIME_ONLY_LOSSES
from costmodels.config import ContextParallel, Loss
from costmodels.pipeline_schedule import Schedule
from graphs import Checkpoint

Rule = Callable[[str, Config, tuple[Checkpoint, ...], bool], list[str]]
_DEEPSPEED_STAGES = tuple((Engine.DEEPSPEED, z) for z in range(4))
_TORCH = ((Engine.DDP, 0), (Engine.FSDP2, 2), (Engine.FSDP2, 3))


@dataclass(frozen=True, slots=True)
class Launcher:
    """One launcher: what it runs as emitted, and what its user still supplies."""

    name: str
    runtime: str
    """What runs the emitted files, with the version the rules were checked against."""
    engines: tuple[tuple[Engine, int], ...]
    """(engine, ZeRO stage) pairs it runs."""
    rule: Rule
    """What it cannot express of a configuration, per-layer modes and LoRA, each with the reason."""
    selective: Literal["none", "per-layer", "all-layers"]
    """Where it runs fitplan's attention-core selective recompute (Checkpoint.SELECTIVE)."""
    needs: tuple[str, ...]
    """What the user adds to the emitted files before a real run (its caveats)."""
    per_layer: bool = True
    """Whether it checkpoints layers in different modes (torchtitan applies one policy to every layer)."""
    op_selective: Literal["none", "per-layer", "all-layers"] = "none"
    """Where it runs op-level selective activation checkpointing (Checkpoint.OP_SELECTIVE: torch's
    `create_selective_checkpoint_contexts` with torchtitan's policy, `graphs.sac`)."""


def unsupported(launcher: str, d: Config, *, checkpoint: Sequence[Checkpoint] = (), lora: object = False) -> list[str]:
    """What `launcher` cannot express of these knobs, per-layer `checkpoint` modes and LoRA (a bool, or the
    `LoraSpec`, whose QLoRA/DoRA fields some launchers cannot load) (empty: it runs them)."""
    entry = REGISTRY[launcher]
    problems = [] if (d.engine, d.zero) in entry.engines else \
        [f"engine {d.engine} ZeRO-{d.zero} ({entry.runtime} runs {_engines(entry.engines)})"]
    return problems + entry.rule(launcher, d, tuple(checkpoint), lora) + _memory_savers(launcher, d) + \
        _peft_variants(launcher, d, lora) + _parallelism(launcher, d, tuple(checkpoint))


def runnable_by(d: Config, *, checkpoint: Sequence[Checkpoint] = (), lora: object = False,
                launchers: Sequence[str] | None = None) -> tuple[str, ...]:
    """The `launchers` (default: all) that run these knobs as emitted, fewest caveats first (`preferred`)."""
    names = preferred(LAUNCHERS if launchers is None else launchers)
    # the engine check first: most launchers run few engines, and `unsupported` words every reason
    return tuple(name for name in names if (d.engine, d.zero) in REGISTRY[name].engines
                 and not unsupported(name, d, checkpoint=checkpoint, lora=lora))


def preferred(launchers: Sequence[str]) -> tuple[str, ...]:
    """`launchers` ordered by what the user must add to their files (fewest first), then registry order."""
    return tuple(sorted(launchers, key=lambda name: (len(REGISTRY[name].needs), LAUNCHERS.index(name))))


def engines_of(launchers: Sequence[str]) -> tuple[tuple[Engine, int], ...]:
    """The (engine, ZeRO stage) pairs any of `launchers` runs, in the registry's order of first appearance."""
    return tuple(dict.fromkeys(pair for name in launchers for pair in REGISTRY[name].engines))


def selective_runners(launchers: Sequence[str], *, all_layers: bool) -> tuple[str, ...]:
    """Which of `launchers` can run selective recompute on the layers the search picks (`all_layers`: on every
    layer, which the launchers that apply it model-wide also run)."""
    return tuple(name for name in launchers if REGISTRY[name].selective == "per-layer" or
                 (REGISTRY[name].selective == "all-layers" and all_layers))


def op_selective_runners(launchers: Sequence[str], *, all_layers: bool) -> tuple[str, ...]:
    """Which of `launchers` can run op-level selective checkpointing on the layers the search picks
    (`all_layers`: on every layer, which the launchers that apply one policy model-wide also run)."""
    return tuple(name for name in launchers if REGISTRY[name].op_selective == "per-layer" or
                 (REGISTRY[name].op_selective == "all-layers" and all_layers))


def _engines(pairs: tuple[tuple[Engine, int], ...]) -> str:
    return ", ".join(engine_label(engine, zero) for engine, zero in pairs)


def engine_label(engine: Engine, zero: int) -> str:
    """How an (engine, ZeRO stage) pair reads in messages: DeepSpeed's stages by name, Megatron's optimizer."""
    if engine is Engine.DEEPSPEED:
        return f"{engine} ZeRO-{zero}"
    if engine is Engine.MEGATRON:
        return f"{engine}" + (" (distributed optimizer)" if zero else "")
    return f"{engine}" + (f" (zero={zero})" if engine is Engine.FSDP2 else "")


def engine_setting(engine: Engine, zero: int) -> str:
    """`engine_label` with FSDP2's stage as the setting it is (reshard_after_forward), for the plan's own lines."""
    if engine is Engine.FSDP2:
        return f"{engine} reshard_after_forward={zero == 3}"
    return engine_label(engine, zero)


# DeepSpeed 0.19's config (docs/_pages/config-json.md) has fp16 and bf16 blocks and no fp8 one; fp8 under DeepSpeed
# needs Transformer Engine modules in the model, which Megatron's launcher provides (--fp8-format hybrid).
_FP8_DEEPSPEED = "fp8 with DeepSpeed (ds_config.json has no fp8 field; the Megatron launcher runs it)"


def _pure_bf16_zero0(d: Config) -> bool:
    # DeepSpeed 0.19 keeps bf16 master weights only under ZeRO 1-3 (runtime/config.py rejects
    # bf16_master_weights_and_grads at stage 0); at stage 0 its bf16 optimizers keep an fp32 copy.
    return d.engine is Engine.DEEPSPEED and d.zero == 0 and d.precision is Precision.BF16


def _deepspeed(_: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    problems = _op_selective(checkpoint)
    if d.tp > 1:
        problems.append("tensor parallelism (fitplan emits DeepSpeed plans without AutoTP)")
    if Checkpoint.SELECTIVE in checkpoint:
        problems.append("selective recompute (HF models checkpoint whole layers)")
    if _pure_bf16_zero0(d):
        problems.append("pure bf16 without ZeRO (DeepSpeed keeps fp32 master weights at stage 0)")
    if d.precision is Precision.FP8:
        problems.append(_FP8_DEEPSPEED)
    return problems


# fitplan prices LoRA under TP as PEFT's LoraParallelLinear splits it (graphs.structure.lora_style), which wraps
# Megatron's parallel layers; the HF TP plan and the generated script shard plain Linear modules, not PEFT's wrappers.
_LORA_TP = "LoRA with tensor parallelism (PEFT's parallel LoRA layers need Megatron's; HF TP plans shard plain Linears)"


def _hf_or_accelerate(launcher: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    problems = _op_selective(checkpoint)
    if launcher == "hf" and d.tp > 1:
        problems.append("tensor parallelism in TrainingArguments (use the accelerate config)")
    if Checkpoint.SELECTIVE in checkpoint:
        problems.append("selective recompute (transformers checkpoints whole layers)")
    if Offload.NVME in (d.optimizer_offload, d.param_offload) and d.engine is not Engine.DEEPSPEED:
        problems.append("NVMe offload outside DeepSpeed")
    if d.tp > 1 and d.engine is Engine.DEEPSPEED:
        problems.append("tensor parallelism with DeepSpeed")
    if _pure_bf16_zero0(d):
        problems.append("pure bf16 without ZeRO (DeepSpeed keeps fp32 master weights at stage 0)")
    if d.precision is Precision.BF16 and d.engine is not Engine.DEEPSPEED:
        problems.append("pure bf16 training (TrainingArguments/accelerate bf16 means mixed precision)")
    if d.sequence_parallel:
        problems.append("sequence parallelism")
    if lora and d.tp > 1:
        problems.append(_LORA_TP)
    if d.precision is Precision.FP8:
        if launcher == "hf":
            problems.append("fp8 (TrainingArguments has no fp8 switch; the accelerate or torchrun files run it)")
        elif d.engine is Engine.DEEPSPEED:
            problems.append(_FP8_DEEPSPEED)
        elif d.tp > 1:
            problems.append("fp8 with tensor parallelism (accelerate's torchao recipe converts unsharded Linear "
                            "layers)")
    return problems


_AXOLOTL = "axolotl 0.19"


def _axolotl(_: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    """What axolotl 0.19's config cannot express (utils/schemas/config.py; the weights' dtype from bf16/fp16 in
    utils/config normalize_config; FSDP2's upcast of trained parameters in monkeypatch/accelerate/fsdp2.py)."""
    problems = _op_selective(checkpoint)
    if d.tp > 1 or d.sequence_parallel:
        problems.append(f"tensor or sequence parallelism ({_AXOLOTL}'s tensor_parallel_size is DeepSpeed AutoTP, not "
                        "the DTensor TP fitplan prices)")
    modes = set(checkpoint)
    if Checkpoint.SELECTIVE in modes:
        problems.append(f"selective recompute of the attention core ({_AXOLOTL}'s gradient_checkpointing checkpoints "
                        "whole layers)")
    elif len(modes) > 1:
        problems.append(f"checkpointing only some layers ({_AXOLOTL}'s gradient_checkpointing turns every layer on "
                        "and its config takes no per-layer list)")
    if Offload.NVME in (d.optimizer_offload, d.param_offload) and d.engine is not Engine.DEEPSPEED:
        problems.append("NVMe offload outside DeepSpeed")
    if _pure_bf16_zero0(d):
        problems.append("pure bf16 without ZeRO (DeepSpeed keeps fp32 master weights at stage 0)")
    if d.precision is Precision.FP8:
        problems.append(f"fp8 ({_AXOLOTL}'s fp8 switch converts with torchao inside its own trainer, which fitplan "
                        "does not price; the accelerate or torchrun files run fp8)")
    elif d.engine is Engine.DDP and not lora and d.precision in (Precision.BF16_MIXED, Precision.FP16_MIXED):
        problems.append(f"{d.precision} full fine-tuning under DDP ({_AXOLOTL} loads the weights in bf16/fp16 "
                        "whenever bf16/fp16 is on, so DDP trains 16-bit weights without the fp32 copy fitplan prices; "
                        "pure bf16, DeepSpeed or FSDP2 run it)")
    elif d.engine is Engine.FSDP2 and d.precision is Precision.BF16:
        problems.append(f"pure bf16 under FSDP2 ({_AXOLOTL} upcasts trained parameters to fp32 for FSDP2's mixed "
                        "precision)")
    return problems


def _torchrun(_: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    problems = []
    if d.engine is Engine.DDP and d.tp > 1 and d.dp > 1:
        problems.append("tensor parallelism with DDP data parallelism (use FSDP2)")
    if Offload.NVME in (d.optimizer_offload, d.param_offload):
        problems.append("NVMe offload")
    if d.precision is Precision.FP8 and d.tp > 1:
        problems.append("fp8 with tensor parallelism (the script's TP plan uses plain Colwise/RowwiseParallel, not "
                        "torchao's Float8 styles)")
    if lora and d.tp > 1:
        problems.append(_LORA_TP)
    if d.pp > 1:
        problems += _torchrun_pipeline(d, lora)
    return problems


def _torchrun_pipeline(d: Config, lora: bool) -> list[str]:
    """What the script's torch.distributed.pipelining stages (torch 2.13 `PipelineStage`, the schedule's own loss
    and backward) do not run: the script shards its stages' layers by DTensor TP and replicates stages over their
    data-parallel group (DDP)."""
    problems = []
    if d.sequence_parallel:
        problems.append("sequence parallelism inside pipeline stages (the script's stages pass whole sequences)")
    if d.engine is Engine.FSDP2:
        problems.append("FSDP2 with pipeline parallelism (torch.distributed.pipelining keeps FSDP2's gradients "
                        "unsharded until a step's last backward, stage.py backward_maybe_with_nosync, which the plan "
                        "does not price; DDP or one replica runs)")
    if d.precision in (Precision.FP16_MIXED, Precision.FP8):
        problems.append(f"{d.precision} with pipeline parallelism (the schedule runs the loss's backward itself: no "
                        "loss scaler or float8 conversion of the stages)")
    if lora or d.optimizer_in_backward or d.loss is not Loss.HF:
        problems.append("LoRA, optimizer-in-backward or a fused or chunked loss with pipeline parallelism (the "
                        "script's stages are plain HF layers with the schedule's cross-entropy)")
    return problems


def _megatron(_: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    problems = _op_selective(checkpoint)
    if d.optimizer in (Optimizer.ADAFACTOR, Optimizer.ADAMW_8BIT):  # the paged ones: _memory_savers
        # Megatron-LM arguments.py (core_v0.16.1): --optimizer adam (decoupled weight decay), sgd, muon, dist_muon
        problems.append(f"optimizer {d.optimizer} (Megatron-LM's --optimizer builds adam, sgd and muon only)")
    if d.param_offload is not Offload.NONE:
        problems.append("parameter offload (Megatron-LM offloads only the optimizer: --optimizer-cpu-offload)")
    if lora:
        problems.append("LoRA")
    if d.precision is Precision.BF16:
        problems.append("pure bf16 (Megatron's --bf16 keeps fp32 main parameters)")
    if Checkpoint.SELECTIVE in checkpoint and set(checkpoint) != {Checkpoint.SELECTIVE}:
        problems.append("selective recompute on only some layers (Megatron applies it to all)")
    if Checkpoint.FULL in checkpoint and Checkpoint.SELECTIVE in checkpoint:
        problems.append("full and selective recompute mixed")
    return problems


_TORCHTITAN = "torchtitan 0.3.0"


def _torchtitan(_: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    """torchtitan 0.3.0's own options (torchtitan/config, trainer.py); the model must also be one of its flavours
    (`solver.plan.launchers.torchtitan.model_problems`, checked per model)."""
    problems = []
    if Offload.NVME in (d.optimizer_offload, d.param_offload):
        problems.append(f"NVMe offload ({_TORCHTITAN} offloads to CPU only: training.enable_cpu_offload)")
    elif d.optimizer_offload is not d.param_offload:
        problems.append(f"offloading only the {'optimizer' if d.param_offload is Offload.NONE else 'parameters'} "
                        f"({_TORCHTITAN}'s training.enable_cpu_offload is FSDP2's CPUOffloadPolicy: parameters, "
                        "gradients and optimizer states move together)")
    elif d.optimizer_offload is Offload.CPU and d.engine is not Engine.FSDP2:
        problems.append(f"CPU offload without FSDP2 sharding ({_TORCHTITAN} offloads through FSDP2's "
                        "CPUOffloadPolicy)")
    if d.precision is Precision.FP16_MIXED:
        problems.append(f"fp16 mixed precision ({_TORCHTITAN}'s training.mixed_precision_param is bfloat16 or "
                        "float32, and it has no loss scaler)")
    elif d.precision is Precision.TF32:
        problems.append(f"TF32 matmuls ({_TORCHTITAN} has no TF32 switch; its fp32 matmuls run in full fp32)")
    if d.optimizer not in (Optimizer.ADAMW, Optimizer.ADAMW_FUSED):
        problems.append(f"optimizer {d.optimizer} ({_TORCHTITAN} builds Adam, AdamW and DistMuon only: "
                        "OptimizersContainer._resolve_optimizer_factory)")
    modes = set(checkpoint)
    if Checkpoint.SELECTIVE in modes:
        problems.append(f"selective recompute of the attention core ({_TORCHTITAN}'s 'selective' is op-level SAC, "
                        "which saves the outputs of matmuls and attention and recomputes the cheap ops)")
    elif len(modes) > 1:
        problems.append(f"checkpointing layers differently ({_TORCHTITAN} applies one activation-checkpoint policy "
                        "to every layer; the every-n-th-layer option of torchtitan <= 0.2.2 is gone)")
    if lora:
        problems.append(f"LoRA ({_TORCHTITAN}'s LoRAConverter adapts the fused wqkv projection with one adapter and "
                        "has no dropout; fitplan prices PEFT's per-projection adapters)")
    return problems


def _op_selective(checkpoint: tuple[Checkpoint, ...]) -> list[str]:
    """Op-level SAC where the launcher cannot run it (its rule calls this; those that run it do not)."""
    if Checkpoint.OP_SELECTIVE in checkpoint:
        runners = ", ".join(name for name, entry in REGISTRY.items() if entry.op_selective != "none")
        return [f"op-level selective checkpointing (torch's selective activation checkpointing with torchtitan's "
                f"policy; launchers that run it: {runners})"]
    return []


# Where each memory saver runs as emitted. transformers 5.24 TrainingArguments: `optim` names bitsandbytes' paged
# AdamW (OptimizerNames.PAGED_ADAMW_8BIT / PAGED_ADAMW) and `use_liger_kernel` with `liger_kernel_config` patches in
# Liger's fused linear cross-entropy alone; neither runs torchtune's chunked loss or activation offload.
# axolotl 0.19 passes `optimizer` to TrainingArguments' optim and runs Liger through its LigerPlugin.
_PAGED_RUNNERS = ("torchrun", "hf", "deepspeed", "accelerate", "axolotl")
# The generated torchrun script applies the same Liger patch (train_fitplan.py `apply_liger`).
_FUSED_LOSS_RUNNERS = ("torchrun", "hf", "axolotl")
# The generated torchrun script registers torchtune's per-parameter hooks (train_fitplan.py `InBackward`).
_IN_BACKWARD_RUNNERS = ("torchrun",)
# torchtune is no launcher here, and torchtitan 0.3.0 has neither saver; the generated torchrun script runs torchtune
# 0.6.1's chunked cross-entropy (train_fitplan.py `apply_chunked_output`, `chunked_cross_entropy`) and its activation
# offloading hooks (`OffloadActivations`, the head under `DeviceSaved`, the loss outside), without a pipeline: its
# stages compute transformers' loss on the last one and run no offloading hooks. The hooks copy plain tensors, so
# not under tensor parallelism (its saved tensors are DTensors); the chunked loss's tp > 1 is refused by its pricing.
_TORCHTUNE_RUNNERS = ("torchrun",)
# torchtitan 0.3.0 runs a chunked loss of its own (`ChunkedLossWrapper`, with or without a pipeline: the last stage
# holds the head), which its lowering traces (solver.search.route.TITAN_LOSSES).
_TITAN_CHUNKED = ("torchtitan",)


def _memory_savers(launcher: str, d: Config) -> list[str]:
    """The paged optimizers, optimizer-in-backward, the loss and activation offload where `launcher` cannot run
    them (the same reasons for every rule, so each launcher names the ones that can)."""
    problems = []
    if d.optimizer in (Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT) and launcher not in _PAGED_RUNNERS:
        problems.append(f"optimizer {d.optimizer} (bitsandbytes' paged AdamW: it builds torch or its own optimizers; "
                        f"launchers that run it: {', '.join(_PAGED_RUNNERS)})")
    if d.optimizer_in_backward and launcher not in _IN_BACKWARD_RUNNERS:
        problems.append("optimizer-in-backward (torchtune's optimizer_in_bwd: steps one optimizer after backward; "
                        f"launchers that run it: {', '.join(_IN_BACKWARD_RUNNERS)})")
    if d.loss is Loss.CHUNKED and launcher not in _TITAN_CHUNKED and (launcher not in _TORCHTUNE_RUNNERS or d.pp > 1):
        problems.append("a chunked cross-entropy (launchers that run one: "
                        f"{', '.join(_TORCHTUNE_RUNNERS)} (torchtune's, without pipeline parallelism), "
                        f"{', '.join(_TITAN_CHUNKED)} (its own))")
    elif d.loss in RUNTIME_ONLY_LOSSES:
        problems.append(f"the {d.loss} loss (a runtime no launcher here emits: Megatron-LM's legacy "
                        "--fp16-lm-cross-entropy or Mist for megatron-fp16, llm-foundry for flash)")
    elif d.loss is Loss.FUSED_LINEAR and launcher not in _FUSED_LOSS_RUNNERS:
        problems.append("Liger's fused linear cross-entropy (TrainingArguments' use_liger_kernel; launchers that "
                        f"run it: {', '.join(_FUSED_LOSS_RUNNERS)})")
    if d.activation_offload and (launcher not in _TORCHTUNE_RUNNERS or d.pp > 1):
        problems.append("activation offloading (torchtune's enable_activation_offloading; launchers that run it: "
                        f"{', '.join(_TORCHTUNE_RUNNERS)}, without pipeline parallelism)")
    elif d.activation_offload and d.tp > 1:
        problems.append(f"activation offloading with tp={d.tp} (the script's offloading hooks copy plain tensors; "
                        "tensor parallelism saves DTensors)")
    elif d.activation_offload and d.loss is Loss.FUSED_LINEAR:
        problems.append("activation offloading with Liger's fused linear cross-entropy (the fused loss runs inside "
                        "the model's forward, where the offloading hooks would move the gradients it saves, which "
                        "fitplan prices as staying on the device with the head)")
    return problems


# Where pipeline, context and expert parallelism run as emitted (issue 13). HF Trainer, accelerate and DeepSpeed files
# fitplan emits run data and tensor parallelism only; the torchrun script runs pipelines (`_torchrun_pipeline`).
_PP_RUNNERS = ("megatron", "torchtitan", "torchrun")
_CP_RUNNERS = ("megatron",)
_EP_RUNNERS = ("megatron",)
# Hybrid sharding (HSDP, `Config.dp_replicate`): torchtitan 0.3.0's data_parallel_replicate_degree with FSDP2
# (parallel_dims.py builds the dp_replicate x dp_shard mesh), the torchrun script's 2-D mesh for fully_shard. The HF
# stacks' emitted FSDP2 configs shard over every rank (fitplan writes no accelerate ParallelismConfig).
_HSDP_RUNNERS = ("torchrun", "torchtitan")
# megatron-core 0.16.1 pipeline_parallel/schedules.py get_forward_backward_func: forward_backward_pipelining_without_
# interleaving (1F1B) and forward_backward_pipelining_with_interleaving (v >= 2 model chunks); no GPipe or zero-bubble
# schedule (its delay_wgrad_compute only overlaps MoE all-to-all, it does not reorder the pipeline).
MEGATRON_SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B)
# Megatron-LM --cp-comm-type (arguments.py, core_v0.16.1): p2p is ring attention, a2a is DeepSpeed-Ulysses.
MEGATRON_CP_COMM = {ContextParallel.RING: "p2p", ContextParallel.ALL_TO_ALL: "a2a"}


def _parallelism(launcher: str, d: Config, checkpoint: tuple[Checkpoint, ...]) -> list[str]:
    """Pipeline, context, expert parallelism and hybrid sharding where `launcher` cannot run them as decided, each
    naming the launchers that can (the model's own limits, such as experts to divide, are the emitters' and
    estimate's)."""
    problems = []
    if d.pp > 1 and launcher not in _PP_RUNNERS:
        problems.append(f"pipeline parallelism (pp={d.pp}; launchers that run it: {', '.join(_PP_RUNNERS)})")
    elif d.pp > 1 and launcher == "megatron":
        problems += _megatron_pipeline(d, checkpoint)
    if d.cp > 1 and launcher == "torchtitan":
        problems.append(f"context parallelism ({_TORCHTITAN} all-gathers the whole sequence's keys and values before "
                        "FlexAttention, distributed/context_parallel/api.py: neither ring nor all-to-all attention; "
                        f"launchers that run it: {', '.join(_CP_RUNNERS)})")
    elif d.cp > 1 and launcher not in _CP_RUNNERS:
        problems.append(f"context parallelism (cp={d.cp}; launchers that run it: {', '.join(_CP_RUNNERS)})")
    if d.dp_replicate > 1 and launcher not in _HSDP_RUNNERS:
        problems.append(f"hybrid sharding (dp_replicate={d.dp_replicate}; launchers that run it: "
                        f"{', '.join(_HSDP_RUNNERS)})")
    if d.ep > 1 and launcher == "torchtitan":
        problems.append(f"expert parallelism (fitplan runs {_TORCHTITAN}'s Qwen3-MoE flavours with their experts "
                        "sharded by FSDP2, not with its own all-to-all expert parallelism; launchers that run it: "
                        f"{', '.join(_EP_RUNNERS)})")
    elif d.ep > 1 and launcher not in _EP_RUNNERS:
        problems.append(f"expert parallelism (ep={d.ep}; launchers that run it: {', '.join(_EP_RUNNERS)})")
    return problems


def whole_pipeline_groups(pp: int, grad_accum: int) -> bool:
    """Whether pp divides the micro-batches of a step: all any launcher rule reads of the accumulation steps
    (Megatron's interleaved grouping, `_megatron_pipeline`), so the search asks the rules once per answer."""
    return grad_accum % pp == 0


def _megatron_pipeline(d: Config, checkpoint: tuple[Checkpoint, ...]) -> list[str]:
    """What megatron-core 0.16.1 cannot run of a pipeline: other schedules, an interleaved order other than the one
    priced, and full recompute that is not the first k layers of every stage."""
    if d.pp_schedule not in MEGATRON_SCHEDULES:
        return [f"pipeline schedule {d.pp_schedule} (megatron-core 0.16 runs 1f1b and interleaved-1f1b only: "
                "pipeline_parallel/schedules.py; launchers that run it: torchtitan)"]
    problems = []
    if d.pp_schedule is Schedule.INTERLEAVED_1F1B and d.pp_virtual == 1:
        problems.append("interleaved-1f1b with one stage per rank (Megatron interleaves v >= 2 model chunks per "
                        "rank; with one it runs plain 1F1B)")
    elif d.pp_schedule is Schedule.INTERLEAVED_1F1B and not whole_pipeline_groups(d.pp, d.grad_accum):
        # Megatron runs micro-batches in groups of microbatch_group_size_per_vp_stage = pp per model chunk; torch's
        # order, which fitplan prices, groups m // (m // pp): the two agree when pp divides m.
        problems.append(f"interleaved-1f1b with m={d.grad_accum} micro-batches, not a multiple of pp={d.pp} "
                        "(Megatron groups pp micro-batches per model chunk: another order than the one priced)")
    if d.pp_split and checkpoint and block_recompute_layers(checkpoint, d.pp_split) is None:
        problems.append("full recompute on other layers than the first k of every pipeline stage (Megatron's "
                        "--recompute-method block recomputes the first --recompute-num-layers layers of each stage)")
    return problems


def block_recompute_layers(checkpoint: Sequence[Checkpoint], split: Sequence[int]) -> int | None:
    """The k of Megatron's `--recompute-method block --recompute-num-layers k` that recomputes exactly the FULL
    layers of `checkpoint` when each stage of `split` recomputes its first min(k, its layers); None if no k does."""
    full = [mode is Checkpoint.FULL for mode in checkpoint]
    starts = [sum(split[:s]) for s in range(len(split))]
    k = max((sum(full[start:start + n]) for start, n in zip(starts, split, strict=True)), default=0)
    expected = [i - start < k for start, n in zip(starts, split, strict=True) for i in range(start, start + n)]
    return k if expected == full else None


# The launchers whose files load a bitsandbytes-quantized base (quantization_config.json, transformers'
# BitsAndBytesConfig; axolotl's load_in_4bit) and PEFT's DoRA, rsLoRA and modules_to_save (adapter_config.json, a
# whole LoraConfig; axolotl's peft_use_dora, peft_use_rslora, lora_modules_to_save): the generated torchrun script
# builds plain LoRA, Megatron and torchtitan no PEFT adapters, and the DeepSpeed launcher emits no adapter files.
PEFT_VARIANT_RUNNERS = ("hf", "accelerate", "axolotl")


def _peft_variants(launcher: str, d: Config, lora: object) -> list[str]:
    """QLoRA, DoRA, rsLoRA and modules_to_save where `launcher` cannot load them; `lora` is the search's
    `LoraSpec` (a bool says only whether adapters exist) and a plan's decisions carry theirs (`Decisions.lora`)."""
    adapters = [a for a in (lora, getattr(d, "lora", None)) if a is not None and not isinstance(a, bool)]
    found = (("a bitsandbytes-quantized base (QLoRA)", any(getattr(a, "quantization", None) for a in adapters)),
             ("DoRA", any(getattr(a, "use_dora", False) for a in adapters)),
             ("rsLoRA", any(getattr(a, "use_rslora", False) for a in adapters)),
             ("modules_to_save", any(getattr(a, "modules_to_save", ()) for a in adapters)))
    what = " and ".join(name for name, on in found if on)
    if launcher in PEFT_VARIANT_RUNNERS or not what:
        return []
    return [f"{what} (launchers that load it: {', '.join(PEFT_VARIANT_RUNNERS)})"]


# In the default preference order: fewest `needs` first, ties in this order (the torchrun script expresses every
# knob the plan credits, then the Hugging Face stacks, then the runtimes that need their own repository or assets).
_HF_STACKS = (*_TORCH, *_DEEPSPEED_STAGES)
_MEGATRON = ((Engine.MEGATRON, 0), (Engine.MEGATRON, 1))  # its DDP, and its distributed optimizer
REGISTRY: dict[str, Launcher] = {launcher.name: launcher for launcher in (
    Launcher("torchrun", "torch.distributed (torch 2.x: FSDP2 fully_shard, DTensor TP)", _TORCH, _torchrun,
             "per-layer", ("your data: train_fitplan.py --data FILE.jsonl or a tokenized dataset folder (without it, "
                           "random tokens: a smoke test)",),
             op_selective="per-layer"),
    Launcher("accelerate", "accelerate 1.x (FSDP2 or DeepSpeed 0.19 plugin)", _HF_STACKS, _hf_or_accelerate, "none",
             ("your training script, started by `accelerate launch` with the emitted config",)),
    Launcher("hf", "transformers Trainer 5.x (FSDP2 or DeepSpeed 0.19)", _HF_STACKS, _hf_or_accelerate, "none",
             ("your training script, building a Trainer from training_args.json (run after `source fitplan_env.sh`)",)),
    Launcher("deepspeed", "DeepSpeed 0.19", _DEEPSPEED_STAGES, _deepspeed, "none",
             ("your training script, calling deepspeed.initialize with ds_config.json",)),
    Launcher("axolotl", f"{_AXOLOTL} (HF Trainer; FSDP2 or DeepSpeed 0.19)", _HF_STACKS, _axolotl, "none",
             ("your dataset under datasets: in axolotl_config.yaml (it trains on random tokens as emitted)",),
             per_layer=False),
    Launcher("torchtitan", _TORCHTITAN, _TORCH, _torchtitan, "none",
             ("the model's tokenizer under ./assets/hf/<name> (torchtitan's scripts/download_hf_assets.py)",
              "a torchtitan dataset (c4 as emitted) or your own"), per_layer=False, op_selective="all-layers"),
    Launcher("megatron", "Megatron-LM core 0.x (its distributed optimizer)", _MEGATRON, _megatron, "all-layers",
             ("a Megatron-LM checkout (pretrain_gpt.py)", "the model in Megatron's checkpoint format",
              "data preprocessed with Megatron's tools/preprocess_data.py")),
)}
LAUNCHERS = tuple(REGISTRY)
"""Launcher names in registry order (DESIGN.md: a plan records which launchers can run it)."""
