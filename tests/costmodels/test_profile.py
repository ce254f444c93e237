"""Profiles: the format round-trips, bad files are refused, and each measured rate replaces its datasheet
constant in the cost models by exactly the ratio the measurement says."""

from __future__ import annotations

import dataclasses
import json

import pytest

from costmodels import Config, Engine, Offload, Precision, Workload, estimate, find_gpu, parse_cluster
from costmodels.cluster import with_profile
from costmodels.collectives import Group, all_gather_seconds, all_reduce_seconds, reduce_scatter_seconds
from costmodels.compute import DEFAULT_MAMF, MAMF, kernel_speed, measured_matmul_ceiling
from costmodels.offload import offload_seconds
from costmodels.overhead import runtime_overhead
from costmodels.profile import (
    AttentionPoint,
    CollectivePoint,
    GemmPoint,
    InvalidProfile,
    LinkFit,
    Profile,
    RatePoint,
    Timing,
    fit_link,
    load_profile,
    profile_json,
)
from graphs import Checkpoint, lower

LLAMA = "meta-llama/Llama-3.2-1B"
H100 = "h100-sxm-80gb"
M, N, K = 4096, 8192, 2048  # Llama-3.2-1B's up-projection at 4096 tokens


def timing(seconds: float) -> Timing:
    return Timing(median=seconds, spread=0.02, repeats=5)


def make_profile(*, gemm_seconds: float = 1e-3, attention_rate: float = 300e12, copy_rate: float = 2e12,
                 rates: tuple[RatePoint, ...] = (), **fields) -> Profile:
    """A profile of an H100 with one GEMM shape, one attention point and a device-copy rate."""
    attention = AttentionPoint(dtype="bf16", backend="flash", batch=1, heads=32, seq_len=4096, head_dim=128,
                               flops=attention_rate * 1e-3, time=timing(1e-3))
    return Profile(gpu=H100, device_name="NVIDIA H100 80GB HBM3", devices=8, torch="2.13.0",
                   created="2026-11-30T00:00",
                   gemm=(GemmPoint(dtype="bf16", m=M, n=N, k=K, time=timing(gemm_seconds)),),
                   attention=(attention,),
                   rates=(RatePoint(name="device_copy", size=2**30, rate=copy_rate, time=timing(2**30 / copy_rate)),
                          *rates),
                   **fields)


def test_profile_round_trips_through_json(tmp_path):
    profile = make_profile(links=(LinkFit(op="all_reduce", bus_bandwidth=360e9, latency=8e-6),), context_bytes=5e8)
    path = tmp_path / "profile.json"
    path.write_text(profile_json(profile))
    assert load_profile(path) == profile


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not valid JSON"),
    (json.dumps({"gpu": H100}), "invalid"),
    (json.dumps({"version": 7, "gpu": H100}), "version 7"),
])
def test_bad_profile_files_are_refused_with_the_file_named(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidProfile, match=message) as error:
        load_profile(path)
    assert str(path) in error.value.message


def test_negative_timing_is_refused(tmp_path):
    data = json.loads(profile_json(make_profile()))
    data["gemm"][0]["time"]["median"] = -1
    path = tmp_path / "negative.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidProfile, match="gemm"):
        load_profile(path)


def test_profile_for_another_gpu_is_refused():
    with pytest.raises(InvalidProfile, match="a100"):
        with_profile(parse_cluster("8xA100"), make_profile(), origin="p.json")


def test_gemm_measured_at_the_datasheet_rate_leaves_matmul_speed_unchanged():
    # A measurement that took exactly what the datasheet model predicts at its shape implies the same ceiling.
    gpu = find_gpu(H100)
    predicted = kernel_speed(gpu, matmul_dtype="bf16", attention_dtype="bf16", tokens=M, width=K, seq_len=M,
                             head_dim=128).matmul_flops
    profile = make_profile(gemm_seconds=2 * M * N * K / predicted)
    assert measured_matmul_ceiling(gpu, profile, "bf16") == pytest.approx(
        gpu.peak_flops("bf16") * MAMF.get(H100, DEFAULT_MAMF), rel=1e-12)
    with_profile_speed = kernel_speed(gpu, matmul_dtype="bf16", attention_dtype="bf16", tokens=M, width=K, seq_len=M,
                                      head_dim=128, profile=profile)
    assert with_profile_speed.matmul_flops == pytest.approx(predicted, rel=1e-12)


@pytest.fixture(scope="module")
def llama():
    return lower(LLAMA, dtype="bfloat16")


def _compute(graph, profile: Profile, config: Config) -> tuple[float, float]:
    cluster = with_profile(parse_cluster("8xH100"), profile, origin="test")
    result = estimate(graph, cluster, Workload(seq_len=2048, global_batch=16), config)
    return result.time.compute, result.time.recompute


CONFIG = Config(engine=Engine.FSDP2, zero=3, tp=1, dp=8, micro_batch=2, precision=Precision.BF16_MIXED)


