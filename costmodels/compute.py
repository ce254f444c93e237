"""Kernel time from FLOPs and bytes: a roofline with an efficiency that depends on the operation's size."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from graphs import Work

from .activations import evaluate
from .alignment import alignment_factor
from .attention_kernels import fraction_of_peak
from .hardware import GPU
from .profile import Profile

# Achievable dense bf16 matmul throughput as a fraction of peak ("MAMF", stas00/ml-engineering
# compute/accelerator README, "Maximum Achievable Matmul FLOPS comparison table", commit 744d01e): A100 SXM
# 271.2/312, A100 PCIe 252.9/312, H100 SXM 794.5/989 (H200 "the same"), GH200 828.6/989 (measured on the 900 W
# 141 GiB HBM3e module; the catalog's 96 GB GH200 has the same GH100 die and clocks), B200 1745/2250, MI300X
# 668.4/1300. The table has no L4, A10G, L40S, T4, V100, RTX A6000/3090/4090, H100 PCIe/NVL or MI250X.
MAMF = {"a100-sxm-40gb": 0.869, "a100-sxm-80gb": 0.869, "a100-pcie-40gb": 0.811, "a100-pcie-80gb": 0.811,
        "h100-sxm-80gb": 0.803, "h200-sxm-141gb": 0.803, "gh200-96gb": 0.838, "b200-180gb": 0.776,
        "mi300x-192gb": 0.514}
# GPUs the table does not measure: the lowest NVIDIA efficiency it lists (GB200 SXM, 1822/2500 = 0.729). Those
# GPUs are mostly power-capped PCIe and workstation cards (L4 72 W, T4 70 W, A10G 150 W), which sustain their
# boost clock no better than the measured SXM parts, so the table's floor rather than its median (0.803).
DEFAULT_MAMF = 0.729

# Matmuls reach MAMF only when large: efficiency = MAMF * m / (m + GEMM_HALF_TOKENS) over the tokens per
# micro-batch on one rank, and * k / (k + GEMM_HALF_WIDTH) over the layer width each rank multiplies.
# These two, MEMORY_EFFICIENCY and ATTENTION_SUSTAINED are the four constants fitted together, globally (never
# per row), by benchmarks/calibrate.py on benchmarks/data/calibration/throughput_published.json (torchtitan,
# MosaicML, Mist/Megatron rows): median |error| of tokens/s fell from 23% (first-principles values 256, 512, 0.8,
# 0.6) to 11.5%, to 8.0% once collectives across nodes, the exposed edges of overlap and each GEMM's own
# reduction width (`reduction_width`) were modelled, and to 6.1% once attention followed the kernel papers'
# curves (refit 256 -> 512 tokens, 512 -> 256 width). Held-out (leave-one-source-out) figures:
# benchmarks/fidelity.py and the README. Since 2026-12-06 (Mist's GELU, MPT on GPT-2's layers) the grid's best over
# all 67 rows has a width of 512; 256 is kept because kernel-level data prefers it: the law's median error against
# the project's 294 H200 bf16 GEMMs is 11.7% at 256, 16.6% at 512 (tests/costmodels/test_gemm_bf16.py).
GEMM_HALF_TOKENS = 512
GEMM_HALF_WIDTH = 256

# fp8 GEMMs (torch._scaled_mm and Transformer Engine's cuBLASLt fp8 GEMM, per-tensor scales) reach less of their
# doubled peak than bf16 ones at the same shape, the more so the smaller the shape: on one H200 (this project's
# benchmarks/data/gpu/h200_kernels.json, `gemm_fp8` tensorwise against `gemm_bf16` forward, 42 shapes of 1k-16k rows)
# fp8 / bf16 TFLOP/s = 2.0 x m / (m + 256) x k / (k + 256) over m rows and a reduction of k (median |error| 7%,
# max 37%; fitted by a grid over half points in powers of two), 2.0 being the datasheets' fp8 / bf16 peak ratio.
FP8_HALF_TOKENS = 256
FP8_HALF_WIDTH = 256

# torch's FLOP counter charges full s^2 attention (backward 2.5x forward, the kernel papers' convention too); a
# causal kernel skips the masked half, and the papers' TFLOP/s count only that half (Dao 2023, §4.1). Attention
# kernels run at the speed their benchmark tables give for the GPU, sequence length and head dim
# (`attention_kernels`, data/attention_kernels.json).
CAUSAL_FRACTION = 0.5
# The kernel tables time isolated kernels in short bursts; inside a training step attention sustains a fraction of
# that (clocks under sustained power, the vendored kernel version inside torch, layouts and GQA): the curves give
# the shape over GPU, length and head dim, and this one level is fitted with the constants above by
# benchmarks/calibrate.py.
ATTENTION_SUSTAINED = 0.5

# Host cost of issuing one kernel: a dependent chain of short (2.9 us) kernels launched back to back from one
# host thread runs at 3.8 us per kernel (NVIDIA Technical Blog, A. Gray, "Getting Started with CUDA Graphs",
# 2019); eager PyTorch issues one kernel per ATen op (the lowering counts them, `graphs.recorder.launches_kernel`)
# and adds its dispatcher on top, so this is a lower bound. Launches are asynchronous: a phase whose kernels run
# longer than they take to issue hides them, a phase of small kernels waits on the host.
KERNEL_LAUNCH_SECONDS = 3.8e-6
# Eager PyTorch pays far more per op than the launch: Python module code, the dispatcher, autograd's engine and the
# ops that launch nothing (views). On one H200 host (this project's benchmarks/data/gpu/h200_kernels.json,
# `host_overhead` tiny_llama_fwd_bwd: a 16-layer, 256-wide HF Llama, forward + backward of 64 tokens, device idle)
# a step took 68.11 ms; the lowering counts 1793 kernels for that model and shape (the same way it counts every
# plan's: tests/costmodels/test_kernels_time.py recounts them), 38.0 us of host time per counted kernel. A
# torch.compile'd layer keeps the launch floor above (its wrapper issues the kernels without the eager layers).
EAGER_HOST_SECONDS_PER_KERNEL = 68.109e-3 / 1793

# Memory-bound kernels (norms, activations, rotary, softmax of the loss) as eager PyTorch runs them, each op
# reading and writing its tensors: calibrated with the constants above to 0.6 of HBM bandwidth.
MEMORY_EFFICIENCY = 0.6


@dataclass(frozen=True, slots=True)
class KernelSpeed:
    """What one rank's kernels run at for a given precision and shape."""

    matmul_flops: float
    """Effective matmul FLOP/s."""
    attention_flops: float
    """Effective attention-kernel FLOP/s (already counting the causal half)."""
    memory_bandwidth: float
    """Effective bytes/s of memory-bound kernels."""
    host_per_kernel: float = KERNEL_LAUNCH_SECONDS
    """Host seconds to issue one counted kernel (eager: `EAGER_HOST_SECONDS_PER_KERNEL`)."""


