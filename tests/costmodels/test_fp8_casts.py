"""fp8 steps pay for the casts of their matmul operands (dynamic scaling: amax, scale, cast), not only the
doubled matmul rate; the LM head stays in bf16, as the emitted script leaves it."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, parse_cluster, timing
from costmodels import fp8 as fp8_module
from costmodels.fp8 import CAST_BYTES_PER_ELEMENT, cast_elements, te_cast_bytes
from costmodels.terms import Gemm
from costmodels.timing import layer_gemms, speed_for
from graphs import lower


def test_a_linear_casts_input_and_weight_forward_and_three_operands_backward():
    forward, backward = cast_elements([Gemm(n=300, k=200)], tokens=10)
    assert forward == 10 * 200 + 300 * 200
    assert backward == 10 * 300 + 300 * 200 + 10 * 200


def test_an_expert_stack_casts_every_expert_weight_and_its_routed_rows():
    forward, _ = cast_elements([Gemm(n=30, k=20, routed=2, copies=8)], tokens=10)
    assert forward == 2 * 10 * 20 + 8 * 30 * 20


@pytest.fixture(scope="module")
def llama():
    return lower("meta-llama/Llama-3.1-8B", dtype="bfloat16")


@pytest.fixture(autouse=True)
def fresh_timing_caches():
    """The tests price with and without the casts by patching a constant: the node terms cached on an equal
    cluster's node view would otherwise answer the second pricing, and keep the patched value for later tests."""
    timing.clear_caches()
    yield
    timing.clear_caches()


def step(graph, precision: Precision):
    cluster = parse_cluster("8xH100")
    config = Config(engine=Engine.FSDP2, zero=3, dp=8, micro_batch=2, grad_accum=2, precision=precision,
                    optimizer=Optimizer.ADAMW)
    return estimate(graph, cluster, Workload(seq_len=4096, global_batch=32), config), cluster, config


def test_fp8_compute_includes_exactly_the_casts(llama, monkeypatch):
    with_casts, cluster, config = step(llama, Precision.FP8)
    monkeypatch.setattr(fp8_module, "CAST_BYTES_PER_ELEMENT", 0)
    timing.clear_caches()  # priced afresh with the patched constant
    without, _, _ = step(llama, Precision.FP8)
    speed = speed_for(llama, cluster, config, b=2, s=4096)
    layers = llama.decoder_layers()
    forward, backward = cast_elements(layer_gemms(layers[0], 1), 2 * 4096)
    casts = 2 * len(layers) * (forward + backward) * CAST_BYTES_PER_ELEMENT / speed.memory_bandwidth
    assert with_casts.time.compute - without.time.compute == pytest.approx(casts, rel=1e-9)
    assert casts > 0


def test_fp8_is_faster_than_bf16_but_less_than_the_matmul_ratio(llama):
    bf16, _, _ = step(llama, Precision.BF16_MIXED)
    fp8, _, _ = step(llama, Precision.FP8)
    ratio = bf16.time.compute / fp8.time.compute
    assert 1.0 < ratio < 2.0


def test_the_lm_head_runs_in_bf16_under_fp8(llama):
    cluster = parse_cluster("8xH100")
    config = Config(engine=Engine.FSDP2, zero=3, dp=8, precision=Precision.FP8)
    head_fp8 = speed_for(llama, cluster, config, b=1, s=4096, head=True)
    head_bf16 = speed_for(llama, cluster, dataclasses.replace(config, precision=Precision.BF16_MIXED), b=1, s=4096,
                          head=True)
    assert head_fp8.matmul_flops == pytest.approx(head_bf16.matmul_flops)


def test_transformer_engine_casts_inputs_once_and_weights_once_per_step():
    """TE's delayed scaling (linear.py, layernorm_linear.py): a norm-fed input costs the norm's fp8 write and a
    transpose (1 B/element more), another input and each output gradient one cast-transpose (4 B), and the weights
    one cast-transpose on the step's first micro-batch only."""
    gemms = [Gemm(n=300, k=200, norm_fed=True), Gemm(n=200, k=300)]
    forward, backward = te_cast_bytes(gemms, 10, micro_batches=4)
    assert forward == 10 * 200 * 1 + 10 * 300 * 4 + (300 * 200 + 200 * 300) * 4 / 4
    assert backward == 10 * 300 * 4 + 10 * 200 * 4


def megatron_step(graph, grad_accum: int):
    cluster = parse_cluster("8xH100")
    config = Config(engine=Engine.MEGATRON, zero=1, dp=8, micro_batch=2, grad_accum=grad_accum,
                    precision=Precision.FP8, optimizer=Optimizer.ADAMW)
    return estimate(graph, cluster, Workload(seq_len=4096, global_batch=16 * grad_accum), config), cluster, config


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_a_megatron_fp8_step_pays_exactly_transformer_engines_casts(llama, monkeypatch, grad_accum):
    with_casts, cluster, config = megatron_step(llama, grad_accum)
    monkeypatch.setattr(fp8_module, "TE_CAST_TRANSPOSE_BYTES_PER_ELEMENT", 0)
    monkeypatch.setattr(fp8_module, "TE_NORM_FED_BYTES_PER_ELEMENT", 0)
    timing.clear_caches()  # priced afresh with the patched constant
    without, _, _ = megatron_step(llama, grad_accum)
    speed = speed_for(llama, cluster, config, b=2, s=4096)
    gemms = layer_gemms(llama.decoder_layers()[0], 1)
    rows, weights = 2 * 4096, sum(g.n * g.k for g in gemms)
    inputs = sum(rows * g.k * (1 if g.norm_fed else 4) for g in gemms)
    gradients = sum(rows * g.n * 4 for g in gemms)
    per_layer = grad_accum * (inputs + gradients) + 4 * weights  # the weights once per step
    casts = len(llama.decoder_layers()) * per_layer / speed.memory_bandwidth
    assert with_casts.time.compute - without.time.compute == pytest.approx(casts, rel=1e-9)
    assert [g.norm_fed for g in gemms].count(True) == 5  # q, k, v, gate and up read the norm's output
