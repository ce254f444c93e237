"""Tensor-core-friendly shapes: GEMM dimensions that are multiples of the tensor-core tile run fastest.

The Hugging Face efficient-training guide: "batch size and layer dimensions best at multiples of 8 for fp16,
and higher on some hardware (64 on A100)"; NVIDIA's Matrix Multiplication Background guide: dimensions that are
multiples of 16 bytes (8 fp16 elements) let cuBLAS use tensor cores fully, and larger multiples avoid partly
filled tiles (wave and tile quantisation).
"""

from __future__ import annotations

from .hardware import GPU

# Elements per 16 bytes: the multiple every tensor-core GEMM dimension should have (NVIDIA guide).
_MIN_MULTIPLE = {"fp32": 1, "tf32": 4, "fp16": 8, "bf16": 8, "fp8": 16}
# Larger multiples that fill whole tiles; the HF guide quotes 64 for A100 (and Hopper/Blackwell alike).
_PREFERRED = {"ampere": 64, "hopper": 64, "blackwell": 64, "ada": 32, "cdna3": 64}

# Relative GEMM throughput when a dimension misses the 16-byte multiple: cuBLAS before 11.0 then runs no tensor
# cores at all, later versions run tensor-core kernels with 1-element loads (NVIDIA guide, "Tensor Core
# Requirements"). Measured on square bf16 matmuls on an RTX 4090 (github.com/pytorch/pytorch/issues/181718): odd
# N = 2055, 2057, 2071, 2073 run cuBLAS' `..._align1` kernels at 115.6, 106.8, 110.9, 112.0 TFLOP/s against
# 155.9 for N = 2040 (`..._ldg8`, 8-element aligned; its tile share 2040/2048 is within 0.4% of whole tiles):
# the mean, 111.3 / 155.9 = 0.714. One GPU and one shape family: no calibration row has such a dimension.
MISALIGNED = (115.6 + 106.8 + 110.9 + 112.0) / 4 / 155.9


def preferred_multiple(gpu: GPU, dtype: str) -> int:
    """The multiple GEMM dimensions should have on `gpu` in `dtype` (1 for fp32: CUDA cores)."""
    minimum = _MIN_MULTIPLE.get(dtype, 1)
    if minimum == 1:
        return 1
    return max(minimum, _PREFERRED.get(gpu.arch, minimum))


def alignment_factor(gpu: GPU, dtype: str, dims: tuple[int, ...]) -> float:
    """Throughput factor of GEMMs whose dimensions are `dims` (the worst dimension sets it)."""
    minimum = _MIN_MULTIPLE.get(dtype, 1)
    preferred = preferred_multiple(gpu, dtype)
    factor = 1.0
    for dim in dims:
        if dim % minimum:
            factor = min(factor, MISALIGNED)
        elif dim % preferred:
            factor = min(factor, tile_fraction(dim, preferred))
    return factor


def tile_fraction(dim: int, tile: int) -> float:
    """Useful share of the work when `dim` is cut into whole tiles of `tile`: the last tile is partly idle but
    costs a full tile (tile quantisation, NVIDIA Matrix Multiplication Background guide, section 3.1)."""
    return dim / padded(dim, tile)


def padded(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple (e.g. a vocabulary of 50257 padded to 50304 for multiples of 64)."""
    return -(-size // multiple) * multiple
