"""Kernel-level measurements on one GPU, for the time model's components (standalone: torch only).

Run on a machine with a CUDA GPU: `python benchmarks/gpu/kernels.py OUT.json` (about two minutes on an H200);
`--smoke` runs every benchmark at toy sizes on the CPU (what the repository's tests can do).

What it measures, each with CUDA events, after warm-up, as the median of repeated timed loops:
- GEMMs of the shapes a decoder layer runs (forward, input-gradient and weight-gradient products of
  `torch.nn.functional.linear`), bf16, over tokens per micro-batch;
- fp8 GEMMs through `torch._scaled_mm` (tensor-wise and row-wise scales), the kernel torchao's float8 training calls;
- causal attention forward+backward through SDPA, per backend and sequence length, GQA as transformers calls it;
- memory-bound kernels: copy, eager RMSNorm, SiLU*mul, the fp32 cross-entropy over a large vocabulary;
- the host side: seconds per eager ATen op issued back to back (tiny tensors), and per op of a real small decoder
  forward+backward at a tiny shape (what bounds small steps);
- host-device copies (pinned, pageable), and the CUDA context's device memory.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, n, k): the output and reduction widths of the Linear layers of common models (HF config.json values:
# hidden, q+k+v width, FFN, vocabulary) and of tensor-parallel shards of the large ones.
SHAPES = (
    ("llama8b.qkv", 6144, 4096), ("llama8b.o", 4096, 4096), ("llama8b.up", 14336, 4096),
    ("llama8b.down", 4096, 14336), ("llama8b.head", 128256, 4096),
    ("llama1b.qkv", 3072, 2048), ("llama1b.up", 8192, 2048), ("llama1b.down", 2048, 8192),
    ("qwen0.5b.up", 4864, 896), ("qwen0.5b.down", 896, 4864), ("qwen0.5b.head", 151936, 896),
    ("llama70b.tp8.up", 3584, 8192), ("llama70b.tp8.down", 8192, 3584), ("llama70b.tp8.qkv", 1280, 8192),
)
TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


class Bench:
    """Times callables on one device with warm-up and repeated timed loops."""

    def __init__(self, device: str, *, smoke: bool) -> None:
        self.device, self.smoke = device, smoke
        self.cuda = device == "cuda"

    def seconds(self, call: Callable[[], object], *, inner: int = 5, repeats: int = 7, warmup: int = 2) -> dict:
        """Median seconds of one call (each timed loop runs `inner` calls), and the spread of the loops."""
        if self.smoke:
            inner, repeats, warmup = 1, 2, 1
        for _ in range(warmup):
            call()
        self.sync()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / inner)
            else:
                started = time.perf_counter()
                for _ in range(inner):
                    call()
                times.append((time.perf_counter() - started) / inner)
        median = statistics.median(times)
        return {"seconds": median, "spread": (max(times) - min(times)) / median if median else 0.0,
                "repeats": repeats, "inner": inner}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=dtype, requires_grad=grad)


def gemms(bench: Bench) -> list[dict]:
    """bf16 Linear products: forward y = x W^T (m, n, k), input gradient dx = dy W (m, k, n) and weight gradient
    dW = dy^T x (n, k, m), the three GEMMs of one Linear layer in training."""
    tokens = (64, 128) if bench.smoke else TOKENS
    shapes = [(name, max(8, n // 512), max(8, k // 512)) for name, n, k in SHAPES[:3]] if bench.smoke else SHAPES
    rows = []
    for name, n, k in shapes:
        w = bench.randn(n, k)
        for m in tokens:
            x, dy = bench.randn(m, k), bench.randn(m, n)
            calls = {"forward": (lambda x=x, w=w: F.linear(x, w), (m, n, k)),
                     "input_grad": (lambda dy=dy, w=w: dy @ w, (m, k, n)),
                     "weight_grad": (lambda dy=dy, x=x: dy.t() @ x, (n, k, m))}
            for kind, (call, (a, b, c)) in calls.items():
                timing = bench.seconds(call)
                rows.append({"shape": name, "kind": kind, "m": a, "n": b, "k": c, "dtype": "bf16",
                             "flops": 2 * a * b * c, **timing,
                             "tflops": 2 * a * b * c / timing["seconds"] / 1e12})
    return rows


def fp8_gemms(bench: Bench) -> list[dict]:
    """Forward GEMMs in fp8 (e4m3 x e4m3 -> bf16) through torch._scaled_mm, tensor-wise and row-wise scales."""
    if not bench.cuda or torch.cuda.get_device_capability() < (8, 9):
        return []
    rows = []
    for name, n, k in SHAPES:
        for m in (1024, 4096, 16384):
            a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes
            scales = {"tensorwise": (torch.ones((), device="cuda"), torch.ones((), device="cuda")),
                      "rowwise": (torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda"))}
            for kind, (sa, sb) in scales.items():
                def call(a: torch.Tensor = a, b: torch.Tensor = b, sa: torch.Tensor = sa,
                         sb: torch.Tensor = sb) -> torch.Tensor:
                    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                try:
                    timing = bench.seconds(call)
                except RuntimeError as error:  # this torch/GPU lacks the row-wise kernel
                    rows.append({"shape": name, "scaling": kind, "m": m, "n": n, "k": k, "error": str(error)[:200]})
                    continue
                rows.append({"shape": name, "scaling": kind, "m": m, "n": n, "k": k, "dtype": "fp8_e4m3",
                             "flops": 2 * m * n * k, **timing, "tflops": 2 * m * n * k / timing["seconds"] / 1e12})
    return rows


def attention(bench: Bench) -> list[dict]:
    """Causal SDPA forward + backward, bf16, 32 query heads; GQA with 8 key/value heads expanded as transformers'
    sdpa_attention_forward does (repeat_kv) and, separately, through enable_gqa. Tokens per call ~16k."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION} if bench.cuda else {"math": SDPBackend.MATH}
    lengths = (64, 128) if bench.smoke else SEQ_LENS
    heads, kv_heads = (4, 2) if bench.smoke else (32, 8)
    rows = []
    for head_dim in (128,) if bench.smoke else (128, 64):
        for s in lengths:
            batch = max(1, (256 if bench.smoke else 16384) // s)
            q = bench.randn(batch, heads, s, head_dim, grad=True)
            k, v = (bench.randn(batch, kv_heads, s, head_dim, grad=True) for _ in range(2))
            grad = bench.randn(batch, heads, s, head_dim)
            # causal attention's useful FLOPs (the masked half skipped): forward 2 matmuls of b*h*s*s/2*d, x2
            # FLOP per multiply-add; backward 2.5x forward (the kernel papers' convention)
            flops = 3.5 * 4 * batch * heads * s * s * head_dim / 2
            for name, backend in backends.items():
                for gqa in ("repeat_kv", "enable_gqa"):
                    def call(backend: SDPBackend = backend, gqa: str = gqa, q: torch.Tensor = q,
                             k: torch.Tensor = k, v: torch.Tensor = v, grad: torch.Tensor = grad) -> None:
                        kk, vv = (k, v) if gqa == "enable_gqa" else (
                            k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads,
                                                                                               dim=1))
                        with sdpa_kernel(backend):
                            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True,
                                                                 enable_gqa=gqa == "enable_gqa")
                        out.backward(grad)
                    try:
                        call()
                        timing = bench.seconds(call, inner=2, repeats=5)
                    except RuntimeError as error:
                        rows.append({"backend": name, "gqa": gqa, "seq_len": s, "head_dim": head_dim,
                                     "error": str(error)[:200]})
                        continue
                    rows.append({"backend": name, "gqa": gqa, "batch": batch, "heads": heads, "kv_heads": kv_heads,
                                 "seq_len": s, "head_dim": head_dim, "causal_flops": flops, **timing,
                                 "tflops": flops / timing["seconds"] / 1e12})
    return rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm forward, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(dtype)


