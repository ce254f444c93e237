"""What a training configuration is: the knobs the solver turns and `estimate` prices, and the workload.

Choices are string enums (they print and serialise as their values). Invariants are checked on construction
and reported as `ValueError`s that name the value and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from graphs import Checkpoint

from . import hybrid_shard, partial_offload
from .choices import (
    BNB_OPTIMIZERS,
    ContextParallel,
    Engine,
    Loss,
    Offload,
    Optimizer,
    Precision,
    require_positive_int,
)
from .engines import rules_of
from .knobs import Knob
from .pipeline_schedule import Schedule, schedule_problem
from .tasks import PostTraining

__all__ = ["BNB_OPTIMIZERS", "Config", "ContextParallel", "Engine", "Loss", "Offload", "Optimizer", "Precision",
           "Workload", "require_positive_int"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What one optimizer step processes."""

    seq_len: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks and accumulation steps."""
    post: PostTraining | None = None
    """Preference / RL post-training (TRL's trainers, `costmodels/post_training.py`); None: supervised training."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch"):
            require_positive_int(name, getattr(self, name))
        if self.post is not None and self.global_batch % self.post.sequences_per_example:
            raise ValueError(f"global_batch={self.global_batch} sequences must be whole {self.post.task} examples "
                             f"({self.post.sequences_per_example} sequences each)")

    @property
    def group(self) -> int:
        """Sequences of one example that must share a micro-batch (DPO's chosen and rejected: 2)."""
        return 1 if self.post is None else self.post.sequences_per_example

    @property
    def min_micro_batch(self) -> int:
        """Fewest sequences per micro-batch the trainer accepts (KTO: 2; else one example)."""
        return 1 if self.post is None else self.post.min_micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """One way to run the job: every knob the planner decides, each declared once here (`knobs.Knob`)."""

    tp: Annotated[int, Knob("Tensor-parallel degree (inside a node; must divide the heads and a node's GPUs).",
                            high=1024, strategy=True)] = 1
    dp: Annotated[int, Knob("Data-parallel degree; tp x dp is the world size.", pin="derived", high=2**20)] = 1
    dp_replicate: Annotated[int, Knob(
        "Hybrid sharding (HSDP): groups the data-parallel ranks split into; each shards the model states over its "
        "dp / dp_replicate ranks and holds a full replica, gradients all-reduced across the groups (fsdp2 on a 2-D "
        "mesh; unpinned: 1, or one shard group per node on several nodes).", high=2**20, strategy=True, shown=True,
        outside_compute=True, searched=hybrid_shard.searched_degrees)] = 1
    # FSDP1 (FullyShardedDataParallel's FlatParameter: accelerate's fsdp_version 1, LitGPT's Fabric) is no engine
    # here: a LoRA unit mixes frozen and trainable weights, which it refuses without use_orig_params and with it
    # keeps gradients for the frozen ones too (torch 2.13 fsdp/_wrap_utils.py `_validate_frozen_params`).
    engine: Annotated[Engine, Knob("Which runtime shards and moves the model states (fsdp2: torch's fully_shard; "
                                   "FSDP1's flat parameters are not priced).", strategy=True)] = Engine.DDP
    zero: Annotated[int, Knob("ZeRO stage 0-3 (FSDP2: 3 reshards parameters after forward, 2 keeps them until "
                              "backward; with pipeline parallelism, --pp > 1, FSDP2 runs at 2 only).",
                              low=0, high=3, strategy=True)] = 0
    optimizer_offload: Annotated[Offload, Knob("Where optimizer states (and fp32 master weights) live.",
                                               flag="offload", strategy=True, outside_compute=True)
                                     ] = Offload.NONE
    optimizer_offload_fraction: Annotated[float, Knob(
        "Share of the optimizer's states that --offload moves to the host, the rest stepped on the GPU "
        "(Megatron's --optimizer-offload-fraction; other engines offload all: 1).", flag="offload-fraction",
        strategy=True, outside_compute=True, searched=partial_offload.searched_fractions)] = 1.0
    param_offload: Annotated[Offload, Knob("Where sharded parameters live between uses (ZeRO-3 / FSDP2).",
                                           flag="offload-params", strategy=True, outside_compute=True)
                                 ] = Offload.NONE
    micro_batch: Annotated[int, Knob("Sequences per rank per forward pass (must divide the batch per "
                                     "data-parallel rank).", high=2**20)] = 1
    grad_accum: Annotated[int, Knob("Micro-batches per optimizer step.", high=2**20, outside_compute=True)] = 1
    checkpoint: Annotated[tuple[Checkpoint, ...], Knob(
        "Checkpoint mode of each decoder layer, in layer order (a pin sets every layer; auto decides per layer).")] = ()
    precision: Annotated[Precision, Knob("Number formats of weights, gradients and compute; a pin lists the "
                                         "allowed ones.", pin="set")
                         ] = Precision.BF16_MIXED
    optimizer: Annotated[Optimizer, Knob("The optimizer; a pin lists the allowed ones (never changed silently).",
                                         pin="set", flag="optimizers", outside_compute=True)
                         ] = Optimizer.ADAMW
    sequence_parallel: Annotated[bool, Knob("Shard the activations outside attention/MLP across TP ranks "
                                            "(Megatron-style sequence parallelism).")] = False
    compile: Annotated[bool, Knob("torch.compile the model (unpinned: where it saves enough).")] = False
    optimizer_in_backward: Annotated[bool, Knob(
        "Step each parameter's optimizer in backward and free its gradient at once (torchtune's optimizer_in_bwd; "
        "no gradient accumulation or clipping; auto: off unless --allow-savers).")] = False
    loss: Annotated[Loss, Knob("How the LM head's cross-entropy is computed: hf (full logits), chunked (torchtune's; "
                               "torchtitan's ChunkedLossWrapper under --launcher torchtitan) "
                               "or fused-linear (Liger's whole patch: no full logits, fused RMSNorm/SwiGLU/RoPE; needs "
                               "liger-kernel); a pin lists the allowed ones. megatron-fp16 (Megatron-LM's legacy "
                               "--fp16-lm-cross-entropy, Mist) and flash (flash-attn's fused cross-entropy, "
                               "llm-foundry) price runtimes no launcher here emits (estimate only).",
                               pin="set")] = Loss.HF
    activation_offload: Annotated[bool, Knob(
        "Offload saved activations to host memory between forward and backward (torchtune's "
        "enable_activation_offloading; needs full checkpointing on every layer); a pin lists the allowed "
        "settings (off,on lets the search choose).",
        pin="set")] = False

    pp: Annotated[int, Knob("Pipeline-parallel degree: ranks the decoder layers are split across (the outermost "
                            "dimension, so stages sit on different nodes first).", high=1024, strategy=True,
                            outside_compute=True)] = 1
    pp_schedule: Annotated[Schedule, Knob("Pipeline schedule (torch.distributed.pipelining's names; Megatron and "
                                          "torchtitan run the same ones).", outside_compute=True)
                          ] = Schedule.ONE_F_ONE_B
    pp_virtual: Annotated[int, Knob("Pipeline stages (model chunks) per rank: v of interleaved schedules, 2 for zbv.",
                                    high=64, outside_compute=True)] = 1
    pp_split: Annotated[tuple[int, ...], Knob("Decoder layers of each pipeline stage in order (solve searches it; "
                                              "empty: the FLOP-balanced split).", pin="derived",
                                              outside_compute=True)] = ()
    cp: Annotated[int, Knob("Context-parallel degree: ranks each sequence is split across.",
                            high=1024, strategy=True)] = 1
    cp_mode: Annotated[ContextParallel, Knob("How context-parallel attention exchanges keys and values: ring or "
                                             "all-to-all (Ulysses; heads must divide by tp x cp).")
                       ] = ContextParallel.RING
    ep: Annotated[int, Knob("Expert-parallel degree of MoE layers: ranks the experts are divided across (taken "
                            "from the data-parallel ranks).",
                            high=1024, strategy=True)] = 1
    expandable_segments: Annotated[bool, Knob(
        "The launch files set the caching allocator's expandable_segments:True (in PYTORCH_CUDA_ALLOC_CONF): it then "
        "needs about 1.7% above the allocated peak, not up to 29% (unpinned: on NVIDIA GPUs).")] = True

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "dp_replicate", "micro_batch", "grad_accum", "pp", "pp_virtual", "cp", "ep"):
            require_positive_int(name, getattr(self, name))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r} must be a ZeRO stage 0, 1, 2 or 3")
        rules = rules_of(self.engine)  # what the engine runs (costmodels/engines: version and source per rule)
        problems = rules.refusals(self.zero, optimizer_offload=self.optimizer_offload.value,
                                  param_offload=self.param_offload.value)
        if problems:
            raise ValueError(problems[0])
        if rules.offload_runs_own_optimizer and self.optimizer_offload is not Offload.NONE and \
                self.optimizer in BNB_OPTIMIZERS:
            # bitsandbytes' CUDA kernels cannot update the CPU tensors of the engine's own offloaded step
            # (costmodels/engines/deepspeed.py).
            raise ValueError(f"optimizer={self.optimizer} cannot run under DeepSpeed optimizer offload "
                             f"({self.optimizer_offload}): the offloaded step is DeepSpeed's fp32 CPU Adam")
        if self.optimizer in BNB_OPTIMIZERS and not rules.bnb_optimizers:
            raise ValueError(f"optimizer={self.optimizer} cannot step {rules.runtime}'s sharded (DTensor) parameters: "
                             "bitsandbytes' kernels take plain tensors; use DeepSpeed or DDP, or adamw")
        if (problem := partial_offload.problem(fraction=self.optimizer_offload_fraction, offload=self.optimizer_offload,
                                               engine=self.engine, optimizer=self.optimizer)) is not None:
            raise ValueError(problem)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.optimizer is Optimizer.ADAMW_BF16 and (self.zero not in rules.bf16_state_optimizer_stages or
                                                       self.precision is not Precision.BF16_MIXED):
            # TE's FusedAdam stores master remainders of bf16 weights only (costmodels/optimizers.py)
            raise ValueError("optimizer=adamw-bf16 is Megatron's precision-aware optimizer: it runs with "
                             "engine=megatron zero=1 (the distributed optimizer) under bf16-mixed only")
        self._check_parallelism()
        self._check_hybrid_shards()
        self._check_memory_savers()

    def _check_hybrid_shards(self) -> None:
        """HSDP's rules: the replica groups divide the data-parallel ranks and leave several in each shard group,
        under an engine that shards hybridly (`EngineRules.hybrid_shards`)."""
        if self.dp_replicate == 1:
            return
        name = f"dp_replicate={self.dp_replicate}"
        if not rules_of(self.engine).hybrid_shards:
            raise ValueError(f"{name} needs an engine that shards the model states within groups of data-parallel "
                             f"ranks and replicates them across the groups (fsdp2 on a 2-D mesh), not "
                             f"engine={self.engine}")
        if self.dp % self.dp_replicate or self.dp // self.dp_replicate < 2:
            raise ValueError(f"{name} must divide dp={self.dp} and leave at least 2 data-parallel ranks per shard "
                             "group (with one, the replicas hold whole states: use engine=ddp)")
        if self.ep > 1:
            raise ValueError(f"{name} with ep={self.ep}: expert parallelism's groups under hybrid sharding are not "
                             "priced; use dp_replicate=1")

    def _check_parallelism(self) -> None:
        """Pipeline, context and expert parallelism's own rules (the model's are in `estimate.check`)."""
        if self.pp == 1 and (self.pp_virtual != 1 or self.pp_split or self.pp_schedule is not Schedule.ONE_F_ONE_B):
            raise ValueError("pp_schedule, pp_virtual and pp_split apply only with pp > 1")
        if self.pp > 1:
            # the schedule's micro-batches per step are the accumulation steps of one data-parallel rank
            if (problem := schedule_problem(self.pp_schedule, self.pp, self.grad_accum, self.pp_virtual,
                                            megatron=rules_of(self.engine).megatron_schedules)) is not None:
                raise ValueError(f"pp_schedule={self.pp_schedule}: {problem} (m = grad_accum)")
            stages = self.pp * self.pp_virtual
            if self.pp_split and (len(self.pp_split) != stages or any(
                    isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.pp_split)):
                raise ValueError(f"pp_split={self.pp_split!r} must give {stages} stages (pp x pp_virtual) at least "
                                 "one decoder layer each")
            stages = rules_of(self.engine).pipeline_stages  # costmodels/engines: the runtimes' pipeline rules
            if self.zero not in stages:
                raise ValueError(f"pp={self.pp} runs {self.engine} at zero={', '.join(map(str, stages))} only, not "
                                 f"zero={self.zero} (a pipeline keeps parameters from forward to backward)")
        if self.ep > 1 and (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp x cp = {self.dp * self.cp} (experts are divided across "
                             "the data- and context-parallel ranks)")

    def _check_memory_savers(self) -> None:
        """The refusals of optimizer-in-backward, the loss and activation offload that need no model."""
        if self.optimizer_in_backward:
            reasons = self.in_backward_refusals(clip_grad_norm=False)
            if reasons:
                raise ValueError("optimizer_in_backward cannot run here: " + "; ".join(reasons))
        if self.loss is not Loss.HF and self.tp > 1:
            raise ValueError(f"loss={self.loss} with tp={self.tp}: the vocabulary-parallel head is not modelled "
                             "(the chunked and fused losses run on a whole-vocabulary head)")
        if self.activation_offload and any(mode is not Checkpoint.FULL for mode in self.checkpoint):
            # torchtune 0.6.1 recipes: "enable_activation_offloading should only be True when
            # enable_activation_checkpointing is True"; an empty tuple is the search's not-yet-decided modes.
            raise ValueError("activation_offload needs full activation checkpointing on every layer (torchtune "
                             "refuses it otherwise)")

    def in_backward_refusals(self, *, clip_grad_norm: bool) -> list[str]:
        """Why this configuration cannot step its optimizer in backward (empty when it can). `clip_grad_norm` says
        whether the run clips gradients (HF Trainer's default `max_grad_norm=1.0` does)."""
        reasons = []
        if self.grad_accum > 1:
            # torchtune 0.6.1 recipes/full_finetune_single_device.py and full_finetune_distributed.py raise
            # "Gradient accumulation is not supported with optimizer in bwd."
            reasons.append(f"grad_accum={self.grad_accum}: each gradient is consumed as soon as it is produced, "
                           "so micro-batches cannot accumulate (torchtune refuses it)")
        if clip_grad_norm:
            # Same recipes: "Gradient clipping is not supported with optimizer in bwd."
            reasons.append("gradient clipping needs the norm over all gradients before any step (torchtune refuses it)")
        if rules_of(self.engine).own_fused_optimizer:
            reasons.append("DeepSpeed steps its own (partitioned) optimizer after backward; it has no per-parameter "
                           "hook path")
        elif not rules_of(self.engine).reduces_before_grad_hooks and self.shard_ranks > 1:
            # torch DistributedDataParallel all-reduces buckets from its own autograd hooks; a post-accumulate-grad
            # hook would step on the unreduced local gradient (DDP uses these hooks only for compiled autograd).
            ranks = f"dp={self.dp}" + (f" x cp={self.cp}" if self.cp > 1 else "")
            reasons.append(f"DDP with {ranks} reduces gradients after the hooks would have stepped them; "
                           "use FSDP2 (which runs the hooks after its reduce-scatter)")
        if self.optimizer_offload is not Offload.NONE:
            reasons.append("offloaded optimizer steps are priced as one host step per optimizer step, not per "
                           "parameter during backward")
        if self.precision is Precision.FP16_MIXED:
            reasons.append("fp16 loss scaling unscales and checks all gradients for inf/NaN before stepping")
        return reasons

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_ranks(self) -> int:
        """Ranks that hold the same weights and reduce their gradients: the data-parallel ranks times the
        context-parallel ones, which see other tokens of the same sequences (torchtitan shards FSDP2 over its
        `dp_shard_cp` mesh, Megatron's distributed optimizer and gradient all-reduce use the data-parallel group with
        CP, DeepSpeed-Ulysses runs ZeRO over its sequence-data-parallel group)."""
        return self.dp * self.cp

    def layer_modes(self, layers: int) -> tuple[Checkpoint, ...]:
        """The per-layer modes, validated against the model's layer count (empty means no checkpointing)."""
        if not self.checkpoint:
            return (Checkpoint.NONE,) * layers
        if len(self.checkpoint) != layers:
            raise ValueError(f"checkpoint lists {len(self.checkpoint)} modes but the model has {layers} layers")
        return self.checkpoint
