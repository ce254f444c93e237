"""`fitplan measure`: microbenchmarks on the local node (GEMMs at the catalog's shapes, attention, copies, CPU
Adam, collectives, CUDA context) with warm-up, repeats, median and spread, gathered into a `Profile`.

Every kernel runs on `device` ("cuda" or "cpu"); the CPU run exercises the same code paths at smaller sizes.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from costmodels.profile import (
    AttentionPoint,
    GemmPoint,
    Profile,
    RatePoint,
    Timing,
    fit_link,
)
from graphs import FitplanError
from solver.hardware.limits import MAX_CPU_RANKS
from solver.plan.staging import refuse_overwrite, text_writer, write_together

MIB = 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    """What one run measures: sizes, dtypes and repeats for a device, full or --quick."""

    device: str
    tokens: tuple[int, ...]
    """GEMM rows (tokens per micro-batch)."""
    widths: int
    """How many (hidden, FFN) pairs of the catalog, smallest first on CPU, most common first on GPUs."""
    dtypes: tuple[str, ...]
    seq_lens: tuple[int, ...]
    copy_bytes: int
    adam_params: int
    collective_bytes: tuple[int, ...]
    warmup: int
    repeats: int


def sizes_for(device: str, *, quick: bool) -> Sizes:
    """The sizes for `device`: GPU sizes fill the device, CPU sizes keep `--quick` under a minute on 2 cores."""
    if device == "cuda":
        return Sizes(device=device, tokens=(4096,) if quick else (2048, 8192), widths=2 if quick else 4,
                    dtypes=("bf16", "fp16", "fp8"), seq_lens=(2048,) if quick else (1024, 4096, 8192),
                    copy_bytes=256 * MIB, adam_params=2**22 if quick else 2**24,
                    collective_bytes=(MIB, 64 * MIB) if quick else (MIB, 16 * MIB, 256 * MIB),
                    warmup=2 if quick else 5, repeats=5 if quick else 20)
    return Sizes(device=device, tokens=(128,) if quick else (128, 512), widths=1 if quick else 2,
                dtypes=("fp32", "bf16"), seq_lens=(128,) if quick else (128, 512), copy_bytes=8 * MIB,
                adam_params=2**18 if quick else 2**20,
                collective_bytes=(64 * 1024, 2 * MIB) if quick else (64 * 1024, MIB, 8 * MIB),
                warmup=1 if quick else 2, repeats=3 if quick else 7)


def timed(call: Callable[[], object], *, warmup: int, repeats: int, sync: Callable[[], None]) -> Timing:
    """Median and spread of `repeats` timed calls after `warmup` untimed ones (`sync` waits for the device)."""
    for _ in range(warmup):
        call()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return Timing(median=median, spread=(max(times) - min(times)) / median if median else 0.0, repeats=repeats)


def gemm_shapes(sizes: Sizes) -> list[tuple[int, int, int]]:
    """(m, n, k) per micro-batch size and catalog (hidden, FFN) pair: the up-projection, n=FFN and k=hidden."""
    from graphs import catalog_ids, load_entry

    pairs: dict[tuple[int, int], int] = {}
    for model_id in catalog_ids():
        config = load_entry(model_id).config
        hidden, ffn = config.get("hidden_size"), config.get("intermediate_size")
        if isinstance(hidden, int) and isinstance(ffn, int):
            pairs[hidden, ffn] = pairs.get((hidden, ffn), 0) + 1
    order = sorted(pairs, key=lambda p: p[0] * p[1]) if sizes.device == "cpu" else \
        sorted(pairs, key=lambda p: (-pairs[p], p))
    return [(m, ffn, hidden) for m in sizes.tokens for hidden, ffn in order[:sizes.widths]]


def measure_gemms(sizes: Sizes, sync: Callable[[], None]) -> list[GemmPoint]:
    """Matmul time at each shape in every dtype the device runs (fp8 through torch._scaled_mm where supported)."""
    import torch

    points = []
    for dtype in sizes.dtypes:
        for m, n, k in gemm_shapes(sizes):
            call = _matmul(dtype, m, n, k, sizes.device)
            if call is not None:
                time_ = timed(call, warmup=sizes.warmup, repeats=sizes.repeats, sync=sync)
                points.append(GemmPoint(dtype=dtype, m=m, n=n, k=k, time=time_))
    torch.backends.cuda.matmul.allow_tf32 = False
    return points


def _matmul(dtype: str, m: int, n: int, k: int, device: str) -> Callable[[], object] | None:
    import torch

    if dtype == "fp8":
        if device != "cuda" or torch.cuda.get_device_capability() < (8, 9):
            return None
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm needs
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch_dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    a, b = torch.randn(m, k, device=device, dtype=torch_dtype), torch.randn(k, n, device=device, dtype=torch_dtype)
    return lambda: a @ b


def measure_attention(sizes: Sizes, sync: Callable[[], None]) -> list[AttentionPoint]:
    """Causal SDPA forward + backward per sequence length, head dim and backend torch offers on the device."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION} if sizes.device == "cuda" else \
        {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    heads = 8 if sizes.device == "cpu" else 32
    points = []
    for dtype in (d for d in sizes.dtypes if d in ("bf16", "fp16", "fp32")):
        torch_dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype])
        for s in sizes.seq_lens:
            for head_dim in (64, 128):
                shape = (1, heads, s, head_dim)
                q, k, v = (torch.randn(shape, device=sizes.device, dtype=torch_dtype, requires_grad=True)
                           for _ in range(3))
                flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
                for name, backend in backends.items():
                    def call(backend: SDPBackend = backend, qkv: tuple = (q, k, v)) -> None:
                        with sdpa_kernel(backend):
                            out = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)
                        out.sum().backward()
                    try:
                        call()
                    except RuntimeError:  # this backend does not take this dtype/shape here
                        continue
                    time_ = timed(call, warmup=sizes.warmup, repeats=sizes.repeats, sync=sync)
                    points.append(AttentionPoint(dtype=dtype, backend=name, batch=1, heads=heads, seq_len=s,
                                                 head_dim=head_dim, flops=flops, time=time_))
    return points


