"""What a data-parallel engine is, as the cost models ask it: one `EngineRules` value per engine, each in its own
module with the version and the source each rule was checked against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..choices import Engine


@dataclass(frozen=True, slots=True)
class DataParallelTraffic:
    """Bytes each rank moves in data-parallel collectives, by when they happen."""

    forward_gather: int = 0
    """Parameters all-gathered during each micro-batch's forward (ZeRO-3 / FSDP2)."""
    backward_gather: int = 0
    """Parameters all-gathered again during backward (reshard-after-forward)."""
    backward_reduce: int = 0
    """Gradients reduce-scattered during each micro-batch's backward (ZeRO-2/3, FSDP2)."""
    step_allreduce: int = 0
    """Gradients all-reduced once per step, overlapping the last backward (DDP, ZeRO-0/1)."""
    step_reduce: int = 0
    """Gradients reduce-scattered once per step, overlapping the last backward (Megatron's distributed
    optimizer)."""
    step_gather: int = 0
    """Updated parameters all-gathered after the optimizer step (ZeRO-1/2)."""
    first_forward_gather: int = 0
    """Parameters all-gathered once per step, in the first micro-batch's forward, and kept gathered until the last
    backward (FSDP2 under torch's pipelining)."""
    end_reduce: int = 0
    """Gradients reduce-scattered once per step, after the last micro-batch's backward (FSDP2 under torch's
    pipelining: nothing left to overlap them with)."""

    def per_step(self, micro_batches: int) -> tuple[int, int]:
        """(gathered, reduced) bytes of one step of `micro_batches` micro-batches (full-buffer sizes)."""
        gathered = micro_batches * (self.forward_gather + self.backward_gather) + self.step_gather + \
            self.first_forward_gather
        reduced = micro_batches * self.backward_reduce + self.step_allreduce + self.step_reduce + self.end_reduce
        return gathered, reduced


@dataclass(frozen=True, slots=True)
class GradientSizes:
    """What a rank's gradient buffers are made of (elements after TP; bytes per element)."""

    full: int
    """Trainable elements of the whole (TP-local) model."""
    partition: int
    """Trainable elements of this rank's gradient shard."""
    itemsize: int
    """Bytes per element of gradients as backward produces them."""
    fp32_copy: int
    """Bytes of the engine's fp32 gradient copy (0 where it keeps none)."""
    reduce_itemsize: int
    """Bytes per element the engine reduces in."""
    dp: int


@dataclass(frozen=True, slots=True)
class UnitBytes:
    """Per node (unit) of the model, what a sharding engine gathers and reduces."""

    gathered: list[int]
    """Parameters gathered whole (within the TP shard) in the compute dtype."""
    grads: list[int]
    """Unsharded gradients before reduce-scatter (with their reduce-dtype copy)."""
    bucket: int
    """The double-buffered reduce bucket."""
    prefetch: int
    """Bytes of the engine's parameter prefetch bucket."""


Buffers = list[tuple[int, int, int]]
"""Per node: (forward transient, kept from forward to backward, backward transient) engine bytes."""


def _no_buffers(stage: int, units: UnitBytes) -> Buffers:
    return [(0, 0, 0)] * len(units.gathered)


