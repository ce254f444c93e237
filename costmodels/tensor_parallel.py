"""Tensor parallelism's collectives: per-layer all-reduces of the boundary activation (Shoeybi et al. 2019)."""

from __future__ import annotations

from dataclasses import replace

from graphs import Checkpoint, Layer, LayerGraph, ModeCost, Poly, Role, Work

from . import precision
from .activations import evaluate
from .cluster import Cluster
from .collectives import Group, all_gather_seconds, all_reduce_seconds, reduce_scatter_seconds, tp_group
from .config import Config
from .engines import rules_of
from .identity_memo import IdentityMemo


def tp_node_seconds(graph: LayerGraph, cluster: Cluster, config: Config, layer: Layer, mode: Checkpoint, *,
                    b: int, s: int, column_gemms: tuple[float, ...] = ()) -> float:
    """Seconds of one node's TP collectives per micro-batch (forward, backward and recompute) that compute does not
    hide.

    Each row-wise module all-reduces its output in forward and the column-wise modules all-reduce their input
    gradients in backward (`backward_allreduces`); recompute repeats forward ones (`recomputed_allreduces`).
    With sequence parallelism the all-reduce becomes a reduce-scatter plus an all-gather of equal cost. Forward
    collectives are exposed; Transformer Engine's layers overlap the backward ones with the column-wise modules'
    GEMMs (`te_backward_seconds`, given those GEMMs' seconds as `column_gemms`), other runtimes do not.
    """
    if config.tp == 1:
        return 0.0
    group = tp_group(cluster, config.tp)
    boundary = evaluate(layer.boundary, b=b, s=s, tp=1, sequence_parallel=False)
    forward = forward_allreduces(layer) + recomputed_allreduces(layer.tp_allreduces, mode,
                                                                sequence_parallel=config.sequence_parallel)
    seconds = forward * all_reduce_seconds(cluster, group, boundary)
    if rules_of(config.engine).transformer_engine and layer.role is Role.DECODER:
        seconds += te_backward_seconds(cluster, group, layer, boundary, column_gemms,
                                       sequence_parallel=config.sequence_parallel)
    else:
        seconds += backward_allreduces(graph, layer) * all_reduce_seconds(cluster, group, boundary)
    return seconds + _vocabulary_seconds(graph, cluster, group, config, layer, tokens=b * s)


def te_backward_seconds(cluster: Cluster, group: Group, layer: Layer, boundary: int, column_gemms: tuple[float, ...],
                        *, sequence_parallel: bool) -> float:
    """Exposed seconds of a TE layer's backward TP collectives. Each column-parallel module launches its input
    gradient's all-reduce (reduce-scatter with sequence parallelism) asynchronously and computes its weight
    gradient meanwhile, and with sequence parallelism re-gathers its input behind its input-gradient GEMM
    (TransformerEngine d0067d0 module/layernorm_linear.py and linear.py backward: `async_op=True`, waited after the
    wgrad GEMM; megatron-core's own LinearWithGradAccumulationAndAsyncCommunication does the same); only what outlasts
    that GEMM shows. Row-parallel modules all-gather their output gradient first with sequence parallelism
    (`grad_output_preprocess`), exposed. `column_gemms`: seconds of one GEMM of each column-parallel weight (the
    input- and weight-gradient GEMMs have the forward's FLOPs), one module per row-parallel one when they pair up,
    else their total split evenly."""
    modules = layer.tp_allreduces
    if modules == 0:
        return 0.0
    gemms = column_gemms if len(column_gemms) == modules else (sum(column_gemms) / modules,) * modules
    if not sequence_parallel:
        reduce = all_reduce_seconds(cluster, group, boundary)
        return sum(max(0.0, reduce - g) for g in gemms)
    gather, scatter = all_gather_seconds(cluster, group, boundary), reduce_scatter_seconds(cluster, group, boundary)
    return modules * gather + sum(max(0.0, scatter - g) + max(0.0, gather - g) for g in gemms)


# megatron-core core_v0.16.1 tensor_parallel/cross_entropy.py: the vocab-parallel cross-entropy all-reduces the
# logits' max, the target logits and the sum of exponentials over the TP group, one fp32 value per token each.
VOCAB_PARALLEL_LOSS_ALLREDUCES = 3


def _vocabulary_seconds(graph: LayerGraph, cluster: Cluster, group: Group, config: Config, layer: Layer, *,
                        tokens: int) -> float:
    """The head's and loss's TP collectives: the HF plan gathers the logits (`colwise_gather_output`) so the loss
    sees them all; Megatron's cross-entropy works on each rank's vocabulary shard and all-reduces three per-token
    values instead."""
    if not head_is_sharded(graph):
        return 0.0
    if graph.runtime == "megatron":
        fp32 = 4
        return VOCAB_PARALLEL_LOSS_ALLREDUCES * all_reduce_seconds(cluster, group, tokens * fp32) \
            if layer.role is Role.LOSS else 0.0
    if layer.role is Role.HEAD and any(p.tp_dim is not None for p in layer.params):
        logits = tokens * graph.dims.vocab * precision.compute_itemsize(config.precision)
        return all_gather_seconds(cluster, group, logits)
    return 0.0


# Column-wise styles of the lowering's TP plan (`graphs.structure`): each module shards its output features.
_COLWISE = ("colwise", "packed_colwise")


