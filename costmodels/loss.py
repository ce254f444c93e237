"""The LM head and loss as each runtime computes them: Hugging Face's upcast cross-entropy, torchtune's chunked
cross-entropy and Liger's fused linear cross-entropy.

Each runtime is written as the sequence of allocations and frees its code makes (cited line by line), in bytes
relative to the live memory when the head starts (the final norm's output `h` is already allocated). The peak
and net of a sequence replace the lowered head and loss nodes of the activation timeline (`loss_nodes`). The
Hugging Face sequence is what the lowering traces; the test suite checks both against each other and each
runtime's code against MemTracker on fake tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import accumulate

from graphs import Checkpoint, Layer, LayerGraph, Poly, Role, Work
from graphs.architectures import liger_fused_linear, liger_patched

from . import precision
from .activations import NodeMemory
from .config import Config, Loss
from .engines import rules_of
from .lowering import lowering_for
from .terms import MemoryTerms

Events = list[tuple[str, int]]
"""(what, bytes allocated (+) or freed (-)) in program order."""

# torchtune's `CEWithChunkedOutputLoss(num_output_chunks=8)` default (torchtune 0.6.1
# modules/loss/ce_chunked_output_loss.py), used by its recipes' configs.
TORCHTUNE_CHUNKS = 8
LABEL_ITEMSIZE = 8  # int64 token ids
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# liger-kernel 0.8.5 ops/cross_entropy.py `liger_cross_entropy_kernel`, per logits row: "[Online softmax] first
# pass: find max + sum" loads the row, the "Second pass: compute gradients" loads it again and stores the gradient in
# place (`tl.store(X_ptr + X_offsets, X_block)`): three passes over the row in the logits dtype.
LIGER_ROW_PASSES = 3
# ops/fused_linear_cross_entropy.py, per chunk: the logits `mm`, the cross-entropy kernel, the grad_input `mm` and
# the grad_weight accumulation; its backward only rescales when grad_output != 1 (a scalar loss's is 1).
LIGER_KERNELS_PER_CHUNK = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadShape:
    """What the head and loss of one micro-batch allocate from: shapes, dtypes and the weight's gradient."""

    b: int
    s: int
    hidden: int
    vocab: int
    itemsize: int
    """Bytes per element of the activations and logits (the compute dtype)."""
    weight_itemsize: int
    """Bytes per element of the parameters and of `h` (4 under autocast with fp32 weights)."""
    weight_grad: int
    """Bytes of the head weight's gradient (0 when it is frozen)."""
    tied: bool
    """The head weight is the embedding's: its gradient waits for the embedding's backward."""

    @property
    def tokens(self) -> int:
        return self.b * self.s


@dataclass(frozen=True, slots=True, kw_only=True)
class LossMemory:
    """One runtime's head and loss as event sequences."""

    forward: Events
    released: int
    """Bytes freed when the forward returns (locals, the logits, what nothing saved), before backward."""
    saved: int
    """Activation bytes kept for backward (for reporting)."""
    backward: Events


def peak(events: Events) -> int:
    """The largest running total of a sequence (never below zero: nothing allocated is no peak)."""
    return max([0, *accumulate(delta for _, delta in events)])


def net(events: Events) -> int:
    return sum(delta for _, delta in events)


def hf_loss(x: HeadShape) -> LossMemory:
    """transformers 5.x `ForCausalLMLoss` (loss/loss_utils.py): `logits.float()`, `nn.functional.pad(labels,
    (0, 1))`, `labels[..., 1:].contiguous()`, `cross_entropy` (log_softmax saves its output, nll_loss the
    target). The model returns the logits, which the caller drops before backward."""
    t, v, h, c = x.tokens, x.vocab, x.hidden, x.itemsize
    upcast = 4 * t * v if c != 4 else 0  # .float() of fp32 logits is the same tensor
    forward = [("logits", t * v * c), ("upcast", upcast), ("padded labels", LABEL_ITEMSIZE * (t + x.b)),
               ("shifted labels", LABEL_ITEMSIZE * t), ("log_softmax", 4 * t * v)]
    released = t * v * c + upcast + LABEL_ITEMSIZE * (t + x.b)
    backward = [("nll grad", 4 * t * v), ("target", -LABEL_ITEMSIZE * t), ("log_softmax grad", 4 * t * v),
                ("nll grad", -4 * t * v), ("log_softmax", -4 * t * v)]
    if c != 4:
        backward += [("logits grad", t * v * c), ("fp32 grad", -4 * t * v)]
    backward += _linear_backward(x, tokens=t, logits_grad=t * v * c, saved_input=t * h * c)
    return LossMemory(forward=forward, released=released, saved=4 * t * v + LABEL_ITEMSIZE * t + t * h * c,
                      backward=backward)