def measure_copies(sizes: Sizes, sync: Callable[[], None]) -> list[RatePoint]:
    """Device-memory copy bandwidth (read + write), and host-to-device bandwidth pinned and pageable on CUDA."""
    import torch

    nbytes = sizes.copy_bytes
    src = torch.empty(nbytes // 4, device=sizes.device)
    dst = torch.empty_like(src)
    calls = {"device_copy": (lambda: dst.copy_(src), 2 * nbytes)}
    if sizes.device == "cuda":
        pinned, pageable = torch.empty(nbytes // 4, pin_memory=True), torch.empty(nbytes // 4)
        calls["h2d_pinned"] = (lambda: dst.copy_(pinned, non_blocking=True), nbytes)
        calls["h2d_pageable"] = (lambda: dst.copy_(pageable), nbytes)
    points = []
    for name, (call, moved) in calls.items():
        time_ = timed(call, warmup=sizes.warmup, repeats=sizes.repeats, sync=sync)
        points.append(RatePoint(name=name, size=moved, rate=moved / max(time_.median, 1e-12), time=time_))
    return points


def measure_cpu_adam(sizes: Sizes) -> list[RatePoint]:
    """Parameters/s of one AdamW step on host fp32 tensors: torch's default, foreach and fused, and DeepSpeed's
    CPUAdam when its extension is already built (building it would take minutes)."""
    import torch

    size = sizes.adam_params
    params = [torch.nn.Parameter(torch.randn(size // 8)) for _ in range(8)]  # a few tensors, as a layer has
    for p in params:
        p.grad = torch.randn_like(p)
    optimizers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adamw_torch": lambda: torch.optim.AdamW(params, lr=1e-4),
        "adamw_torch_foreach": lambda: torch.optim.AdamW(params, lr=1e-4, foreach=True),
        "adamw_torch_fused": lambda: torch.optim.AdamW(params, lr=1e-4, fused=True)}
    if _deepspeed_cpu_adam_built():
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs on import; stdout carries the result
            from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizers["adam_deepspeed"] = lambda: DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
    points = []
    for name, make in optimizers.items():
        try:
            optimizer = make()
        except (RuntimeError, ValueError):  # e.g. no fused CPU AdamW in this torch
            continue
        time_ = timed(optimizer.step, warmup=sizes.warmup, repeats=sizes.repeats, sync=lambda: None)
        points.append(RatePoint(name=name, size=size, rate=size / max(time_.median, 1e-12), time=time_))
    return points


def _deepspeed_cpu_adam_built() -> bool:
    """Whether DeepSpeed was installed with its CPUAdam extension prebuilt (DS_BUILD_CPU_ADAM=1), read from its
    `git_version_info_installed.py` without importing DeepSpeed (whose import logs to stdout)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return False
    record = Path(next(iter(spec.submodule_search_locations)), "git_version_info_installed.py")
    namespace: dict[str, object] = {}
    try:
        exec(compile(record.read_text(), str(record), "exec"), namespace)  # a file of plain assignments
    except (OSError, SyntaxError):
        return False
    installed = namespace.get("installed_ops")
    return isinstance(installed, dict) and bool(installed.get("cpu_adam"))


def cuda_context_bytes() -> float:
    """Device memory in use outside the caching allocator once CUDA and cuBLAS are initialised, bytes."""
    import torch

    torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")  # creates the context and a cuBLAS handle
    free, total = torch.cuda.mem_get_info()
    return float(total - free - torch.cuda.memory_reserved())


def device_identity(device: str) -> tuple[str, str, int, str | None]:
    """(catalog GPU id, reported name, local device count, driver version) of the devices measured."""
    if device == "cpu":
        return "cpu", platform.processor() or platform.machine() or "cpu", 1, None
    from solver.hardware.detect import detect_cluster, driver_version

    cluster = detect_cluster()
    return cluster.gpu.id, cluster.gpu.name, cluster.gpus_per_node, driver_version()


def measure(device: str, *, quick: bool, ranks: int | None = None,
            progress: Callable[[str], None] = lambda _: None) -> Profile:
    """Run every microbenchmark on this node and return the profile."""
    import torch

    from solver.hardware.measure_collectives import measure_collectives

    if device == "cuda" and not torch.cuda.is_available():
        raise FitplanError("--device cuda: torch sees no CUDA GPU here.", "Run with --device cpu, or on the GPU node.")
    gpu, name, count, driver = device_identity(device)
    ranks = ranks or (count if device == "cuda" else 2)
    if device == "cuda" and ranks > count:
        raise FitplanError(f"--ranks {ranks}: this node has {count} GPUs (one process per GPU).",
                           f"Pass --ranks {count} or fewer.")
    if device == "cpu" and ranks > MAX_CPU_RANKS:
        raise FitplanError(f"--ranks {ranks}: a CPU measurement starts at most {MAX_CPU_RANKS} processes.",
                           f"Pass --ranks {MAX_CPU_RANKS} or fewer.")
    sizes = sizes_for(device, quick=quick)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    context = cuda_context_bytes() if device == "cuda" else None
    progress("GEMMs")
    gemm = measure_gemms(sizes, sync)
    progress("attention")
    attention = measure_attention(sizes, sync)
    progress("copies and CPU Adam")
    rates = [*measure_copies(sizes, sync), *measure_cpu_adam(sizes)]
    collectives = []
    if ranks > 1:
        progress(f"collectives on {ranks} ranks")
        collectives = measure_collectives(device=device, ranks=ranks, sizes=sizes.collective_bytes,
                                          warmup=sizes.warmup, repeats=sizes.repeats)
    links = tuple(fit for op in ("all_reduce", "all_gather", "reduce_scatter")
                  if (fit := fit_link(op, collectives)) is not None)
    return Profile(gpu=gpu, device_name=name, devices=ranks, driver=driver, torch=torch.__version__,
                   cuda=torch.version.cuda, created=datetime.datetime.now(datetime.timezone.utc).isoformat(
                       timespec="seconds"), quick=quick, gemm=tuple(gemm), attention=tuple(attention),
                   collectives=tuple(collectives), links=links, rates=tuple(rates), context_bytes=context)


def profile_dir() -> Path:
    """Where `fitplan measure` keeps profiles when no -o is given: $FITPLAN_PROFILE_DIR, else
    ~/.cache/fitplan/profiles (one `<gpu id>.json` per GPU kind)."""
    return Path(os.environ.get("FITPLAN_PROFILE_DIR") or Path.home() / ".cache" / "fitplan" / "profiles")


def stored_profiles() -> dict[str, Path]:
    """Catalog GPU id -> the stored profile file, for the GPUs that have one."""
    folder = profile_dir()
    return {path.stem: path for path in sorted(folder.glob("*.json"))} if folder.is_dir() else {}


def measure_to_file(device: str, *, quick: bool, ranks: int | None, output: Path | None, force: bool = False,
                    progress: Callable[[str], None] = lambda _: None) -> tuple[Profile, Path]:
    """Measure this node and write the profile to `output` (an existing file only with `force`, checked before
    measuring), or to the profile folder as `<gpu id>.json`, replacing the stored profile of that GPU."""
    import torch

    from costmodels.profile import profile_json

    if device not in ("auto", "cpu", "cuda"):
        raise FitplanError(f"--device {device!r} must be auto, cpu or cuda.", "e.g. --device cpu")
    if ranks is not None and ranks < 1:
        raise FitplanError(f"--ranks {ranks} must be at least 1.", "1 skips the collectives.")
    if output is not None:
        refuse_overwrite([output], force=force)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    profile = measure(device, quick=quick, ranks=ranks, progress=progress)
    path = output or profile_dir() / f"{profile.gpu}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_together({path: text_writer(profile_json(profile))}, force=force or output is None)
    return profile, path
