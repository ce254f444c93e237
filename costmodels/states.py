"""Model states per GPU: parameters, gradients, fp32 master weights and optimizer states, after tensor
parallelism, ZeRO/FSDP sharding and offload, plus the optimizer step's temporaries."""

from __future__ import annotations

import math
from collections.abc import Sequence

from graphs import LayerGraph, ParamTensor

from . import optimizer_in_backward, optimizers, paging, partial_offload, precision
from .config import Config, Offload, Precision
from .engines import GradientSizes, rules_of
from .expert_parallel import state_ranks
from .identity_memo import IdentityMemo
from .offload import host_stepped, steps_a_share
from .terms import ModelStates
from .zero import local_elements, local_shape, persistence_threshold, shard_ranks, sharding, syncs_once_pipelined

Group = tuple[ParamTensor, int]
"""Identical parameter tensors and how many there are (`LayerGraph.tensor_groups`)."""


def _offloaded(kind: Offload, nbytes: int) -> tuple[int, int, int]:
    """(gpu, cpu, nvme) bytes of a state kept at `kind`."""
    return (nbytes, 0, 0) if kind is Offload.NONE else (0, nbytes, 0) if kind is Offload.CPU else (0, 0, nbytes)


# The configuration fields the model states read (a test checks it): they are cached on these, with the graph by
# identity, since the solver asks for one rank's states under many configurations that differ elsewhere.
STATE_FIELDS = ("cp", "dp", "dp_replicate", "engine", "ep", "grad_accum", "optimizer", "optimizer_in_backward",
                "optimizer_offload", "optimizer_offload_fraction", "param_offload", "pp", "precision", "tp",
                "zero")
_STATES: IdentityMemo[ModelStates] = IdentityMemo()


def model_states(graph: LayerGraph, config: Config) -> ModelStates:
    """The persistent states of one rank (the largest shard) and where they live, as the configured optimizer
    keeps them: a paged optimizer's large states in unified memory (`paging`), then, stepped in backward, no
    gradients between steps and one optimizer per tensor (`optimizer_in_backward`)."""
    return _STATES.get((graph,), tuple(getattr(config, name) for name in STATE_FIELDS),
                       lambda: _model_states(graph, config))


def _model_states(graph: LayerGraph, config: Config) -> ModelStates:
    states = _held_states(graph, config)
    paged = paged_split(graph, config)
    if paged is not None:
        states = paging.paged_model_states(states, paged)
    if config.optimizer_in_backward:
        states = optimizer_in_backward.in_backward_states(graph, config, states)
    return states


def paged_split(graph: LayerGraph, config: Config) -> paging.PagedStates | None:
    """A paged optimizer's states of one rank by where they live (None for other optimizers, and when the
    optimizer states are offloaded: then they are host tensors already)."""
    if not paging.is_paged(config.optimizer) or config.optimizer_offload is not Offload.NONE:
        return None
    return paging.paged_states(config.optimizer, _optimizer_shapes(config, list(graph.tensor_groups(trainable=True))))


