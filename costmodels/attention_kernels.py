"""Fused attention kernels' speed by GPU, sequence length and head dim, from the kernel papers' benchmark tables
(`data/attention_kernels.json`), instead of one efficiency constant for every GPU and length."""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass
from importlib import resources

from .hardware import GPU

# PyTorch's scaled_dot_product_attention runs FlashAttention-2 on NVIDIA GPUs from Ampere on (its flash backend
# vendors FlashAttention-2 and needs sm80+: torch.nn.attention.SDPBackend.FLASH_ATTENTION); before Ampere it falls
# back to the memory-efficient backend (xformers' CUTLASS kernel). HF transformers ("sdpa") and torchtitan call
# SDPA, so that is the kernel every plan assumes.
DEFAULT_KERNEL = "flash-attention-2"
PRE_AMPERE_KERNEL = "memory-efficient"
PRE_AMPERE = {"volta", "turing"}
# Architectures without a measured table use the fraction of peak of the nearest measured one (an assumption,
# named in the plan's notes): Ada and the other Ampere parts run the same kernels as the A100, Blackwell runs
# the Hopper-generation code paths, the rest (Volta, Turing, AMD's ROCm builds) are priced like the A100.
NEAREST_ARCH = {"ampere": "ampere", "ada": "ampere", "hopper": "hopper", "blackwell": "hopper"}
FALLBACK_ARCH = "ampere"
# Transformer Engine's DotProductAttention gives cuDNN's fused attention preference over flash-attn "on Hopper+ for
# performance reasons" when both can run (TransformerEngine d0067d0, pytorch/attention/dot_product_attention/
# utils.py `get_attention_backend`); before Hopper it runs flash-attn, the default kernel.
TE_KERNEL = "cudnn-fused-attention"
TE_FUSED_ARCHS = {"hopper", "blackwell"}


@dataclass(frozen=True, slots=True)
class Curve:
    """One benchmark panel: TFLOP/s of one kernel on one GPU at one head dim, by sequence length."""

    kernel: str
    arch: str
    measured_on: str
    peak_tflops: float
    causal: bool
    head_dim: int
    seq_len: tuple[int, ...]
    tflops: tuple[float, ...]
    source: str

    def tflops_at(self, seq_len: int) -> float:
        """Linear in log2(seq_len) between the table's points, held flat beyond its ends."""
        xs = [math.log2(s) for s in self.seq_len]
        x = math.log2(max(1, seq_len))
        if x <= xs[0]:
            return self.tflops[0]
        if x >= xs[-1]:
            return self.tflops[-1]
        i = bisect.bisect_right(xs, x)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return self.tflops[i - 1] + w * (self.tflops[i] - self.tflops[i - 1])


@functools.cache
def curves() -> tuple[Curve, ...]:
    text = resources.files("costmodels").joinpath("data/attention_kernels.json").read_text(encoding="utf-8")
    return tuple(Curve(**{**row, "seq_len": tuple(row["seq_len"]), "tflops": tuple(row["tflops"])})
                 for row in json.loads(text)["kernels"])


def kernel_for(gpu: GPU, *, transformer_engine: bool = False) -> str:
    """The attention kernel torch's SDPA (or, with `transformer_engine`, TE's DotProductAttention) picks on `gpu`
    for 16-bit training."""
    if transformer_engine and gpu.arch in TE_FUSED_ARCHS:
        return TE_KERNEL
    return PRE_AMPERE_KERNEL if gpu.arch in PRE_AMPERE else DEFAULT_KERNEL


def table_arch(gpu: GPU) -> str:
    """The architecture whose measured tables price attention on `gpu`."""
    return NEAREST_ARCH.get(gpu.arch, FALLBACK_ARCH)


def fraction_of_peak(gpu: GPU, *, seq_len: int, head_dim: int, causal: bool = True,
                     kernel: str | None = None) -> float:
    """Forward + backward speed of `kernel` (by default the one SDPA picks on `gpu`) as a fraction of the dense
    16-bit peak of the GPU it was measured on, at `seq_len` and `head_dim` (linear between the measured head dims,
    held at the nearest beyond them)."""
    arch, kernel = table_arch(gpu), kernel or kernel_for(gpu)
    panels = sorted((c for c in curves() if c.kernel == kernel and c.arch == arch and c.causal == causal),
                    key=lambda c: c.head_dim)
    if not panels:
        raise ValueError(f"no {kernel} table for {arch} GPUs (causal={causal})")
    points = [(c.head_dim, c.tflops_at(seq_len) / c.peak_tflops) for c in panels]
    if head_dim <= points[0][0]:
        return points[0][1]
    if head_dim >= points[-1][0]:
        return points[-1][1]
    i = bisect.bisect_right([d for d, _ in points], head_dim)
    (d0, f0), (d1, f1) = points[i - 1], points[i]
    return f0 + (head_dim - d0) / (d1 - d0) * (f1 - f0)


def kernel_note(gpu: GPU, *, transformer_engine: bool = False) -> str:
    """What the plan assumes about attention, for its notes."""
    arch, kernel = table_arch(gpu), kernel_for(gpu, transformer_engine=transformer_engine)
    measured = next(c for c in curves() if c.kernel == kernel and c.arch == arch)
    borrowed = "" if arch == gpu.arch else f" ({gpu.arch} priced at the {arch} fraction of peak, an assumption)"
    runner = "Transformer Engine's DotProductAttention" if transformer_engine else "torch SDPA"
    backend = {DEFAULT_KERNEL: "flash", PRE_AMPERE_KERNEL: "memory-efficient", TE_KERNEL: "cuDNN fused"}[kernel]
    return (f"attention kernel: {kernel} ({runner}, {backend} backend), causal forward+backward speed by sequence "
            f"length and head dim as measured on {measured.measured_on}{borrowed}; "
            f"{measured.source.split(' Fig')[0].split(' (this project')[0]}")
