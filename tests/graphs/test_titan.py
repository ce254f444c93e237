"""The torchtitan lowering against torchtitan's own model run on fake tensors, at a shape the probes never used."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, parse_cluster
from graphs import Checkpoint, LayerGraph, UnsupportedModel
from graphs.titan import TITAN_MODES, lower_titan
from tests.graphs.reference import run_reference, write_config
from tests.graphs.tiny_configs import tiny_values
from tests.graphs.titan_reference import layer_reference, step_peak

ARCHS = ["llama", "qwen3"]
UNSEEN_B, UNSEEN_S = 3, 80  # probes use b in {2, 4} and s in {32, 64, 96}
# MemTracker counts every storage of the step; the model leaves out a few scalars (the loss, AdamW's step
# counters, which stay on the host on a GPU): under 0.7% on these tiny models, as in the HF reference tests.
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("titan")
    return {arch: str(write_config(root / arch, tiny_values(arch))) for arch in ARCHS}


@pytest.fixture(scope="module")
def graphs(folders: dict[str, str]) -> dict[str, LayerGraph]:
    return {arch: lower_titan(folder, use_cache=False) for arch, folder in folders.items()}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_titan_saved_bytes_without_checkpointing_match_saved_tensor_hooks(arch, folders, graphs):
    ref = layer_reference(folders[arch], b=UNSEEN_B, s=UNSEEN_S, dtype=torch.bfloat16, mode=Checkpoint.NONE)
    lowered = [layer.cost(Checkpoint.NONE).saved(UNSEEN_B, UNSEEN_S) for layer in graphs[arch].decoder_layers()]
    assert lowered == ref.hooked


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", TITAN_MODES)
def test_titan_saved_bytes_match_what_memtracker_sees_each_layer_keep(arch, mode, folders, graphs):
    # MemTracker sees what a layer's forward leaves alive: its saved tensors and its output (the next layer's
    # input). A checkpointed layer saves its own input, which existed before it ran and is the output's size.
    graph = graphs[arch]
    ref = layer_reference(folders[arch], b=UNSEEN_B, s=UNSEEN_S, dtype=torch.bfloat16, mode=mode)
    output = graph.node("layers.0").boundary(UNSEEN_B, UNSEEN_S)
    kept = [layer.cost(mode).saved(UNSEEN_B, UNSEEN_S) + (output if mode is Checkpoint.NONE else 0)
            for layer in graph.decoder_layers()]
    assert kept == ref.saved


@pytest.mark.slow
def test_op_selective_keeps_the_outputs_torchtitans_policy_saves(graphs):
    # torchtitan's SelectiveAC keeps attention's output and fp32 logsumexp and the 1st, 3rd and 5th matmul of a
    # block (wqkv, w1, w2); wo and w3 are recomputed. With the layer input the checkpoint keeps, per token:
    values = tiny_values("llama")
    hidden, heads, kv, head_dim, ffn = (values[k] for k in ("hidden_size", "num_attention_heads",
                                                            "num_key_value_heads", "head_dim", "intermediate_size"))
    per_token = 2 * (hidden + (heads + 2 * kv) * head_dim + heads * head_dim + ffn + hidden) + 4 * heads
    layer = graphs["llama"].node("layers.1")
    cost = layer.cost(Checkpoint.OP_SELECTIVE)
    assert cost.saved(UNSEEN_B, UNSEEN_S) == UNSEEN_B * UNSEEN_S * per_token
    recomputed_matmuls = 2 * UNSEEN_B * UNSEEN_S * (heads * head_dim * hidden + hidden * ffn)
    assert cost.recompute.flops(UNSEEN_B, UNSEEN_S) == recomputed_matmuls
    assert cost.forward.flops == layer.cost(Checkpoint.NONE).forward.flops


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", TITAN_MODES)
def test_titan_allocated_peak_matches_memtracker_over_a_training_step(arch, mode, folders, graphs):
    b, s = 2, 96
    config = Config(engine=Engine.DDP, precision=Precision.BF16, optimizer=Optimizer.ADAMW, micro_batch=b,
                    checkpoint=(mode,) * tiny_values(arch)["num_hidden_layers"])
    predicted = estimate(graphs[arch], parse_cluster("1xCPU"), Workload(seq_len=s, global_batch=b), config)
    measured = step_peak(folders[arch], b=b, s=s, dtype=torch.bfloat16, mode=mode)
    assert predicted.memory.allocated_peak == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.parametrize("arch", ARCHS)
def test_titan_model_has_the_transformers_models_parameters(arch, folders, graphs):
    ref = run_reference(tiny_values(arch), b=2, s=16, dtype=torch.bfloat16, checkpoint=False, attention="sdpa")
    assert graphs[arch].param_count == ref.param_total
    assert [layer.param_count for layer in graphs[arch].decoder_layers()] == ref.param_layers


def test_titan_graph_round_trips_through_json_with_its_runtime(graphs):
    graph = graphs["llama"]
    again = LayerGraph.from_json(graph.to_json())
    assert again.runtime == "torchtitan"
    assert again.to_json() == graph.to_json()
    assert graph.checkpoint_modes() == (Checkpoint.NONE, Checkpoint.FULL, Checkpoint.OP_SELECTIVE)


def test_models_torchtitan_does_not_have_are_refused(tmp_path):
    folder = write_config(tmp_path / "gpt2", tiny_values("gpt2"))
    with pytest.raises(UnsupportedModel, match="torchtitan"):
        lower_titan(str(folder), use_cache=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", TITAN_MODES)
def test_titan_saved_bytes_at_tp2_equal_the_model_one_tp_rank_holds(mode, graphs, tmp_path):
    # Without sequence parallelism a TP rank of torchtitan's plan runs the block with half the heads and half
    # the FFN width (column-wise wqkv/w1/w3, row-wise wo/w2); norms and the residual stream stay whole.
    graph = graphs["llama"]
    assert graph.tp_splits_activations and 2 in graph.tp_degrees
    values = tiny_values("llama")
    rank = {**values, **{k: values[k] // 2 for k in ("num_attention_heads", "num_key_value_heads",
                                                    "intermediate_size")}}
    ref = layer_reference(str(write_config(tmp_path / "rank", rank)), b=UNSEEN_B, s=UNSEEN_S,
                          dtype=torch.bfloat16, mode=mode)
    output = graph.node("layers.0").boundary(UNSEEN_B, UNSEEN_S)
    kept = [layer.cost(mode).saved(UNSEEN_B, UNSEEN_S, 2) + (output if mode is Checkpoint.NONE else 0)
            for layer in graph.decoder_layers()]
    assert kept == ref.saved
