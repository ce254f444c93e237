"""The memory-saving knobs wired into `estimate`: paged optimizers, optimizer-in-backward, the loss and activation
offload, each as a `Config` knob whose estimate equals its own module's figures (those modules are tested against
bitsandbytes, torchtune's hooks, Liger's code and MemTracker in test_paging.py, test_optimizer_in_backward.py,
test_loss.py and test_activation_offload.py), and each refused with its reason where it cannot run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodels import Config, Engine, InvalidConfig, Optimizer, Precision, Workload, estimate, lowering_for
from costmodels.activation_offload import offload_seconds, offload_terms
from costmodels.cluster import parse_cluster
from costmodels.config import Loss
from costmodels.loss import loss_terms
from costmodels.lowering import liger_lowering
from costmodels.memory import allocated_peak, memory_terms
from costmodels.optimizer_in_backward import in_backward_terms
from costmodels.paging import paged_states, paging_seconds
from costmodels.states import _optimizer_shapes, model_states
from costmodels.timing import speed_for
from graphs import Checkpoint, Work, lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

B, S = 2, 128
WORKLOAD = Workload(seq_len=S, global_batch=B)
CLUSTER = parse_cluster("1xA10G")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("savers")


def graph_for(folder, config: Config, arch: str = "llama"):
    """The lowering `config` runs: with Liger's kernels in the layers for the fused linear loss."""
    dtype, autocast = lowering_for(config)
    values = {**tiny_values(arch), "vocab_size": 2048}
    return lower(str(write_config(folder / arch, values)), dtype=dtype, autocast=autocast, attention="sdpa",
                 liger=liger_lowering(config))


LAYERS = tiny_values("llama")["num_hidden_layers"]


def config(layers: int = LAYERS, **knobs) -> Config:
    return Config(precision=Precision.BF16, micro_batch=B, checkpoint=(Checkpoint.FULL,) * layers, **knobs)


@pytest.mark.parametrize("optimizer", [Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT])
def test_paged_optimizer_estimate_keeps_only_resident_states_and_adds_the_paging(folder, optimizer):
    cfg = config(optimizer=optimizer)
    graph = graph_for(folder, cfg)
    split = paged_states(optimizer, _optimizer_shapes(cfg, list(graph.tensor_groups(trainable=True))))
    assert split.paged > 0  # the tiny model's embedding and MLP weights exceed bitsandbytes' 1e5 elements
    got = estimate(graph, CLUSTER, WORKLOAD, cfg)
    unpaged = estimate(graph, CLUSTER, WORKLOAD, replace(cfg, optimizer=Optimizer.ADAMW_8BIT))
    assert got.memory.optimizer_states == split.device
    assert got.memory.cpu_bytes_per_node == split.paged
    assert any(note.startswith("paged optimizer") for note in got.notes)  # the assumption is printed
    assert got.time.offload - unpaged.time.offload == pytest.approx(paging_seconds(CLUSTER, split), rel=1e-9)
    if optimizer is Optimizer.PAGED_ADAMW_8BIT:  # the same states as AdamW8bit, split by where they live
        assert split.resident + split.paged == unpaged.memory.optimizer_states


def test_optimizer_in_backward_estimate_equals_the_in_backward_terms(folder):
    cfg = replace(config(), checkpoint=(Checkpoint.NONE,) * LAYERS)
    graph = graph_for(folder, cfg)
    modes = cfg.layer_modes(LAYERS)
    reference = allocated_peak(in_backward_terms(graph, cfg, memory_terms(graph, WORKLOAD, cfg)), modes)[0]
    wired = replace(cfg, optimizer_in_backward=True)
    assert allocated_peak(memory_terms(graph, WORKLOAD, wired), modes)[0] == reference
    assert estimate(graph, CLUSTER, WORKLOAD, wired).memory.allocated_peak == reference
    assert model_states(graph, wired).grads == 0 == model_states(graph, wired).accumulating_grads


def test_paged_and_in_backward_together_keep_one_set_of_quantisation_maps_per_tensor(folder):
    cfg = config(optimizer=Optimizer.PAGED_ADAMW_8BIT, optimizer_in_backward=True)
    graph = graph_for(folder, cfg)
    tensors = sum(n for _, n in graph.tensor_groups(trainable=True))
    per_tensor = paged_states(cfg.optimizer, _optimizer_shapes(cfg, list(graph.tensor_groups(trainable=True))),
                              instances=tensors)
    assert model_states(graph, cfg).optimizer == per_tensor.device


@pytest.mark.parametrize("loss", [Loss.CHUNKED, Loss.FUSED_LINEAR])
def test_loss_knob_estimate_equals_the_loss_terms(folder, loss):
    cfg = config()
    graph = graph_for(folder, replace(cfg, loss=loss))
    modes = cfg.layer_modes(LAYERS)
    reference = allocated_peak(loss_terms(graph, cfg, memory_terms(graph, WORKLOAD, cfg), loss, seq_len=S), modes)[0]
    got = estimate(graph, CLUSTER, WORKLOAD, replace(cfg, loss=loss))
    hf = estimate(graph_for(folder, cfg), CLUSTER, WORKLOAD, cfg)
    assert got.memory.allocated_peak == reference != hf.memory.allocated_peak


def test_activation_offload_estimate_equals_the_offload_terms_and_seconds(folder):
    cfg = config()
    graph = graph_for(folder, cfg)
    modes = cfg.layer_modes(LAYERS)
    reference = allocated_peak(offload_terms(memory_terms(graph, WORKLOAD, cfg)), modes)[0]
    on = replace(cfg, activation_offload=True)
    got, off = estimate(graph, CLUSTER, WORKLOAD, on), estimate(graph, CLUSTER, WORKLOAD, cfg)
    assert got.memory.allocated_peak == reference
    assert got.memory.cpu_bytes_per_node > 0 == off.memory.cpu_bytes_per_node
    seconds = offload_seconds(graph, CLUSTER, on, speed_for(graph, CLUSTER, on, b=B, s=S), s=S)
    assert got.time.offload - off.time.offload == pytest.approx(seconds, rel=1e-9, abs=1e-15)


