"""Preference and RL post-training (TRL 1.16's DPO, ORPO, KTO, GRPO trainers) on top of the SFT step: the task,
the reference model's strategy and bytes, and TRL's fused log-prob head with its reference forward.

TRL 1.16 patches the policy (and the reference) with `add_fused_lm_head` (trl/trainer/utils.py): per-token
log-probabilities from `ChunkedLogProbFunction` (trl/kernels/chunked_logprob.py), which never materialises the
(tokens, vocab) logits. The generation engine of GRPO/PPO is `generation.py`; the solver's placement is in
`solver/search/post_training.py`. PPO's critic and reward model are not priced (stated in the plan).
"""

from __future__ import annotations

from dataclasses import replace

from graphs import Checkpoint, LayerGraph, Role

from .activations import node_memory
from .config import Config
from .loss import LABEL_ITEMSIZE, Events, HeadShape, LossMemory, head_shape, loss_nodes, peak, replace_head_nodes
from .tasks import GENERATION_TASKS, PostTraining, Reference
from .terms import MemoryTerms
from .zero import shard_ranks

# trl/kernels/chunked_logprob.py (trl 1.16): `TOKEN_CHUNK_SIZE = 4096` tokens per projection tile; the vocabulary
# width of a tile is the caller's `chunk_size`, `_CHUNKED_LOGPROB_CHUNK_SIZE = 32768` in trl/trainer/utils.py.
TOKEN_CHUNK = 4096
VOCAB_CHUNK = 32768
# `ChunkedLogProbFunction.forward` keeps seven fp32 per-token running statistics (running_max, sum_exp, x_sum_exp,
# sq_sum_exp, z_sum, max_before_target, target_logit), all allocated whatever `outputs` asks for.
RUNNING_STATS = 7
# Full (tokens x vocab-tile) fp32 temporaries of the torch fallback (`_forward_tile` / `_backward_tile`, used where
# Triton does not run, e.g. on CPU), at their peaks: forward z, z - max and exp(); backward y, z, log_p, p, grad,
# is_target.float() and the difference (one more with an entropy gradient, which TRL's defaults never ask for). The
# Triton kernels keep none of these (one program per row, registers only).
FALLBACK_FORWARD_TILES = 3
FALLBACK_BACKWARD_TILES = 7
FP32 = 4