def memory_bound(bench: Bench) -> list[dict]:
    """Bandwidth-bound kernels: a copy, eager RMSNorm and SiLU*mul forward+backward, and HF's loss (logits upcast to
    fp32, cross-entropy) forward+backward; bytes are those each op reads and writes."""
    rows = []
    scale = 64 if bench.smoke else 1
    for mib in (1, 16, 256, 1024):
        n = mib * 2**20 // 2 // scale
        src, dst = bench.randn(n), bench.randn(n)
        timing = bench.seconds(lambda src=src, dst=dst: dst.copy_(src))
        rows.append({"kernel": "copy", "bytes": 2 * n * 2, **timing, "gbps": 4 * n / timing["seconds"] / 1e9})
    tokens, hidden, ffn = (256, 64, 128) if bench.smoke else (16384, 4096, 14336)
    x, w = bench.randn(tokens, hidden, grad=True), bench.randn(hidden, grad=True)
    dy = bench.randn(tokens, hidden)
    timing = bench.seconds(lambda: rms_norm(x, w).backward(dy))
    rows.append({"kernel": "rms_norm_eager_fwd_bwd", "tokens": tokens, "hidden": hidden, **timing})
    gate, up = bench.randn(tokens, ffn, grad=True), bench.randn(tokens, ffn, grad=True)
    dz = bench.randn(tokens, ffn)
    timing = bench.seconds(lambda: (F.silu(gate) * up).backward(dz))
    rows.append({"kernel": "silu_mul_eager_fwd_bwd", "tokens": tokens, "ffn": ffn, **timing})
    vocab, loss_tokens = (1024, 128) if bench.smoke else (128256, 8192)
    logits = bench.randn(loss_tokens, vocab, grad=True)
    labels = torch.randint(0, vocab, (loss_tokens,), device=bench.device)
    timing = bench.seconds(lambda: F.cross_entropy(logits.float(), labels).backward(), inner=2)
    rows.append({"kernel": "hf_loss_fp32_fwd_bwd", "tokens": loss_tokens, "vocab": vocab, **timing})
    return rows