def _held_states(graph: LayerGraph, config: Config) -> ModelStates:
    """The states of an optimizer that keeps everything on the device and steps after backward."""
    shard = sharding(config)
    # the graph's own tuples: `local_elements` caches their counts across configurations
    trainable, frozen = graph.tensor_groups(trainable=True), graph.tensor_groups(trainable=False)
    tp, dp, engine, prec = config.tp, shard_ranks(config), config.engine, config.precision

    def count(ts: Sequence[Group], sharded: bool) -> int:
        return local_elements(ts, tp=tp, dp=dp, engine=engine, sharded=sharded, ep=config.ep)

    sharded_params, persistent_params = _param_bytes(graph, config, trainable, frozen)
    grads, accumulating = _grad_bytes(config, count(trainable, False), count(trainable, True),
                                      precision.grad_itemsize(prec, engine))
    if syncs_once_pipelined(config):  # unsharded, upcast to the reduce dtype, until the step's one reduce-scatter
        accumulating = count(trainable, False) * precision.reduce_itemsize(prec, engine, config.optimizer)
    master = count(trainable, shard.optimizer > 1) * precision.master_itemsize(prec, engine, config.optimizer)
    opt = _optimizer_bytes(config, trainable)
    fp32_partition = _fp32_grad_partition(config, count(trainable, shard.optimizer > 1))
    offloaded, hybrid = config.optimizer_offload is not Offload.NONE, steps_a_share(config)
    gpu_grads, host_grads = grads, 0
    if hybrid:
        pass  # Megatron's gradient buffer stays whole on the GPU (`_hybrid_states`)
    elif offloaded and rules_of(engine).offload_moves_all_states:  # CPUOffloadPolicy: sharded grads on the CPU
        gpu_grads, host_grads = 0, grads
    elif offloaded and rules_of(engine).sharded(config.zero)[1]:
        # ZeRO-Offload keeps the fp32 gradient partition on the host, and with accumulation also a 16-bit
        # accumulation buffer (DeepSpeed stage_1_and_2.py `accumulated_grads_in_cpu`); nothing stays on the GPU.
        accumulation = 2 * count(trainable, True) if config.grad_accum > 1 else 0
        gpu_grads, host_grads = 0, fp32_partition + accumulation
    elif offloaded:
        gpu_grads, host_grads = grads - fp32_partition, fp32_partition
    gpu_master, cpu_opt, nvme_opt = _offloaded(config.optimizer_offload, master + opt)
    local = [shape for shape, n in _optimizer_shapes(config, trainable) for _ in range(n)]
    temp = 0 if offloaded else _step_temp(config, local, precision.state_itemsize(prec))
    if hybrid:  # the GPU keeps its share's states and step temporaries, the host the rest
        master, opt, temp, cpu_opt = _hybrid_states(
            config, master=master, opt=opt, temp=_step_temp(config, local, precision.state_itemsize(prec)),
            elements=count(trainable, shard.optimizer > 1))
        gpu_master = master + opt
    # DeepSpeed keeps its persistent (small, unpartitioned) parameters on the GPU under parameter offload
    # (partition_parameters.py: `if param.ds_persist: device = self.local_device`).
    gpu_params, cpu_params, nvme_params = _offloaded(config.param_offload, sharded_params)
    gpu_params += persistent_params + fp8_weight_cache(graph, config)
    return ModelStates(params=gpu_params, grads=gpu_grads, accumulating_grads=accumulating,
                       master=master if gpu_master else 0, optimizer=opt if gpu_master else 0, step_temp=temp,
                       cpu=cpu_opt + cpu_params + (host_grads if config.optimizer_offload is Offload.CPU else 0),
                       nvme=nvme_opt + nvme_params + (host_grads if config.optimizer_offload is Offload.NVME else 0))


def _hybrid_states(config: Config, *, master: int, opt: int, temp: int, elements: int) -> tuple[int, int, int, int]:
    """(GPU master, GPU optimizer states, GPU step temporaries, host bytes) of Megatron's hybrid optimizer, whose
    GPU keeps at most 1 - fraction of the rank's `elements` (`partial_offload`): fp32 main parameters and moments,
    and at the step, under --fp16, the fp32 copy of their gradients (`temp` of all of them); the host keeps the rest
    with a pinned fp32 gradient copy. The gradient buffer stays whole on the GPU."""
    on_host = host_stepped(config, elements)
    kept = (elements - on_host) / elements if elements else 0.0
    return (math.ceil(kept * master), math.ceil(kept * opt), math.ceil(kept * temp),
            on_host * partial_offload.HOST_BYTES_PER_ELEMENT)


# FP8 training (Transformer Engine / torchao float8) keeps an fp8 copy of each linear weight (1 byte per
# element) and an amax history per scaled tensor: input, weight and gradient of every linear, each
# `amax_history_len` fp32 values (1024 in accelerate's and Megatron's defaults).
FP8_AMAX_HISTORY = 1024
FP8_SCALED_TENSORS_PER_LINEAR = 3


def fp8_weight_cache(graph: LayerGraph, config: Config) -> int:
    """Bytes of fp8 weight copies and amax histories of the decoder layers' linear weights (fp8 only)."""
    if config.precision is not Precision.FP8:
        return 0
    linears = [(t, n) for t, n in graph.tensor_groups() if len(t.shape) >= 2 and t.node.startswith("layers.")]
    weights = local_elements(linears, tp=config.tp, dp=shard_ranks(config), engine=config.engine,
                             sharded=sharding(config).params > 1, ep=config.ep)
    return weights + sum(n for _, n in linears) * FP8_SCALED_TENSORS_PER_LINEAR * FP8_AMAX_HISTORY * 4


def _optimizer_shapes(config: Config, trainable: Sequence[Group]) -> list[tuple[tuple[int, ...], int]]:
    """(shape, count) the optimizer sees on one rank: FSDP2's DTensor shards, or DeepSpeed's flat partitions."""
    tp, dp, engine, ep = config.tp, shard_ranks(config), config.engine, config.ep
    if not rules_of(engine).per_tensor_dim_shards and sharding(config).optimizer > 1:
        return [((math.ceil(math.prod(local_shape(t, tp=tp, dp=1, engine=engine, ep=ep)) / state_ranks(t, dp, ep)),),
                 n) for t, n in trainable]
    return [(local_shape(t, tp=tp, dp=dp, engine=engine, ep=ep), n) for t, n in trainable]


