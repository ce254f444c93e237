"""fp8 training's casts: what an fp8 matmul costs besides the matmul.

With dynamic tensorwise scaling (torchao `convert_to_float8_training`, Transformer Engine's current scaling),
every operand of every fp8 GEMM is scaled and cast from bf16 before it is used: an amax reduction reads the
tensor, the scaled cast reads it again and writes one byte per element. Forward casts the input (M x K) and
the weight (N x K); backward casts the output gradient (M x N) for both of its GEMMs and needs the weight and
the input again in the transposed layout the other operand order requires, re-cast from bf16. These passes are
memory-bound, and they are why published fp8 training gains stay well below the 2x of the datasheet peaks.
"""

from __future__ import annotations

from .terms import Gemm

# Transformer Engine's delayed scaling (megatron-core's fp8 path, --fp8-recipe delayed; TransformerEngine
# d0067d0, transformer_engine/pytorch/module/linear.py and layernorm_linear.py) computes each amax inside the cast
# kernel (no separate pass) and makes the row-wise and the column-wise (transposed) fp8 copies in one kernel:
# read bf16 (2 B), write both (1 + 1 B). A norm-fed input is written in fp8 by the norm kernel itself (rmsnorm_fwd's
# FULLY_FUSED path: 1 B instead of the 2 B the lowering prices), then transposed (read 1, write 1 B:
# normalization/rmsnorm/rmsnorm_api.cpp `nvte_transpose`): 1 B more per element in all.
TE_CAST_TRANSPOSE_BYTES_PER_ELEMENT = 4
TE_NORM_FED_BYTES_PER_ELEMENT = 1

# Bytes moved per element of a dynamically scaled cast: amax (read bf16, 2 B) + scale and cast (read bf16 2 B,
# write fp8 1 B).
CAST_BYTES_PER_ELEMENT = 5


def cast_elements(gemms: list[Gemm], tokens: int) -> tuple[int, int]:
    """(forward, backward) elements cast per micro-batch over `tokens` rows: forward the input and the weight of
    each matmul; backward the output gradient, and the weight and the input again, transposed."""
    forward = backward = 0
    for g in gemms:
        rows, weights = g.routed * tokens, g.copies * g.n * g.k
        forward += rows * g.k + weights
        backward += rows * g.n + weights + rows * g.k
    return forward, backward


def cast_bytes(gemms: list[Gemm], tokens: int) -> tuple[int, int]:
    """(forward, backward) bytes the casts move per micro-batch."""
    forward, backward = cast_elements(gemms, tokens)
    return forward * CAST_BYTES_PER_ELEMENT, backward * CAST_BYTES_PER_ELEMENT


def te_cast_bytes(gemms: list[Gemm] | tuple[Gemm, ...], tokens: int, *, micro_batches: int) -> tuple[float, float]:
    """(forward, backward) bytes Transformer Engine's casts move per micro-batch over `tokens` rows. Forward casts
    each input (row-wise and transposed: the weight gradient reuses the transposed copy, no recast in backward)
    and the weights, but those only on a step's first micro-batch (megatron-core passes `is_first_microbatch`, and
    TE caches the fp8 weight with its transpose: linear.py `quantize_weight(update_workspace=...)`), so a micro-batch
    carries 1 / `micro_batches` of them; backward casts each output gradient once, row-wise and transposed, for
    both of its GEMMs."""
    forward = backward = 0.0
    for g in gemms:
        rows = g.routed * tokens
        per_input = TE_NORM_FED_BYTES_PER_ELEMENT if g.norm_fed else TE_CAST_TRANSPOSE_BYTES_PER_ELEMENT
        forward += rows * g.k * per_input + g.copies * g.n * g.k * TE_CAST_TRANSPOSE_BYTES_PER_ELEMENT / micro_batches
        backward += rows * g.n * TE_CAST_TRANSPOSE_BYTES_PER_ELEMENT
    return forward, backward