def kernel_speed(gpu: GPU, *, matmul_dtype: str, attention_dtype: str, tokens: int, width: float, seq_len: int,
                 head_dim: int, alignment: float = 1.0, profile: Profile | None = None,
                 attention_kernel: str | None = None) -> KernelSpeed:
    """Rates for matmuls over `tokens` rows and a per-rank width of `width` (with a shape-alignment factor), and
    for causal attention over sequences of `seq_len` with heads of `head_dim` (in `attention_kernel`, by default the
    one torch's SDPA picks on `gpu`).

    A `profile` replaces each datasheet rate it measured: the matmul ceiling (peak x MAMF), the attention
    kernels' rate and the memory-bound kernels' bandwidth.
    """
    peak = gpu.peak_flops(matmul_dtype)
    attention_peak = gpu.peak_flops(attention_dtype)
    if peak is None or attention_peak is None:
        raise ValueError(f"{gpu.name} has no {matmul_dtype} tensor cores")
    ceiling = peak * MAMF.get(gpu.id, DEFAULT_MAMF)
    attention = attention_peak * fraction_of_peak(gpu, seq_len=seq_len, head_dim=head_dim, kernel=attention_kernel) \
        * ATTENTION_SUSTAINED / CAUSAL_FRACTION
    memory = gpu.hbm_bandwidth * MEMORY_EFFICIENCY
    if profile is not None:
        ceiling = measured_matmul_ceiling(gpu, profile, matmul_dtype) or ceiling
        attention = profile.attention_rate(attention_dtype) or attention
        memory = profile.rate("device_copy") or memory
    return KernelSpeed(matmul_flops=ceiling * _size_factor(tokens, width, matmul_dtype) * alignment,
                       attention_flops=attention, memory_bandwidth=memory)


