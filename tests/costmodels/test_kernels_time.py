"""Attention kernels priced from the kernel papers' tables, and kernel launches from the lowering's counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodels import Config, Engine, Workload, estimate, parse_cluster
from costmodels.attention_kernels import DEFAULT_KERNEL, TE_KERNEL, curves, fraction_of_peak, kernel_for, kernel_note
from costmodels.compute import (
    EAGER_HOST_SECONDS_PER_KERNEL,
    KERNEL_LAUNCH_SECONDS,
    KernelSpeed,
    kernel_speed,
    launch_seconds,
    work_seconds,
)
from costmodels.hardware import find_gpu
from costmodels.timing import speed_for
from graphs import Poly, Work, lower

from ..graphs.reference import write_config
from ..graphs.tiny_configs import tiny_values

MEASURED_ON = {"ampere": "A100-80GB", "hopper": "H100"}


@pytest.mark.parametrize("curve", curves(), ids=lambda c: f"{c.arch}-hd{c.head_dim}-causal{c.causal}")
def test_attention_speed_equals_the_papers_table_at_its_points(curve):
    gpu = find_gpu(MEASURED_ON[curve.arch])
    for seq_len, tflops in zip(curve.seq_len, curve.tflops, strict=True):
        fraction = fraction_of_peak(gpu, seq_len=seq_len, head_dim=curve.head_dim, causal=curve.causal,
                                    kernel=curve.kernel)
        assert fraction * curve.peak_tflops == pytest.approx(tflops, rel=1e-12)


def test_attention_speed_lies_between_neighbouring_lengths_and_head_dims_and_is_flat_beyond():
    a100 = find_gpu("A100-80GB")
    at = {(s, d): fraction_of_peak(a100, seq_len=s, head_dim=d) for s in (2048, 3000, 4096) for d in (64, 96, 128)}
    assert at[(2048, 64)] < at[(3000, 64)] < at[(4096, 64)]
    assert at[(3000, 64)] < at[(3000, 96)] < at[(3000, 128)]
    assert at[(3000, 96)] == pytest.approx((at[(3000, 64)] + at[(3000, 128)]) / 2, rel=1e-12)
    assert fraction_of_peak(a100, seq_len=65536, head_dim=64) == fraction_of_peak(a100, seq_len=16384, head_dim=64)
    assert fraction_of_peak(a100, seq_len=128, head_dim=256) == fraction_of_peak(a100, seq_len=512, head_dim=128)


def test_attention_rate_follows_the_gpu_and_length_not_one_constant():
    # FlashAttention-2 reaches ~55% of the A100's peak but ~30% of the H100's (Dao 2023 Fig. 4, 7).
    def rate(gpu: str, seq_len: int) -> float:
        return kernel_speed(find_gpu(gpu), matmul_dtype="bf16", attention_dtype="bf16", tokens=seq_len,
                            width=4096, seq_len=seq_len, head_dim=128).attention_flops

    a100, h100 = find_gpu("A100-80GB"), find_gpu("H100")
    assert rate("A100-80GB", 2048) / a100.peak_flops("bf16") > 1.5 * rate("H100", 2048) / h100.peak_flops("bf16")
    table = next(c for c in curves() if c.arch == "hopper" and c.head_dim == 128 and c.causal)
    assert rate("H100", 16384) / rate("H100", 512) == pytest.approx(table.tflops[-1] / table.tflops[0], rel=1e-12)


def _speed() -> KernelSpeed:
    return KernelSpeed(matmul_flops=1e14, attention_flops=1e14, memory_bandwidth=1e12)


def test_a_phase_of_small_kernels_costs_one_launch_per_counted_kernel():
    work = Work(flops=Poly.const(1000), kernels=Poly.const(250))
    assert launch_seconds(work, _speed()) == pytest.approx(250 * KERNEL_LAUNCH_SECONDS, rel=1e-12)
    assert work_seconds(work, _speed(), b=1, s=1, tp=1) == pytest.approx(250 * KERNEL_LAUNCH_SECONDS, rel=1e-12)


def test_a_phase_of_long_kernels_hides_its_launches():
    work = Work(flops=Poly.const(10**14), kernels=Poly.const(250))  # one second of matmuls
    assert work_seconds(work, _speed(), b=1, s=1, tp=1) == pytest.approx(1.0, rel=1e-12)


def _launch_host(tmp_path, layers: int) -> tuple[float, float]:
    values = {**tiny_values("llama"), "num_hidden_layers": layers}
    graph = lower(str(write_config(tmp_path / str(layers), values)), dtype="float32", autocast="bfloat16",
                  use_cache=False)
    config = Config(engine=Engine.DDP, micro_batch=1)
    est = estimate(graph, parse_cluster("1xH100"), Workload(seq_len=16, global_batch=1), config)
    per_layer = sum(w.kernels(1, 1) for w in (graph.decoder_layers()[0].cost().forward,
                                              graph.decoder_layers()[0].cost().backward))
    return dict(est.time.details)["kernel_launch_host"], per_layer * EAGER_HOST_SECONDS_PER_KERNEL


def test_twice_the_layers_adds_the_launch_time_of_the_added_layers(tmp_path):
    three, per_layer = _launch_host(tmp_path, 3)
    six, _ = _launch_host(tmp_path, 6)
    assert six - three == pytest.approx(3 * per_layer, rel=1e-9)
    assert per_layer > 0


def test_tiny_model_step_is_launch_bound_and_the_plan_names_its_attention_kernel(tmp_path):
    graph = lower(str(write_config(tmp_path, tiny_values("llama"))), dtype="float32", autocast="bfloat16",
                  use_cache=False)
    est = estimate(graph, parse_cluster("1xH100"), Workload(seq_len=16, global_batch=1),
                   Config(engine=Engine.DDP, micro_batch=1))
    details = dict(est.time.details)
    # A 128-wide model over 16 tokens: every phase waits for the host, so launches are the whole compute.
    assert details["kernel_launch_exposed"] > 0.9 * details["kernel_launch_host"]
    assert est.time.compute >= details["kernel_launch_host"] * (1 - 1e-9)
    assert any(note.startswith(f"attention kernel: {DEFAULT_KERNEL}") for note in est.notes)


def test_pre_ampere_gpus_use_sdpas_memory_efficient_kernel():
    # FlashAttention-2 needs sm80+; SDPA falls back to the CUTLASS memory-efficient kernel (the paper's xformers bars).
    v100, a100 = find_gpu("V100-32GB"), find_gpu("A100-80GB")
    assert kernel_for(v100) == "memory-efficient" and kernel_for(a100) == DEFAULT_KERNEL
    table = next(c for c in curves() if c.kernel == "memory-efficient" and c.head_dim == 128 and c.causal)
    assert fraction_of_peak(v100, seq_len=2048, head_dim=128) == pytest.approx(table.tflops[2] / 312, rel=1e-12)
    assert kernel_note(v100).startswith("attention kernel: memory-efficient")


H200_KERNELS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gpu" / "h200_kernels.json"


def test_transformer_engines_hopper_attention_is_cudnns_as_measured_on_the_h200():
    """TE prefers cuDNN's fused attention from Hopper on (`get_attention_backend`); its curve is the project's H200
    measurement of the cuDNN kernel (SDPA's cuDNN backend, native GQA) at every length and head dim measured."""
    h200 = find_gpu("H200")
    rows = [r for r in json.loads(H200_KERNELS.read_text())["attention"]
            if r["backend"] == "cudnn" and r["gqa"] == "enable_gqa" and "tflops" in r]
    assert len(rows) == 14 and kernel_for(h200, transformer_engine=True) == TE_KERNEL
    for r in rows:
        fraction = fraction_of_peak(h200, seq_len=r["seq_len"], head_dim=r["head_dim"], kernel=TE_KERNEL)
        assert fraction * 989 == pytest.approx(r["tflops"], abs=0.05)  # transcribed to 0.1 TFLOP/s


@pytest.mark.parametrize(("gpu", "faster"), [("H100", True), ("A100-80GB", False)])
def test_megatron_attention_is_cudnns_on_hopper_and_flash_before(tmp_path, gpu, faster):
    graph = lower(str(write_config(tmp_path, tiny_values("llama"))), dtype="bfloat16", use_cache=False)
    cluster = parse_cluster(f"8x{gpu}")
    rates = {engine: speed_for(graph, cluster, Config(engine=engine, dp=8, zero=zero), b=1, s=8192).attention_flops
             for engine, zero in ((Engine.MEGATRON, 1), (Engine.FSDP2, 2))}
    if faster:
        arch = find_gpu(gpu)
        expected = (fraction_of_peak(arch, seq_len=8192, head_dim=32, kernel=TE_KERNEL)
                    / fraction_of_peak(arch, seq_len=8192, head_dim=32))
        assert rates[Engine.MEGATRON] / rates[Engine.FSDP2] == pytest.approx(expected, rel=1e-12)
        assert expected > 1.3
    else:
        assert rates[Engine.MEGATRON] == rates[Engine.FSDP2]


def test_eager_host_cost_per_kernel_is_the_h200_tiny_llama_step_over_the_lowerings_count(tmp_path):
    """The measured host-bound forward + backward of benchmarks/gpu/kernels.py's tiny HF Llama, divided by the
    kernels the lowering counts for the same model and shape, is the constant (to its 5 digits)."""
    row = next(r for r in json.loads(H200_KERNELS.read_text())["host_overhead"] if r["kernel"] == "tiny_llama_fwd_bwd")
    values = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": row["layers"],
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
    graph = lower(str(write_config(tmp_path, values)), dtype="bfloat16", use_cache=False)
    counted = sum(w.kernels(1, row["tokens"]) for layer in graph.nodes()
                  for w in (layer.cost().forward, layer.cost().backward))
    assert row["seconds"] / counted == pytest.approx(EAGER_HOST_SECONDS_PER_KERNEL, rel=1e-4)


def test_a_small_eager_step_waits_on_the_host():
    """A 1B model over 128 tokens: most of its phases' kernels take less than the host needs to issue them eagerly
    (at the 3.8 us launch floor alone they would not)."""
    graph = lower("meta-llama/Llama-3.2-1B", dtype="bfloat16")
    workload, cluster = Workload(seq_len=128, global_batch=1), parse_cluster("1xH100")
    eager = estimate(graph, cluster, workload, Config(engine=Engine.FSDP2, zero=2, micro_batch=1))
    details = dict(eager.time.details)
    assert details["kernel_launch_exposed"] > 0.5 * details["kernel_launch_host"]
    assert eager.time.compute >= details["kernel_launch_host"] * (1 - 1e-9)