def test_memory_savers_apply_in_order_paged_in_backward_loss_offload(folder):
    cfg = config(optimizer=Optimizer.PAGED_ADAMW_8BIT, optimizer_in_backward=True, loss=Loss.FUSED_LINEAR,
                 activation_offload=True)
    graph = graph_for(folder, cfg)
    plain = config(optimizer=Optimizer.PAGED_ADAMW_8BIT)
    base = replace(memory_terms(graph, WORKLOAD, plain), states=model_states(graph, cfg))
    by_hand = offload_terms(loss_terms(graph, cfg, in_backward_terms(graph, cfg, base), Loss.FUSED_LINEAR, seq_len=S))
    by_hand = replace(by_hand, states=model_states(graph, cfg))  # in_backward_terms re-derives states from `base`
    modes = cfg.layer_modes(LAYERS)
    assert allocated_peak(memory_terms(graph, WORKLOAD, cfg), modes) == allocated_peak(by_hand, modes)


@pytest.mark.parametrize(("knobs", "message"), [
    ({"optimizer_in_backward": True, "grad_accum": 2}, "grad_accum=2"),
    ({"optimizer_in_backward": True, "engine": Engine.DEEPSPEED, "zero": 2}, "DeepSpeed"),
    ({"optimizer_in_backward": True, "dp": 2}, "DDP with dp=2"),
    ({"optimizer_in_backward": True, "precision": Precision.FP16_MIXED}, "fp16"),
    ({"loss": Loss.CHUNKED, "tp": 2}, "vocabulary-parallel"),
    ({"activation_offload": True, "checkpoint": (Checkpoint.NONE, Checkpoint.FULL)}, "full activation checkpointing"),
])
def test_config_refuses_what_the_runtime_refuses(knobs, message):
    with pytest.raises(ValueError, match=message):
        Config(**knobs)


def test_estimate_refuses_model_dependent_settings(folder):
    gpt2 = graph_for(folder, config(), arch="gpt2")
    with pytest.raises(InvalidConfig, match="liger-kernel has no fused linear"):
        estimate(gpt2, CLUSTER, WORKLOAD, config(len(gpt2.decoder_layers()), loss=Loss.FUSED_LINEAR))
    mixed = Config(precision=Precision.BF16_MIXED, micro_batch=B)  # DDP autocast over fp32 weights
    with pytest.raises(InvalidConfig, match="chunked loss runs in one dtype"):
        estimate(graph_for(folder, mixed), CLUSTER, WORKLOAD, replace(mixed, loss=Loss.CHUNKED))
    llama = graph_for(folder, config())
    with pytest.raises(InvalidConfig, match="activation offloading needs full"):
        estimate(llama, CLUSTER, WORKLOAD, Config(precision=Precision.BF16, micro_batch=B, activation_offload=True))


def test_fused_loss_time_keeps_the_head_flops_and_makes_the_cross_entropy_three_passes(folder):
    import re
    from pathlib import Path

    import liger_kernel.ops.cross_entropy as liger_ce

    from costmodels.activations import evaluate
    from costmodels.loss import LIGER_ROW_PASSES, timed_layer

    # Liger's own kernel: two loops load each logits block (online-softmax pass, gradient pass), one stores it
    source = Path(liger_ce.__file__).read_text()
    kernel = source[source.index("def liger_cross_entropy_kernel"):source.index("def cross_entropy_forward")]
    loads = len(re.findall(r"X_block = tl\.load\(\s*X_ptr \+ X_offsets", kernel))
    stores = len(re.findall(r"tl\.store\(X_ptr \+ X_offsets, X_block", kernel))
    assert loads + stores == LIGER_ROW_PASSES == 3
    cfg = replace(config(), loss=Loss.FUSED_LINEAR)
    graph = graph_for(folder, cfg)
    head, loss = (next(layer for layer in graph.nodes() if layer.name == name) for name in ("head", "loss"))
    fused_head, fused_loss = (timed_layer(graph, cfg, layer, s=S).cost() for layer in (head, loss))
    assert fused_head.forward.flops == head.cost().forward.flops + head.cost().backward.flops
    moved = evaluate(fused_head.forward.io_bytes, b=B, s=S, tp=1, sequence_parallel=False)
    assert moved == 3 * B * S * graph.dims.vocab * 2  # bf16 logits
    assert fused_loss.forward == fused_loss.backward == fused_head.backward == Work()
    assert timed_layer(graph, config(), head, s=S) is head  # the HF loss keeps the lowered costs


def test_fused_loss_is_faster_where_the_vocabulary_makes_the_loss_memory_bound():
    from solver.api import estimate as estimate_model

    knobs = {"micro_batch": 4, "precision": "bf16", "checkpoint": "full"}
    hf = estimate_model("Qwen/Qwen2.5-0.5B", "1xA10G", knobs, seq_len=2048)
    fused = estimate_model("Qwen/Qwen2.5-0.5B", "1xA10G", {**knobs, "loss": "fused-linear"}, seq_len=2048)
    # 152k-entry vocabulary: HF's upcast cross-entropy moves 44 bytes per logit (the lowering's count), Liger's 6;
    # the recomputed layers run Liger's fused RMSNorm, SwiGLU and RoPE kernels (graphs/liger.py): fewer launches
    assert fused.time.compute < hf.time.compute and fused.time.recompute < hf.time.recompute