def _linear_backward(x: HeadShape, *, tokens: int, logits_grad: int, saved_input: int) -> Events:
    """One head matmul's backward: weight gradient, input gradient, then its logits gradient and saved input
    go (`mm` backward of torch.nn.functional.linear)."""
    return [("weight grad", x.weight_grad), ("input grad", tokens * x.hidden * x.itemsize),
            ("logits grad", -logits_grad), ("saved input", -saved_input)]


def chunk_tokens(b: int, s: int, chunks: int) -> list[int]:
    """Tokens of each chunk of `torch.chunk(chunks, dim=1)` over the sequence: ceil(s / chunks) positions each
    (fewer chunks when that covers s), the last one the rest."""
    size = math.ceil(s / chunks)
    return [b * min(size, s - start) for start in range(0, s, size)]


def chunked_loss(x: HeadShape, chunks: int = TORCHTUNE_CHUNKS) -> LossMemory:
    """torchtune 0.6.1: `TransformerDecoder.chunked_output` runs the head on `h.chunk(n, dim=1)` (for b > 1 the
    chunks are not contiguous and the matmul saves a contiguous copy of each), the recipe shifts the labels
    with `torch.hstack`, and `CEWithChunkedOutputLoss` upcasts one chunk at a time (`logits.float()` inside
    `compute_cross_entropy`), keeping each chunk's log-softmax. `del logits` precedes backward. A frozen head
    (LoRA) saves no input: its matmuls keep only the weight, for the input's gradient, so the copies go as each
    matmul returns and `h` when the model's forward does."""
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be at least 1")
    t, v, h, c = x.tokens, x.vocab, x.hidden, x.itemsize
    copies, frozen = x.b > 1, x.weight_grad == 0
    sizes = chunk_tokens(x.b, x.s, chunks)
    forward: Events = []
    for n in sizes:
        forward += [("input copy", n * h * c if copies else 0), ("logits chunk", n * v * c)]
        forward += [("input copy", -n * h * c if copies and frozen else 0)]
    # the model's forward returns: only what the matmuls saved (copies, or views of h) keeps h's values
    forward += [("h", -t * h * c if copies or frozen else 0)]
    forward += [("hstack labels", LABEL_ITEMSIZE * t), ("mask", t), ("mask", -t),
                ("label copies", LABEL_ITEMSIZE * t if copies else 0)]
    for n in sizes:
        upcast = 4 * n * v if c != 4 else 0
        forward += [("upcast", upcast), ("log_softmax", 4 * n * v), ("upcast", -upcast)]
    released = t * v * c + (LABEL_ITEMSIZE * t if copies else 0)  # `del logits`; the hstack labels if copied
    backward: Events = []
    for n in reversed(sizes):
        labels = LABEL_ITEMSIZE * n if copies else 0
        backward += [("nll grad", 4 * n * v), ("target", -labels), ("log_softmax grad", 4 * n * v),
                     ("nll grad", -4 * n * v), ("log_softmax", -4 * n * v)]
        if c != 4:
            backward += [("logits grad", n * v * c), ("fp32 grad", -4 * n * v)]
    backward += [("labels", 0 if copies else -LABEL_ITEMSIZE * t)]
    for i, n in enumerate(reversed(sizes)):
        saved_input = n * h * c if copies and not frozen else 0
        backward += _linear_backward(x, tokens=n, logits_grad=n * v * c, saved_input=saved_input)
        if i:  # autograd's input buffer adds the new weight gradient to the earlier ones out of place
            backward += [("weight grad sum", x.weight_grad), ("weight grads", -2 * x.weight_grad)]
    backward += [("input grad cat", t * h * c), ("input grad chunks", -t * h * c),
                 ("h", 0 if copies or frozen else -t * h * c)]
    return LossMemory(forward=forward, released=released,
                      saved=4 * t * v + (0 if frozen else t * h * c) + LABEL_ITEMSIZE * t, backward=backward)


