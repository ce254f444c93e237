"""Quantized frozen base weights (QLoRA, LLM.int8): device bytes of bitsandbytes' packed weights and their
quantisation state, the transient dequantized weight, and the time to dequantize for each matmul.

Layouts are bitsandbytes 0.50's (`functional.quantize_4bit`, `QuantState`, `Int8Params`); the tests check them
against the library's own tensors. The lowering (`graphs.quantization`) measures the same bytes on fake tensors
and traces the dequantization, so `estimate` already holds these costs; these functions are the formulas.
"""

from __future__ import annotations

import math

from graphs.adapters import Quantization

FP32 = 4
# Params4bit's default block: one fp32 absmax per 64 weights (bitsandbytes nn/modules.py; transformers'
# BitsAndBytesConfig has no block-size field, so every QLoRA run uses it).
BLOCKSIZE_4BIT = 64
# Double quantisation (QLoRA paper §3, "Double Quantization"): the fp32 absmax values, less their mean (one
# fp32 offset), are quantized to 8 bits in blocks of 256, each with an fp32 absmax (functional.quantize_4bit:
# `quantize_blockwise(_absmax - offset, blocksize=256)`).
NESTED_BLOCKSIZE = 256
# Code tables each QuantState holds: the 16 fp32 values of the 4-bit type (`get_4bit_type`), and with double
# quantisation a copy of the 256-entry fp32 dynamic 8-bit map (`quantize_blockwise`: `code.to(device, copy=True)`).
CODE_4BIT_ENTRIES = 16
DYNAMIC_MAP_ENTRIES = 256


def packed_weight_bytes(shape: tuple[int, ...], quantization: Quantization) -> int:
    """The packed weight: two 4-bit values per byte (`(n + 1) // 2` uint8), or one int8 per weight."""
    numel = math.prod(shape)
    return numel if quantization is Quantization.INT8 else -(-numel // 2)


def quant_state_bytes(shape: tuple[int, ...], quantization: Quantization, *, double_quant: bool) -> int:
    """Bytes of the state that dequantizes one weight of `shape` (out_features, in_features).

    4-bit: absmax per block (fp32, or 8-bit plus one fp32 per 256 blocks, an fp32 offset and the 8-bit code
    table when double-quantized) and the 4-bit code table. int8 (`Int8Params.SCB`): one fp32 scale per row.
    """
    if quantization is Quantization.INT8:
        return shape[0] * FP32
    blocks = -(-math.prod(shape) // BLOCKSIZE_4BIT)
    code = CODE_4BIT_ENTRIES * FP32
    if not double_quant:
        return blocks * FP32 + code
    nested = -(-blocks // NESTED_BLOCKSIZE)
    return blocks + nested * FP32 + FP32 + DYNAMIC_MAP_ENTRIES * FP32 + code


def quantized_weight_bytes(shape: tuple[int, ...], quantization: Quantization, *, double_quant: bool) -> int:
    """Device bytes of one quantized weight: packed data plus quantisation state."""
    return packed_weight_bytes(shape, quantization) + quant_state_bytes(shape, quantization,
                                                                        double_quant=double_quant)


def bits_per_param(shape: tuple[int, ...], quantization: Quantization, *, double_quant: bool) -> float:
    """Effective storage bits per weight (QLoRA paper: 4.5 for NF4 with fp32 absmax per 64, ~4.127 with double
    quantisation)."""
    return 8 * quantized_weight_bytes(shape, quantization, double_quant=double_quant) / math.prod(shape)


def dequantized_weight_bytes(shape: tuple[int, ...], compute_itemsize: int) -> int:
    """The transient a quantized matmul allocates: the whole weight in the compute dtype (bitsandbytes CUDA
    `_dequant_linear_fallback` in forward above 1536 tokens, `MatMul4Bit.backward` always; LLM.int8's backward
    `CB.to(dtype_A)`). One layer's weight is alive at a time."""
    return math.prod(shape) * compute_itemsize


def dequantize_bytes_moved(shape: tuple[int, ...], quantization: Quantization, *, double_quant: bool,
                           compute_itemsize: int) -> int:
    """Memory traffic of dequantizing one 4-bit weight, as the kernels read and write it: the nested absmax is
    first expanded to fp32 (read 8-bit absmax, fp32 scales and code table; write fp32) and offset (read, write),
    then the packed weight and fp32 absmax are read and the compute-dtype weight written."""
    if quantization is Quantization.INT8:
        raise ValueError("dequantize_bytes_moved prices 4-bit weights; LLM.int8 multiplies int8 directly")
    blocks = -(-math.prod(shape) // BLOCKSIZE_4BIT)
    moved = packed_weight_bytes(shape, quantization) + blocks * FP32 + dequantized_weight_bytes(shape,
                                                                                                compute_itemsize)
    if double_quant:
        nested = -(-blocks // NESTED_BLOCKSIZE)
        expand = blocks + nested * FP32 + DYNAMIC_MAP_ENTRIES * FP32 + blocks * FP32
        offset = blocks * FP32 + FP32 + blocks * FP32
        moved += expand + offset
    return moved


def dequantize_seconds(shape: tuple[int, ...], quantization: Quantization, *, double_quant: bool,
                       compute_itemsize: int, memory_bandwidth: float) -> float:
    """Time of one dequantization (memory-bound: bytes moved over the achievable bandwidth in bytes/s, e.g.
    `compute.Speed.memory_bandwidth`). A QLoRA linear dequantizes once in forward, once in backward and once
    more in a recomputed forward."""
    return dequantize_bytes_moved(shape, quantization, double_quant=double_quant,
                                  compute_itemsize=compute_itemsize) / memory_bandwidth