def forward_allreduces(layer: Layer) -> int:
    """Output all-reduces of one node's forward: one per row-wise module, and the row-wise embedding's."""
    return layer.tp_allreduces + any(p.tp_style == "embedding_rowwise" for p in layer.params)


def backward_allreduces(graph: LayerGraph, layer: Layer) -> int:
    """Input-gradient all-reduces of one node's backward. torchtitan (and Megatron) prepare each block's input
    once (`PrepareModuleInput`), so the column-wise projections sharing it reduce one gradient: one per row-wise
    module. The HF TP plan (transformers' and the generated torchrun script's `parallelize_module`) makes each
    column-wise module's input a DTensor of its own, so each all-reduces its own gradient (q, k, v, gate and up
    in a Llama layer), the LM head's (`colwise_gather_output`, tied or not) included; checked against a real
    gloo run (tests/costmodels/test_tp_recompute_gloo.py)."""
    if graph.runtime != "hf":
        return layer.tp_allreduces
    if layer.role is Role.HEAD:
        return 1
    modules = {p.name.rsplit(".", 1)[0] if p.name.endswith((".weight", ".bias")) else p.name
               for p in layer.params if p.tp_style in _COLWISE}
    return max(layer.tp_allreduces, len(modules))


def recomputed_allreduces(rowwise: int, mode: Checkpoint, *, sequence_parallel: bool) -> float:
    """Forward TP collectives a checkpointed layer runs again in backward, in all-reduces (a reduce-scatter or an
    all-gather is half of one).

    torch.utils.checkpoint stops recomputing once the last tensor backward needs is back (early stop, on by
    default), so the collective after the layer's last row-wise module, whose output only the residual add
    reads, is not repeated: full recompute reruns the others. Op-level SAC keeps the outputs of the ops on its
    list (torchtitan 0.3.0 `_get_default_save_ops`): reduce-scatters, but not all-reduces or all-gathers, so
    without sequence parallelism it reruns what full recompute does (the forward all-reduces feed recomputed
    norms), and with it only the all-gathers in front of each column-wise group. Checked against a real gloo
    run of the HF TP plan (tests/costmodels/test_tp_recompute_gloo.py).
    """
    if rowwise == 0 or mode in (Checkpoint.NONE, Checkpoint.SELECTIVE):
        return 0.0
    if mode is Checkpoint.OP_SELECTIVE and sequence_parallel:
        return rowwise / 2
    return rowwise - (0.5 if sequence_parallel else 1.0)


def head_is_sharded(graph: LayerGraph) -> bool:
    """Whether TP splits the LM head over the vocabulary: its own weight is column-wise, or a tied head reuses the
    vocabulary-split embedding (Megatron's output layer on the shared word embeddings)."""
    nodes = graph.nodes()
    head = [p for layer in nodes if layer.role is Role.HEAD for p in layer.params]
    if head:
        return any(p.tp_dim is not None for p in head)
    return any(p.tp_style == "embedding_rowwise" for layer in nodes if layer.role is Role.EMBEDDING
               for p in layer.params)


_RANK_LAYERS: IdentityMemo[Layer] = IdentityMemo()


def rank_layer(graph: LayerGraph, layer: Layer, tp: int) -> Layer:
    """`layer` as one TP rank runs it (the same object when TP changes nothing, memoised otherwise, so the node-time
    memo keyed on layers by identity keeps hitting)."""
    if tp == 1 or layer.role not in (Role.HEAD, Role.LOSS) or not head_is_sharded(graph):
        return layer
    return _RANK_LAYERS.get((graph, layer), (tp,), lambda: _rank_layer(graph, layer))


def _rank_layer(graph: LayerGraph, layer: Layer) -> Layer:
    """`layer` as one TP rank runs it. A vocabulary-split head computes vocab / tp of the logits on each rank
    (megatron-core `ColumnParallelLinear`: `output_size_per_partition = output_size / world_size`; the HF plan's
    colwise lm_head likewise), so its matmul FLOPs divide by tp, which the lowering, tracing one rank's decoder
    layers only, leaves whole. Megatron's `vocab_parallel_cross_entropy` then works on that shard (its bytes divide
    too); the HF plan gathers the logits first (`colwise_gather_output`), so its loss runs whole on every rank."""
    if layer.role is Role.HEAD:
        return replace(layer, modes=tuple((m, _per_rank(c, flops=True)) for m, c in layer.modes))
    if layer.role is Role.LOSS and graph.runtime == "megatron":
        return replace(layer, modes=tuple((m, _per_rank(c, flops=False)) for m, c in layer.modes))
    return layer


def _per_rank(cost: ModeCost, *, flops: bool) -> ModeCost:
    """A head's or loss's cost with its FLOPs (or its memory-bound bytes) split over the TP ranks."""
    def split(work: Work) -> Work:
        if flops:
            return replace(work, flops=_over_tp(work.flops), attention_flops=_over_tp(work.attention_flops))
        return replace(work, io_bytes=_over_tp(work.io_bytes))
    return replace(cost, forward=split(cost.forward), backward=split(cost.backward), recompute=split(cost.recompute))


def _over_tp(poly: Poly) -> Poly:
    """`poly` / t: every monomial one power of 1/t further."""
    return Poly.of({(i, j, k + 1): c for (i, j, k), c in poly.terms})