def reference_weight_bytes(graph: LayerGraph, config: Config, post: PostTraining) -> int:
    """Bytes of a frozen reference copy on one GPU: every parameter in the lowering's weight dtype (TRL loads it
    in the policy's dtype), split by TP and, under ZeRO-3/FSDP2 resharding, over the sharding ranks
    (`prepare_deepspeed` / `prepare_fsdp` wrap it like the policy); 0 without a copy."""
    if post.reference is not Reference.COPY:
        return 0
    total = sum(p.numel * p.itemsize * count for p, count in graph.tensor_groups())
    shards = config.tp * (shard_ranks(config) if config.zero == 3 else 1)
    return -(-total // shards)


def scored_tokens(post: PostTraining, *, b: int, s: int) -> int:
    """Rows the fused head projects: on Triton devices only positions with a label (the completion), elsewhere
    every shifted position (`compact = _use_triton(device)` in `add_fused_lm_head`)."""
    if not post.triton:
        return b * (s - 1)
    return b * max(1, min(s - 1, s - post.prompt_len))


def fused_head(x: HeadShape, post: PostTraining, *, entropy: bool, grad: bool) -> LossMemory:
    """TRL's fused log-prob head for one micro-batch, as events (allocations in program order, bytes)."""
    n, h, c = scored_tokens(post, b=x.b, s=x.s), x.hidden, x.itemsize
    gathered = post.triton or x.b > 1  # `hidden_states[mask]` copies; `reshape(-1, H)` of the [:, :-1] slice when b > 1
    outputs = 2 if entropy else 1
    saved = (n * h * c if gathered else 0) + n * LABEL_ITEMSIZE + outputs * n * FP32
    forward = _head_forward(x, post, n=n, copy=n * h * c if gathered else 0, outputs=outputs)
    # the model's forward returns: its last hidden state goes unless the head's rows are a view of it
    released = x.tokens * h * c if gathered else 0
    backward = _head_backward(x, post, n=n, saved=saved) if grad else []
    return LossMemory(forward=forward, released=released, saved=saved, backward=backward)


def _tiles(x: HeadShape, post: PostTraining, n: int) -> tuple[int, int, int]:
    """(fp32 tile bytes, bool tile bytes, weight-slice copy bytes) of the torch fallback; zeros under Triton. CPU's
    mm into the strided tile (vocab narrower than the chunk) copies the transposed weight slice first."""
    if post.triton:
        return 0, 0, 0
    rows, width = min(n, TOKEN_CHUNK), min(x.vocab, VOCAB_CHUNK)
    return rows * width * FP32, rows * width, (0 if width == VOCAB_CHUNK else width * x.hidden * x.itemsize)


def _head_forward(x: HeadShape, post: PostTraining, *, n: int, copy: int, outputs: int) -> Events:
    """`add_fused_lm_head`'s forward: mask, gathered rows and targets, then `ChunkedLogProbFunction.forward`."""
    buffer = min(n, TOKEN_CHUNK) * VOCAB_CHUNK * x.itemsize
    tile, _, weight_copy = _tiles(x, post, n)
    spike = FALLBACK_FORWARD_TILES * tile + weight_copy
    shifted = x.b * (x.s - 1)
    return [("mask", shifted), ("hidden rows", copy), ("targets", n * LABEL_ITEMSIZE),
            ("running statistics", RUNNING_STATS * n * FP32), ("mm_buf", buffer), ("fallback tiles", spike),
            ("fallback tiles", -spike), ("log_z and outputs", (1 + outputs) * n * FP32), ("mm_buf", -buffer),
            ("running statistics", -RUNNING_STATS * n * FP32), ("per-token outputs", outputs * shifted * FP32),
            ("function outputs", -outputs * n * FP32)]


def _head_backward(x: HeadShape, post: PostTraining, *, n: int, saved: int) -> Events:
    """`ChunkedLogProbFunction.backward` (fp32 gradient accumulators, cast back to the inputs' dtypes), then the
    gather's and slice's backward into the last hidden state's gradient."""
    h, c = x.hidden, x.itemsize
    buffer = min(n, TOKEN_CHUNK) * VOCAB_CHUNK * c
    tile, flags, weight_copy = _tiles(x, post, n)
    # GRPO's entropy gets a gradient only with entropy_coef > 0 (default 0)
    spike = FALLBACK_BACKWARD_TILES * tile + flags + weight_copy
    hidden_fp32, weight_fp32 = n * h * FP32, (x.vocab * h * FP32 if x.weight_grad else 0)
    cast_hidden, cast_weight = c != FP32, bool(x.weight_grad) and x.weight_itemsize != FP32
    index = x.b * (x.s - 1) * h * c if post.triton else 0  # `hidden_states[mask]`'s backward: zeros, index_put
    return [("grad_hidden, grad_weight (fp32)", hidden_fp32 + weight_fp32), ("mm_buf", buffer),
            ("fallback tiles", spike), ("fallback tiles", -spike), ("mm_buf", -buffer),
            ("grads to their dtypes", (n * h * c if cast_hidden else 0) + (x.weight_grad if cast_weight else 0)),
            ("fp32 grads cast", -(hidden_fp32 if cast_hidden else 0) - (weight_fp32 if cast_weight else 0)),
            ("saved", -saved), ("index grad", index), ("hidden grad", x.tokens * h * c), ("index grad", -index),
            ("hidden rows grad", -n * h * c)]


def reference_spike(graph: LayerGraph, config: Config, post: PostTraining, x: HeadShape) -> int:
    """Peak bytes of one no-grad reference forward over the micro-batch, above what is live when it starts: the
    largest of a decoder layer run without saving (the layer as full checkpointing runs its forward, plus the
    residual stream) and the final hidden state with the fused head's forward buffers."""
    b, s = x.b, x.s
    layers = [node_memory(layer, Checkpoint.FULL, b=b, s=s, config=config)
              for layer in graph.decoder_layers() if Checkpoint.FULL in layer.checkpoint_modes]
    hidden = x.tokens * x.hidden * x.itemsize
    backbone = max((m.fwd_peak for m in layers), default=0) + hidden
    head = fused_head(x, post, entropy=False, grad=False)
    return max(backbone, hidden + peak(head.forward))


def post_training_terms(graph: LayerGraph, config: Config, terms: MemoryTerms, post: PostTraining, *,
                        seq_len: int) -> MemoryTerms:
    """`memory_terms` for a TRL post-training step: the head is TRL's fused log-prob head, the reference forward
    runs after the policy's (DPO, KTO: its spike sits on the policy's saved activations), and a reference copy
    stays allocated for the whole step."""
    if not any(layer.role is Role.HEAD for layer in graph.nodes()):
        return terms
    x = head_shape(graph, config, b=config.micro_batch, s=seq_len)
    memory = fused_head(x, post, entropy=post.task in GENERATION_TASKS, grad=True)
    if post.reference_pass and post.task not in GENERATION_TASKS:
        spike = reference_spike(graph, config, post, x)
        memory = replace(memory, forward=[*memory.forward, ("reference forward", spike),
                                          ("reference forward", -spike)])
    head, loss = loss_nodes(memory, x)
    terms = replace_head_nodes(terms, head, loss)
    return replace(terms, buffers=terms.buffers + reference_weight_bytes(graph, config, post))