def _optimizer_bytes(config: Config, trainable: Sequence[Group]) -> int:
    local = _optimizer_shapes(config, trainable)
    itemsize = precision.state_itemsize(config.precision)
    return (sum(n * optimizers.state_bytes(config.optimizer, shape, itemsize) for shape, n in local)
            + optimizers.step_counter_bytes(config.optimizer, sum(n for _, n in local))
            + optimizers.fixed_state_bytes(config.optimizer))


def _param_bytes(graph: LayerGraph, config: Config, trainable: Sequence[Group],
                 frozen: Sequence[Group]) -> tuple[int, int]:
    """(partitioned, persistent) parameter bytes per rank."""
    shard = sharding(config)
    tp, dp, engine, prec = config.tp, shard_ranks(config), config.engine, config.precision
    partitioned = persistent = 0
    # bitsandbytes-quantized base weights (QLoRA) keep their measured packed bytes and quantisation state, whole on
    # every rank: sharding packed weights (FSDP-QLoRA's bnb_4bit_quant_storage) is not modelled.
    persistent += sum(t.stored_bytes * n for t, n in frozen if t.stored_bytes is not None)
    frozen = [(t, n) for t, n in frozen if t.stored_bytes is None]
    for group, is_trainable in ((trainable, True), (frozen, False)):
        for itemsize, part in _widths(graph, group, precision.weight_itemsize(prec, engine, trainable=is_trainable),
                                      trainable=is_trainable).items():
            sharded = [g for g in part if not _persistent(graph, config, g[0])]
            whole = [g for g in part if _persistent(graph, config, g[0])]
            partitioned += itemsize * local_elements(sharded, tp=tp, dp=dp, engine=engine, sharded=shard.params > 1,
                                                     ep=config.ep)
            persistent += itemsize * local_elements(whole, tp=tp, dp=dp, engine=engine, sharded=False, ep=config.ep)
    return partitioned, persistent


def _widths(graph: LayerGraph, group: Sequence[Group], itemsize: int, *, trainable: bool) -> dict[int, list[Group]]:
    """The group by the bytes per element kept: the engine's `itemsize`, except the frozen tensors of a 4-bit base
    that PEFT's `prepare_model_for_kbit_training` left in fp32 (traced wider than the compute dtype a QLoRA base is
    lowered in, `graphs/kbit.py`)."""
    quantized = graph.lora is not None and graph.lora.quantization is not None
    widths: dict[int, list[Group]] = {}
    for g in group:
        wide = quantized and not trainable and g[0].itemsize > itemsize
        widths.setdefault(g[0].itemsize if wide else itemsize, []).append(g)
    return widths


def _persistent(graph: LayerGraph, config: Config, tensor: ParamTensor) -> bool:
    """DeepSpeed ZeRO-3 keeps small parameters (norm weights, biases) whole on every rank
    (`EngineRules.small_params_whole_stages`)."""
    return (config.zero in rules_of(config.engine).small_params_whole_stages
            and tensor.numel <= persistence_threshold(graph.dims.hidden))


def _fp32_grad_partition(config: Config, elements: int) -> int:
    """DeepSpeed under mixed precision keeps an fp32 gradient buffer beside the 16-bit gradients (the
    estimator's 18 bytes/param for ZeRO-2/3: `estimate_zero2_model_states_mem_needs`, stage3 likewise)."""
    if rules_of(config.engine).fp32_grad_copy_when_mixed and precision.is_mixed(config.precision):
        return 4 * elements
    return 0


def _grad_bytes(config: Config, full: int, partition: int, itemsize: int) -> tuple[int, int]:
    """(persistent, accumulating) gradient bytes per rank, laid out as the engine keeps them
    (`EngineRules.gradients`)."""
    rules = rules_of(config.engine)
    fp32 = _fp32_grad_partition(config, partition if rules.sharded(config.zero)[2] else full)
    reduce = precision.reduce_itemsize(config.precision, config.engine, config.optimizer)
    return rules.gradients(config.zero, GradientSizes(full=full, partition=partition, itemsize=itemsize,
                                                      fp32_copy=fp32, reduce_itemsize=reduce, dp=shard_ranks(config)))


def _step_temp(config: Config, local: list[tuple[int, ...]], itemsize: int) -> int:
    """DeepSpeed runs its own fused Adam (no list-wide temporaries); torch optimizers use foreach on CUDA. An engine
    that keeps 16-bit gradients under fp16 casts the ones it steps to fp32 first, all alive through the step:
    megatron-core 0.16 `_copy_model_grads_to_main_grads`, `main_param.grad = model_param.main_grad.float()`
    (optimizer.py) or `shard_main_param.grad = shard_model_grad.float()` (distrib_optimizer.py)."""
    rules = rules_of(config.engine)
    if rules.fp16_keeps_16bit_grads and config.precision is Precision.FP16_MIXED:
        return 4 * sum(math.prod(shape) for shape in local)
    if rules.own_fused_optimizer:
        return 0
    return optimizers.step_temp_bytes(config.optimizer, local, itemsize)