@dataclass(frozen=True, slots=True)
class EngineRules:
    """One engine's behaviour at each of its ZeRO stages."""

    engine: Engine
    runtime: str
    """The runtime and version the rules were checked against."""
    stages: tuple[int, ...]
    """The ZeRO stages it runs (FSDP2: 2 keeps parameters gathered until backward, 3 reshards after forward)."""
    stage_rule: str
    """How its stages are named, for the refusal of another (e.g. "has no ZeRO stage; use deepspeed or fsdp2")."""
    sharded_from: tuple[int | None, int | None, int | None]
    """First stage at which (parameters, gradients, optimizer states) are split over the data-parallel ranks
    (None: never)."""
    per_tensor_dim_shards: bool
    """Shards each tensor on one dim (FSDP2's `Shard` placements) rather than a flat partition (DeepSpeed)."""
    reshard_stages: tuple[int, ...]
    """Stages that free gathered parameters after forward and gather them again for backward."""
    fp32_weights_when_mixed: bool
    """Keeps trainable weights in fp32 under mixed precision (autocast / MixedPrecisionPolicy cast per use)
    rather than in 16 bits beside an fp32 master copy."""
    fp32_grads_when_mixed: bool
    """Backward produces fp32 gradients under mixed precision (autocast over fp32 leaf weights)."""
    compile_stages: tuple[int, ...]
    """Stages at which a torch.compile'd model runs as compiled (credited in time)."""
    optimizer_offload_stages: tuple[int, ...]
    """Stages that can keep the optimizer states (and fp32 masters) on the host."""
    param_offload_stages: tuple[int, ...]
    """Stages that can keep parameter shards on the host between uses."""
    gradients: Callable[[int, GradientSizes], tuple[int, int]]
    """(persistent, accumulating) gradient bytes per rank at a stage."""
    nvme_stages: tuple[int, ...] = ()
    """Stages that can offload to NVMe."""
    offload_moves_all_states: bool = False
    """Offload moves parameters, gradients and optimizer states together (FSDP2's CPUOffloadPolicy)."""
    offload_runs_own_optimizer: bool = False
    """Under optimizer offload the step is the engine's own CPU optimizer, whatever optimizer was asked for."""
    host_optimizer: str = ""
    """The optimizer implementation that runs a host (offloaded) step (profile rate name)."""
    hybrid_offload: bool = False
    """Under optimizer offload it steps a share of the states on the host (torch's fused CPU AdamW) and the rest on
    the GPU at the same time, the gradients staying in the GPU's buffer (megatron-core's HybridDeviceOptimizer:
    `Config.optimizer_offload_fraction`, `costmodels.partial_offload`)."""
    buffers: Callable[[int, UnitBytes], Buffers] = _no_buffers
    """The engine's gather/reduce buffers per node at a stage."""
    runs_autocast: bool = False
    """Runs mixed precision as autocast over an fp32 module (lowered in fp32 with autocast) rather than a
    16-bit module."""
    reduce_fp32_when_mixed: bool = False
    """Reduces gradients in fp32 under mixed precision (FSDP2's MixedPrecisionPolicy reduce_dtype)."""
    fp16_keeps_16bit_grads: bool = False
    """Under fp16 mixed precision it accumulates and reduces gradients in fp16 all the same, and its optimizer
    casts the (shard of the) gradients it steps to fp32 at the step (Megatron-LM)."""
    fp32_grad_copy_when_mixed: bool = False
    """Keeps an fp32 gradient buffer beside the 16-bit gradients under mixed precision."""
    small_params_whole_stages: tuple[int, ...] = ()
    """Stages that keep small parameters (norms, biases) whole on every rank instead of sharding them."""
    pipeline_stages: tuple[int, ...] = ()
    """Stages a pipeline-parallel runtime runs it at: parameters kept from a micro-batch's forward to its
    backward (a pipeline interleaves micro-batches, so resharding after every forward is refused)."""
    megatron_schedules: bool = False
    """Its pipelines run megatron-core's schedules, not torch.distributed.pipelining's: each received tensor is
    made when its message arrives and dropped once used (`P2PCommunicator._communicate`: `torch.empty` per call),
    not a receive buffer per micro-batch kept all step (`pipeline.receive_buffer_bytes`), and 1F1B also runs with
    fewer micro-batches than stages (`pipeline_schedule.schedule_problem`)."""
    own_fused_optimizer: bool = False
    """Steps its own fused optimizer (no torch foreach temporaries), after backward only."""
    bucketed_reduce_stages: tuple[int, ...] = ()
    """Stages that reduce-scatter gradients in fixed-size buckets (the last bucket is exposed)."""
    allreduce_bucket_bytes: int | None = None
    """Fixed gradient all-reduce bucket (DDP's bucket_cap_mb); None: the engine's hidden^2-element bucket."""
    bucket_elements: Callable[[int], int] | None = None
    """Gradient bucket elements for a data-parallel size, where the engine sizes them so (Megatron's DDP); it
    buckets both its all-reduce and its reduce-scatter."""
    host_buffer_factor: float = 1.0
    """Host memory per offloaded byte (pinned staging buffers)."""
    reduces_once_per_step: bool = False
    """Reduces gradients only in the last micro-batch's backward (earlier ones accumulate locally), also where
    it reduce-scatters them (Megatron's DDP: `no_sync` for all but the last micro-batch)."""
    reduces_before_grad_hooks: bool = False
    """Its reduce-scatter runs before the post-accumulate-grad hooks (so an optimizer can step in backward on
    reduced, sharded gradients)."""
    grads_land_sharded: bool = False
    """A unit's gradients come into being as its reduce-scatter lands, sharded and in the reduce dtype, and the
    unsharded ones backward produced are freed (FSDP2): a step's first backward holds none before that."""
    bf16_state_optimizer_stages: tuple[int, ...] = ()
    """Stages that run an Adam with bf16 moments and main gradients under bf16 mixed precision (Megatron's
    precision-aware optimizer: `Optimizer.ADAMW_BF16`)."""
    bnb_optimizers: bool = True
    """Steps bitsandbytes' optimizers, whose kernels take plain tensors (FSDP2's DTensor parameters make them
    fail)."""
    quantized_base: bool = False
    """Runs a bitsandbytes-quantized (packed) base as fitplan prices it (whole on every rank)."""
    vocab_parallel_loss: bool = False
    """Trains its own GPT model, whose loss is its vocab-parallel cross-entropy (megatron-core's
    `vocab_parallel_cross_entropy`), not the HF code's `ForCausalLMLoss` (`loss.megatron_head`)."""
    transformer_engine: bool = False
    """Runs Transformer Engine's modules: fused fp8 casts with cached fp8 weights (`fp8.te_cast_bytes`), cuDNN's
    fused attention from Hopper on, and their tensor-parallel overlap (`tensor_parallel`)."""
    fetches_per_module: bool = False
    """Gathers sharded parameters module by module just before use, prefetching a bounded number of elements ahead,
    and reduce-scatters each module's gradients after its backward (DeepSpeed ZeRO-3: `prefetch`)."""
    hybrid_shards: bool = False
    """Shards the model states over a sub-group of the data-parallel ranks and replicates them across the groups,
    all-reducing the gradient shards between replicas (FSDP2's HSDP: `fully_shard` on a 2-D device mesh;
    `Config.dp_replicate`)."""
    syncs_once_when_pipelined: bool = False
    """Under a pipeline schedule its sharded parameters are gathered once per step and its gradients
    reduce-scattered once, after the last backward, instead of per micro-batch (torch's pipelining drives FSDP2
    so)."""

    def sharded(self, stage: int) -> tuple[bool, bool, bool]:
        """Whether (parameters, gradients, optimizer states) are split over the data-parallel ranks."""
        return tuple(first is not None and stage >= first for first in self.sharded_from)  # type: ignore[return-value]

    def reshards(self, stage: int) -> bool:
        return stage in self.reshard_stages

    def compiles(self, stage: int) -> bool:
        return stage in self.compile_stages

    def traffic(self, stage: int, *, param_bytes: int, grad_bytes: int,
                pipelined: bool = False) -> DataParallelTraffic:
        """Full-buffer sizes of each data-parallel collective; `param_bytes`/`grad_bytes` are the TP-local
        parameter and gradient sizes in the communicated dtypes (those of one pipeline rank when `pipelined`)."""
        params, grads, _ = self.sharded(stage)
        if params and pipelined and self.syncs_once_when_pipelined:
            return DataParallelTraffic(first_forward_gather=param_bytes, end_reduce=grad_bytes)
        if params:  # gathered per use, gradients reduce-scattered per micro-batch
            return DataParallelTraffic(forward_gather=param_bytes,
                                       backward_gather=param_bytes if self.reshards(stage) else 0,
                                       backward_reduce=grad_bytes)
        if grads and self.reduces_once_per_step:  # reduce-scattered in the last backward, shards gathered after
            return DataParallelTraffic(step_reduce=grad_bytes, step_gather=param_bytes)
        if grads:  # reduce-scattered in backward, updated shards gathered after the step
            return DataParallelTraffic(backward_reduce=grad_bytes, step_gather=param_bytes)
        return DataParallelTraffic(step_allreduce=grad_bytes)

    def refusals(self, stage: int, *, optimizer_offload: str, param_offload: str) -> list[str]:
        """What this engine cannot run of these stage and offload targets ("none", "cpu", "nvme")."""
        name = f"engine={self.engine}"
        if stage not in self.stages:
            return [f"{name} {self.stage_rule} (zero={stage})"]
        problems = []
        if "nvme" in (optimizer_offload, param_offload) and stage not in self.nvme_stages:
            problems.append(f"NVMe offload needs DeepSpeed ZeRO-3 ({name}, zero={stage})")
        if optimizer_offload != "none" and stage not in self.optimizer_offload_stages:
            problems.append(f"optimizer_offload={optimizer_offload} needs ZeRO stage "
                            f"{_stages(self.optimizer_offload_stages)} under {self.engine} (zero={stage}): it "
                            "offloads only the optimizer states it partitions" if self.optimizer_offload_stages
                            else f"{name} cannot offload the optimizer; use deepspeed or fsdp2")
        if param_offload != "none" and stage not in self.param_offload_stages:
            problems.append(f"param_offload={param_offload} needs ZeRO-3 (zero={stage})")
        if self.offload_moves_all_states and optimizer_offload != param_offload:
            problems.append(f"{self.runtime}'s CPUOffloadPolicy moves parameters, gradients and optimizer "
                            f"states together: optimizer_offload={optimizer_offload} must equal "
                            f"param_offload={param_offload}")
        return problems


def _stages(stages: tuple[int, ...]) -> str:
    return f"{stages[0]}-{stages[-1]}" if len(stages) > 1 else str(stages[0])