def test_slower_gemms_in_the_profile_stretch_matmul_time_by_that_ratio(llama):
    # compute = matmul + attention + memory-bound time; only the matmul term scales with the GEMM time, so
    # doubling it twice must add twice as much the second time.
    c1, c2, c4 = (_compute(llama, make_profile(gemm_seconds=1e-3 * f), CONFIG)[0] for f in (1, 2, 4))
    assert c1 < c2 < c4
    assert c4 - c2 == pytest.approx(2 * (c2 - c1), rel=1e-9)
    baseline = estimate(llama, parse_cluster("8xH100"), Workload(seq_len=2048, global_batch=16), CONFIG)
    assert c1 != pytest.approx(baseline.time.compute, rel=1e-3)  # the profile, not the datasheet, set it


def test_every_kernel_rate_halved_doubles_compute_and_recompute(llama):
    """The kernels' device time doubles; the host's time to issue them does not, so the phases that wait on it
    (time.details kernel_launch_exposed, the small nodes around the layers) are left out of the comparison."""
    config = dataclasses.replace(CONFIG, checkpoint=(Checkpoint.FULL,) * len(llama.decoder_layers()))

    def device(profile: Profile) -> tuple[float, float]:
        cluster = with_profile(parse_cluster("8xH100"), profile, origin="test")
        time = estimate(llama, cluster, Workload(seq_len=2048, global_batch=16), config).time
        return time.compute + time.recompute - dict(time.details)["kernel_launch_exposed"], time.recompute

    fast = device(make_profile())
    slow = device(make_profile(gemm_seconds=2e-3, attention_rate=150e12, copy_rate=1e12))
    assert fast[1] > 0
    assert slow == pytest.approx((2 * fast[0], 2 * fast[1]), rel=1e-12)


def test_collectives_inside_a_node_use_the_profile_link_fit():
    links = (LinkFit(op="all_reduce", bus_bandwidth=300e9, latency=10e-6),
             LinkFit(op="all_gather", bus_bandwidth=250e9, latency=20e-6),
             LinkFit(op="reduce_scatter", bus_bandwidth=200e9, latency=30e-6))
    cluster = with_profile(parse_cluster("2x8xH100"), make_profile(links=links), origin="test")
    size, inside, across = 2**28, Group(8, False), Group(16, True)
    assert all_reduce_seconds(cluster, inside, size) == pytest.approx(2 * 7 / 8 * size / 300e9 + 14 * 10e-6)
    assert all_gather_seconds(cluster, inside, size) == pytest.approx(7 / 8 * size / 250e9 + 7 * 20e-6)
    assert reduce_scatter_seconds(cluster, inside, size) == pytest.approx(7 / 8 * size / 200e9 + 7 * 30e-6)
    plain = parse_cluster("2x8xH100")  # a profile measures one node: inter-node links keep the catalog's
    assert all_reduce_seconds(cluster, across, size) == all_reduce_seconds(plain, across, size)


def test_link_fit_recovers_the_alpha_beta_that_generated_the_points():
    bandwidth, latency, ranks = 80e9, 7e-6, 4
    points = [CollectivePoint(op=op, ranks=ranks, nbytes=size, time=timing(
        (2 if op == "all_reduce" else 1) * ((ranks - 1) * latency + (ranks - 1) / ranks * size / bandwidth)))
        for op in ("all_reduce", "all_gather") for size in (2**20, 2**24, 2**28)]
    for op in ("all_reduce", "all_gather"):
        fit = fit_link(op, points)
        assert fit.bus_bandwidth == pytest.approx(bandwidth, rel=1e-6)
        assert fit.latency == pytest.approx(latency, rel=1e-6)
    assert fit_link("reduce_scatter", points) is None


def test_offload_uses_measured_host_copies_and_cpu_adam():
    rates = (RatePoint(name="h2d_pinned", size=2**30, rate=40e9, time=timing(2**30 / 40e9)),
             RatePoint(name="adam_deepspeed", size=2**24, rate=1e9, time=timing(2**24 / 1e9)))
    cluster = with_profile(parse_cluster("8xH100"), make_profile(rates=rates), origin="test")
    config = Config(engine=Engine.DEEPSPEED, zero=2, dp=8, optimizer_offload=Offload.CPU,
                    precision=Precision.BF16_MIXED)
    partition = 10**8
    # Gradients down and parameters up in bf16 over the measured link, then 8 ranks' partitions on the host.
    expected = 2 * partition * 2 / 40e9 + 8 * partition / 1e9
    assert offload_seconds(cluster, config, partition=partition, params=partition, grad_bytes=2) == \
        pytest.approx(expected, rel=1e-12)


def test_measured_cuda_context_replaces_the_published_one():
    config = Config(dp=8, precision=Precision.BF16_MIXED)
    plain = parse_cluster("8xH100")
    profiled = with_profile(plain, make_profile(context_bytes=500 * 2**20), origin="test")
    from costmodels.overhead import CUDA_CONTEXT_BYTES

    assert runtime_overhead(plain, config) - runtime_overhead(profiled, config) == CUDA_CONTEXT_BYTES - 500 * 2**20
