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