def host_overhead(bench: Bench) -> list[dict]:
    """Seconds per eager op issued back to back on tiny tensors (the host bound), GPU-only time per op of the same
    chain replayed from a CUDA graph, and per ATen op of a real small decoder's forward+backward at a tiny shape."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rows = []
    ops = 50 if bench.smoke else 2000
    t = torch.zeros(1, device=bench.device)

    def chain() -> None:
        for _ in range(ops):
            t.add_(1.0)
    bench.sync()
    started = time.perf_counter()
    chain()
    bench.sync()
    started = time.perf_counter()
    chain()
    bench.sync()
    rows.append({"kernel": "eager_add_chain", "ops": ops, "seconds_per_op": (time.perf_counter() - started) / ops})
    if bench.cuda:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            chain()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            chain()
        graph.replay()
        timing = bench.seconds(graph.replay, inner=3, repeats=5)
        rows.append({"kernel": "graph_add_chain", "ops": ops, "seconds_per_op": timing["seconds"] / ops})

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    try:
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError:
        return rows
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4 if bench.smoke else 16,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").to(bench.device)
    ids = torch.randint(0, 1024, (1, 64), device=bench.device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
    step()
    counter = Count()
    with counter:
        step()
    timing = bench.seconds(step, inner=3, repeats=5)
    rows.append({"kernel": "tiny_llama_fwd_bwd", "layers": config.num_hidden_layers, "tokens": 64,
                 "aten_ops": counter.ops, **timing, "seconds_per_op": timing["seconds"] / counter.ops})
    return rows


def copies(bench: Bench) -> list[dict]:
    """Host-to-device and device-to-host copies of 256 MiB, pinned and pageable."""
    if not bench.cuda:
        return []
    n = 256 * 2**20 // 4
    dev = torch.empty(n, device="cuda")
    pinned, pageable = torch.empty(n, pin_memory=True), torch.empty(n)
    calls = {"h2d_pinned": lambda: dev.copy_(pinned, non_blocking=True), "h2d_pageable": lambda: dev.copy_(pageable),
             "d2h_pinned": lambda: pinned.copy_(dev, non_blocking=True), "d2h_pageable": lambda: pageable.copy_(dev)}
    rows = []
    for name, call in calls.items():
        timing = bench.seconds(call, inner=2, repeats=5)
        rows.append({"kernel": name, "bytes": 4 * n, **timing, "gbps": 4 * n / timing["seconds"] / 1e9})
    return rows


def context(bench: Bench) -> dict:
    """Device memory outside the caching allocator once CUDA and cuBLAS are initialised."""
    if not bench.cuda:
        return {}
    torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    return {"total_bytes": total, "outside_allocator_bytes": total - free - torch.cuda.memory_reserved()}


def identity() -> dict:
    """What ran: device, driver-facing versions, host CPU."""
    found = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
             "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name")), platform.processor()),
             "cpu_count": torch.get_num_threads()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found.update(gpu=props.name, capability=list(torch.cuda.get_device_capability()),
                     multiprocessors=props.multi_processor_count, memory_bytes=props.total_memory)
    return found


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    out = Path(next(a for a in argv if not a.startswith("--")))
    bench = Bench("cpu" if smoke else "cuda", smoke=smoke)
    result: dict = {"identity": identity(), "context": context(bench)}
    for name, run in (("gemm_bf16", gemms), ("gemm_fp8", fp8_gemms), ("attention", attention),
                      ("memory_bound", memory_bound), ("host_overhead", host_overhead), ("copies", copies)):
        started = time.perf_counter()
        try:
            result[name] = run(bench)
        except Exception as error:  # keep what the other benchmarks measured
            result[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        out.write_text(json.dumps(result, indent=1))
        if bench.cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