def reduction_width(gemms: list[tuple[int, int, int]]) -> float:
    """The one reduction width whose size factor equals that of `gemms` run one after another: each (weight,
    n, k) is a matmul whose FLOPs are proportional to `weight` x n x k over a reduction of k, and the layer's
    time sums flops / efficiency, so the effective factor is the FLOP-weighted harmonic mean of k / (k + H)."""
    work = [weight * n * k for weight, n, k in gemms]
    if not gemms or not sum(work):
        return 1.0
    slow = sum(w * (k + GEMM_HALF_WIDTH) / k for w, (_, _, k) in zip(work, gemms, strict=True))
    factor = sum(work) / slow
    return GEMM_HALF_WIDTH * factor / (1 - factor)


def _size_factor(tokens: int, width: float, dtype: str = "bf16") -> float:
    """The fraction of the ceiling a matmul of `tokens` rows and `width` reduction width reaches in `dtype`."""
    factor = tokens / (tokens + GEMM_HALF_TOKENS) * width / (width + GEMM_HALF_WIDTH)
    if dtype == "fp8":
        factor *= tokens / (tokens + FP8_HALF_TOKENS) * width / (width + FP8_HALF_WIDTH)
    return factor


def measured_matmul_ceiling(gpu: GPU, profile: Profile, dtype: str) -> float | None:
    """FLOP/s the profile's matmuls in `dtype` imply for a large aligned GEMM (median over the shapes measured):
    each measurement divided by the size and alignment factors the model applies at its shape."""
    implied = [p.flops_per_s / (_size_factor(p.m, p.k, dtype) * alignment_factor(gpu, dtype, (p.m, p.n, p.k)))
               for p in profile.gemm if p.dtype == dtype]
    return statistics.median(implied) if implied else None


def work_seconds(work: Work, speed: KernelSpeed, *, b: int, s: int, tp: int, sequence_parallel: bool = False,
                 memory_speedup: float = 1.0) -> float:
    """Seconds for one node's phase: its kernels' device time, or the time the host takes to issue them when
    that is longer (`KernelSpeed.host_per_kernel`)."""
    device = device_seconds(work, speed, b=b, s=s, tp=tp, sequence_parallel=sequence_parallel,
                            memory_speedup=memory_speedup)
    return max(device, launch_seconds(work, speed))


def device_seconds(work: Work, speed: KernelSpeed, *, b: int, s: int, tp: int, sequence_parallel: bool = False,
                   memory_speedup: float = 1.0) -> float:
    """Device time of one node's phase: matmuls, attention kernels and memory-bound ops, run one after another."""
    flops = evaluate(work.flops, b=b, s=s, tp=tp, sequence_parallel=False)
    attention = evaluate(work.attention_flops, b=b, s=s, tp=tp, sequence_parallel=False)
    io = evaluate(work.io_bytes, b=b, s=s, tp=tp, sequence_parallel=sequence_parallel)
    return ((flops - attention) / speed.matmul_flops + attention / speed.attention_flops
            + io / (speed.memory_bandwidth * memory_speedup))


def launch_seconds(work: Work, speed: KernelSpeed) -> float:
    """Host time to issue a phase's kernels at the speed's host cost per counted kernel."""
    return work.kernels(1, 1) * speed.host_per_kernel