def liger_chunk_size(tokens: int, hidden: int, vocab: int, chunk_mem_const: int = 1) -> int:
    """Rows per chunk in liger-kernel 0.8.5 `fused_linear_cross_entropy_forward`
    (ops/fused_linear_cross_entropy.py lines 103-105): `inc_factor = cdiv(V, chunk_mem_const * H)`,
    `chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT)`."""
    inc_factor = -(-vocab // (chunk_mem_const * hidden))
    rows = -(-tokens // inc_factor)
    return min(1 << (rows - 1).bit_length(), tokens)


def fused_linear_loss(x: HeadShape) -> LossMemory:
    """liger-kernel 0.8.5 through transformers' `use_liger_kernel` (`LigerForCausalLMLoss`,
    transformers/model/loss_utils.py): labels padded and shifted, then `fused_linear_cross_entropy_forward`
    computes the loss and both gradients chunk by chunk in forward (`grad_input` like `h`, `grad_weight` like the
    weight, saved for a backward that only scales them); one chunk's logits exist at a time. The matmul paths
    are the CUDA ones (sm80+): without autocast the logits go into one reused `logits_storage`
    (`_can_use_mm_out`) and 16-bit weights accumulate with `addmm(out=grad_weight)`, fp32 ones through
    `grad_weight += mm(...).float()`; under autocast (fp32 weights and `h`) each chunk casts `weight.t()` and its
    input chunk twice, and autocast caches one cast of `weight` until it exits."""
    t, v, h, c, g, hw = x.tokens, x.vocab, x.hidden, x.itemsize, x.weight_grad, x.weight_itemsize
    rows = liger_chunk_size(t, h, v)
    sizes = [rows] * (-(-t // rows) - 1) + [t - rows * (-(-t // rows) - 1)]
    forward: Events = [("padded labels", LABEL_ITEMSIZE * (t + x.b)), ("shifted labels", LABEL_ITEMSIZE * t),
                       ("grad_input", t * h * hw), ("grad_weight", g), ("loss_1d", 4 * t), ("mask", t)]
    autocast = hw != c
    if autocast:
        cast = v * h * c
        for i, r in enumerate(sizes):
            forward += [("weight.t() cast", cast), ("input chunk cast", r * h * c), ("logits chunk", r * v * c),
                        ("weight.t() cast", -cast), ("input chunk cast", -r * h * c),
                        ("cached weight cast", 0 if i else cast), ("input grad chunk", r * h * c),
                        ("input grad chunk", -r * h * c), ("input chunk cast", r * h * c),
                        ("input chunk cast", -r * h * c), ("logits chunk", -r * v * c)]
    else:
        forward += [("logits_storage", rows * v * c)]
        if c == 4 and g:
            forward += [("mm weight grad", g), ("mm weight grad", -g)]
        forward += [("logits_storage", -rows * v * c)]
    kept = t * h * hw + g  # grad_input and grad_weight, saved for backward
    # Freed at return: the locals (labels, loss_1d, mask, autocast's cached cast) and, without autocast, `h`, which
    # nothing saved (under autocast the lowered norm already frees its fp32 `h`, which the head never saved).
    released = net(forward) - kept + (0 if autocast else t * h * c)
    return LossMemory(forward=forward, released=released, saved=t * h * hw, backward=[])


def vocab_parallel_loss(x: HeadShape, *, upcast: bool) -> LossMemory:
    """Megatron's `vocab_parallel_cross_entropy` over a rank's (s, b, vocab/tp) logits (`x.vocab` is the rank's
    share). `GPTModel` transposes the labels (`.contiguous()`); the autograd function keeps a max, a target mask,
    a shifted target (`target.clone() - vocab_start_index`), an arange and the predicted logits per token,
    exponentiates and normalises the shifted logits in place and saves them as the softmax, with the mask and
    target; its backward subtracts one at the targets and scales the softmax in place: the gradient is the saved
    tensor itself. `upcast`: megatron-core 0.16 (tensor_parallel/cross_entropy.py `calculate_logits_max`) takes
    `.float()` of 16-bit logits and subtracts the max in place, and autograd casts the fp32 gradient back to the
    logits' dtype; else Megatron-LM's `--fp16-lm-cross-entropy` through core_r0.4.0 (legacy
    megatron/model/gpt_model.py; Mist's runtime, mist/modules/losses.py, likewise): the logits stay 16-bit and the
    max is subtracted out of place (`vocab_parallel_logits - logits_max`), so the softmax is a 16-bit copy."""
    t, v, h, c = x.tokens, x.vocab, x.hidden, x.itemsize
    fresh = 4 * t * v if upcast and c != 4 else (0 if upcast else t * v * c)  # .float() copy or the shifted copy
    softmax = fresh or t * v * c  # fp32 logits already: `.float()` is the same tensor, shifted in place
    row = 4 if upcast else c  # the max, predicted logits, sums and loss are in the softmax's dtype
    labels = LABEL_ITEMSIZE * t if x.b > 1 else 0  # (b, s) -> (s, b) is already contiguous for b = 1
    forward: Events = [("logits", t * v * c), ("softmax copy", fresh), ("labels transposed", labels),
                       ("logits max", row * t), ("target mask", t), ("masked target", LABEL_ITEMSIZE * t),
                       ("arange", LABEL_ITEMSIZE * t), ("predicted", row * t), ("sum exp", row * t),
                       ("arange", -LABEL_ITEMSIZE * t), ("loss", row * t)]
    # Freed when the forward returns: the logits (unless they are the softmax), the labels, max, predicted, sum, loss
    released = (t * v * c if fresh else 0) + labels + 4 * row * t
    cast = t * v * c if upcast and c != 4 else 0  # autograd casts the fp32 gradient to the logits' dtype
    # backward: the arange, float mask, `1 - mask` and indexed rows of the softmax update, then the gradient
    backward: Events = [("softmax update", 20 * t), ("softmax update", -20 * t), ("gradient cast", cast),
                        ("fp32 softmax", -softmax if cast else 0), ("mask and target", -(1 + LABEL_ITEMSIZE) * t)]
    backward += _linear_backward(x, tokens=t, logits_grad=cast or softmax, saved_input=t * h * c)
    return LossMemory(forward=forward, released=released, saved=softmax + (1 + LABEL_ITEMSIZE) * t + t * h * c,
                      backward=backward)


def flash_loss(x: HeadShape) -> LossMemory:
    """flash-attn 2's fused `CrossEntropyLoss` (flash_attn/losses/cross_entropy.py over ops/triton/cross_entropy.py
    `CrossEntropyLossFunction`) as llm-foundry's MPT calls it (`FusedCrossEntropyLoss(ignore_index=-100)`, so
    `inplace_backward=False`) on labels rolled by one (`torch.roll`, the last set to -100): forward writes fp32
    per-token losses, log-sum-exp and z-losses and saves the logits as they are, with the lse and labels; backward
    writes `dlogits = torch.empty_like(logits)`, and the logits go with the function's saved tensors."""
    t, v, h, c = x.tokens, x.vocab, x.hidden, x.itemsize
    forward: Events = [("logits", t * v * c), ("rolled labels", LABEL_ITEMSIZE * t), ("losses", 4 * t),
                       ("lse", 4 * t), ("z-losses", 4 * t)]
    released = 8 * t  # the per-token losses and z-losses, once reduced
    backward: Events = [("dlogits", t * v * c), ("saved logits, lse, labels", -(t * v * c + 12 * t))]
    backward += _linear_backward(x, tokens=t, logits_grad=t * v * c, saved_input=t * h * c)
    return LossMemory(forward=forward, released=released, saved=t * v * c + 12 * t + t * h * c, backward=backward)


def loss_memory(loss: Loss, x: HeadShape, *, chunks: int = TORCHTUNE_CHUNKS) -> LossMemory:
    match loss:
        case Loss.HF:
            return hf_loss(x)
        case Loss.CHUNKED:
            return chunked_loss(x, chunks)
        case Loss.FUSED_LINEAR:
            return fused_linear_loss(x)
        case Loss.MEGATRON_FP16:
            return vocab_parallel_loss(x, upcast=False)
        case Loss.FLASH:
            return flash_loss(x)
    raise ValueError(f"unknown loss {loss!r}")


def loss_nodes(memory: LossMemory, x: HeadShape) -> tuple[NodeMemory, NodeMemory]:
    """The (head, loss) nodes of the activation timeline for one runtime: the whole sequence as the head node,
    and an empty loss node. An untied trainable head hands its weight gradient to the walk's `grads` (which
    keeps it when gradients stay allocated); a tied one keeps it until the embedding's backward."""
    handed = 0 if x.tied else x.weight_grad
    backward_peak = peak(memory.backward)
    head = NodeMemory(decoder=False, saved=memory.saved, fwd_net=net(memory.forward), fwd_peak=peak(memory.forward),
                      released_after_forward=memory.released, bwd_net=net(memory.backward) - handed,
                      bwd_peak=backward_peak, bwd_peak_fresh=backward_peak, grads=handed)
    empty = NodeMemory(decoder=False, saved=0, fwd_net=0, fwd_peak=0, released_after_forward=0, bwd_net=0,
                       bwd_peak=0, bwd_peak_fresh=0, grads=0)
    return head, empty


def refusals(loss: Loss, graph: LayerGraph, config: Config) -> list[str]:
    """Why `loss` cannot be priced (or run) for `config` (empty when it can)."""
    if loss is Loss.HF:
        return []
    if graph.runtime == "torchtitan":  # its lowering traced torchtitan's own loss (plain or ChunkedLossWrapper)
        return [] if loss is Loss.CHUNKED else [f"{loss} loss under torchtitan (it has no fused linear cross-entropy)"]
    reasons = []
    if config.tp > 1:
        reasons.append(f"{loss} loss with tp={config.tp}: the vocabulary-parallel head is not modelled (both run "
                       "on a whole-vocabulary head)")

    if loss is Loss.MEGATRON_FP16 and not rules_of(config.engine).vocab_parallel_loss:
        reasons.append(f"the megatron-fp16 loss under {config.engine} (it is Megatron's and Mist's runtime's)")
    weights = lowering_for(config, lora=graph.lora is not None)[0]  # the lowering `config` runs, not `graph`'s
    if loss is Loss.CHUNKED and _ITEMSIZE[weights] != precision.compute_itemsize(config.precision):
        reasons.append("torchtune's chunked loss runs in one dtype (`dtype: bf16|fp32`), without autocast over "
                       f"fp32 weights ({config.precision} with {config.engine})")
    if loss is Loss.FUSED_LINEAR and not liger_fused_linear(graph.model_type):  # graphs/data/architectures.json
        patched = " (its patch for it refuses fused_linear_cross_entropy)" if liger_patched(graph.model_type) else ""
        reasons.append(f"liger-kernel has no fused linear cross-entropy patch for model type {graph.model_type!r}"
                       f"{patched}")
    return reasons


def head_shape(graph: LayerGraph, config: Config, *, b: int, s: int) -> HeadShape:
    """The head of `graph` as `config` runs it; a tied head's weight is the embedding's (vocab, hidden) tensor."""
    head = next(layer for layer in graph.nodes() if layer.role is Role.HEAD)
    shape = (graph.dims.vocab, graph.dims.hidden)
    weight = next((p for p in head.params if p.shape == shape), None) or \
        next(p for layer in graph.nodes() if layer.role is Role.EMBEDDING for p in layer.params if p.shape == shape)
    return HeadShape(b=b, s=s, hidden=graph.dims.hidden, vocab=graph.dims.vocab,
                     itemsize=precision.compute_itemsize(config.precision), weight_itemsize=weight.itemsize,
                     weight_grad=weight.numel * weight.itemsize if weight.trainable else 0, tied=not head.params)


def loss_terms(graph: LayerGraph, config: Config, terms: MemoryTerms, loss: Loss, *, seq_len: int,
               chunks: int = TORCHTUNE_CHUNKS) -> MemoryTerms:
    """`memory_terms(graph, workload, config)` with the lowered head and loss nodes replaced by `loss`'s."""
    if not any(layer.role is Role.HEAD for layer in graph.nodes()):
        return terms  # a pipeline stage without the head computes no loss
    if graph.runtime == "torchtitan" or (loss is Loss.HF and not megatron_head(graph, config)):
        return terms  # the traced loss: transformers' or torchtitan's own (graphs/titan.py: plain or chunked)
    x = head_shape(graph, config, b=config.micro_batch, s=seq_len)
    if megatron_head(graph, config) or loss is Loss.MEGATRON_FP16:  # megatron's head is vocabulary-parallel
        x = replace(x, vocab=-(-x.vocab // config.tp), weight_grad=-(-x.weight_grad // config.tp))
    memory = vocab_parallel_loss(x, upcast=True) if loss is Loss.HF else loss_memory(loss, x, chunks=chunks)
    return replace_head_nodes(terms, *loss_nodes(memory, x))


def megatron_head(graph: LayerGraph, config: Config) -> bool:
    """Whether Megatron's engine runs a model lowered on the HF code: the Megatron launcher trains megatron-core's
    GPTModel, whose loss is its `vocab_parallel_cross_entropy` (megatron-core 0.16, fp32 in place), not the traced
    `ForCausalLMLoss` (a megatron-core lowering traces megatron's own loss)."""
    return rules_of(config.engine).vocab_parallel_loss and graph.runtime == "hf"


def replace_head_nodes(terms: MemoryTerms, head: NodeMemory, loss: NodeMemory) -> MemoryTerms:
    """`terms` with its "head" and "loss" nodes' memory replaced."""
    replaced = {"head": head, "loss": loss}
    nodes = tuple(((Checkpoint.NONE, replaced[name]),) if name in replaced else options
                  for name, options in zip(terms.names, terms.nodes, strict=True))
    return replace(terms, nodes=nodes)


def timed_layer(graph: LayerGraph, config: Config, layer: Layer, *, s: int) -> Layer:
    """`layer` as `config.loss` computes it, for timing. Liger's fused loss keeps the head's matmul FLOPs (all in
    forward: logits, input and weight gradients per chunk) and replaces the traced cross-entropy's memory-bound
    work by its kernel's passes over the logits; torchtune's chunked loss runs the traced ops on each chunk (the
    same bytes), so it and HF's keep the lowered costs."""
    if config.loss is not Loss.FUSED_LINEAR or layer.role not in (Role.HEAD, Role.LOSS):
        return layer
    cost = layer.cost()
    if layer.role is Role.LOSS:
        return replace(layer, modes=((Checkpoint.NONE, replace(cost, forward=Work(), backward=Work())),))
    tokens = config.micro_batch * s
    dims, itemsize = graph.dims, precision.compute_itemsize(config.precision)
    chunks = -(-tokens // liger_chunk_size(tokens, dims.hidden, dims.vocab))
    fused = Work(flops=cost.forward.flops + cost.backward.flops,
                 io_bytes=Poly.of({(1, 1, 0): LIGER_ROW_PASSES * dims.vocab * itemsize}),
                 kernels=Poly.const(chunks * LIGER_KERNELS_PER_CHUNK))
    return replace(layer, modes=((Checkpoint.NONE, replace(cost, forward=fused, backward=Work())),))
