"""The megatron-core lowering against megatron-core's own GPTModel (local spec) run on fake tensors, measured with
torch's MemTracker only, at shapes the probes never used.

The reference builds the real model with `recompute_granularity` set in its TransformerConfig (megatron's own
`TransformerBlock._checkpointed_forward` and `SelfAttention._checkpointed_attention_forward` do the recompute),
where the lowering wraps trace layers itself. Both run inside `graphs.megatron.megatron_runtime` (megatron-core's
CUDA-only calls redirected to the CPU; with kernels="te", Transformer Engine's kernels in their CPU form) and with
the GPU RMSNorm kernel's autograd formula (`cuda_rms_norm`). Each kernel set is checked: the local spec's own, and
the TE flash attention, fused SwiGLU and fused RoPE a default Megatron-LM run uses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

pytest.importorskip("megatron.core")

import graphs.megatron as mg
from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, parse_cluster
from graphs import Checkpoint, LayerGraph, UnsupportedModel
from graphs.architectures import megatron_kind, supported
from graphs.measure import transformers_config
from graphs.sources import resolve
from graphs.titan import cuda_rms_norm
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

UNSEEN_B, UNSEEN_S = 3, 80  # probes use b in {2, 4} and s in {32, 64, 96}
# The lowering is 0.0-0.4% above MemTracker's peak at the shapes tried ((1-4) x (80-1024) tokens, every mode); with
# TE's kernels -0.6% to +0.4% (Llama and Qwen2, same shapes). Qwen3, Mixtral and Qwen3-MoE at the step shape: +0.01%
# to +0.81% (both kernel sets, every mode).
# Whole steps run at 256 tokens so that activations, not the optimizer step, bind.
TOLERANCE = 0.01
STEP_B, STEP_S = 2, 256
GRANULARITY = {Checkpoint.NONE: None, Checkpoint.FULL: "full", Checkpoint.SELECTIVE: "selective"}
KERNELS = tuple(mg.KERNELS)
# Every model type the architecture table lowers through megatron-core: Llama (the `folder` fixture), the other
# dense ones, and the MoE ones.
DENSE = [t for t in supported("megatron") if megatron_kind(t) == "dense" and t != "llama"]
MOE = [t for t in supported("megatron") if megatron_kind(t) == "moe"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    values = {**tiny_values("llama"), "num_hidden_layers": 2}
    return str(write_config(tmp_path_factory.mktemp("megatron") / "llama", values))


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two-layer tiny configs of the other architectures megatron-core's GPT layers run."""
    root = tmp_path_factory.mktemp("megatron")
    return {arch: str(write_config(root / arch, {**tiny_values(arch), "num_hidden_layers": 2}))
            for arch in (*DENSE, *MOE)}


@pytest.fixture(scope="module")
def moe_graphs(tiny_folders: dict[str, str]) -> dict[tuple[str, str], LayerGraph]:
    return {(arch, kernels): mg.lower_megatron(tiny_folders[arch], use_cache=False, kernels=kernels)
            for arch in MOE for kernels in KERNELS}


@pytest.fixture(scope="module")
def graphs(folder: str) -> dict[str, LayerGraph]:
    return {kernels: mg.lower_megatron(folder, use_cache=False, kernels=kernels) for kernels in KERNELS}


@pytest.fixture(scope="module")
def graph(graphs: dict[str, LayerGraph]) -> LayerGraph:
    return graphs["local"]


def _reference(folder: str, mode: Checkpoint, fake: FakeTensorMode, kernels: str) -> torch.nn.Module:
    config = transformers_config(resolve(folder))
    model = mg.build_megatron(config, layers=config.num_hidden_layers, granularity=GRANULARITY[mode], kernels=kernels)
    mg.to_fake(model, fake, torch.bfloat16)
    return model


def _kept(model: torch.nn.Module) -> list[Any]:
    """What megatron made at the first step and keeps: the attention global buffer and, for MoE models, the aux
    loss's backward scale and logging buffer."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

    moe = [MoEAuxLossAutoScaler.main_loss_backward_scale,
           *(entry["values"] for entry in get_moe_layer_wise_logging_tracker().values())]
    return [*parallel_state.get_global_memory_buffer().buffer.values(), *(t for t in moe if t is not None)]


def layer_saved(folder: str, mode: Checkpoint, *, b: int, s: int, kernels: str = "local") -> list[int]:
    """Bytes each layer's forward left alive (MemTracker: Post-Forward minus Pre-Forward); the RoPE table and the
    attention global buffer, which megatron makes at the first step and keeps, exist before."""
    with mg.megatron_runtime(kernels):
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        model = _reference(folder, mode, fake, kernels)
        with fake, cuda_rms_norm(), mg.routing(model):
            return kept_by_layers(model, b=b, s=s)


def kept_by_layers(model: torch.nn.Module, *, b: int, s: int) -> list[int]:
    """MemTracker's Post-Forward minus Pre-Forward of each decoder layer over one forward with labels (inside
    megatron's runtime, on fake or real tensors)."""
    layers = list(model.decoder.layers)
    tracker = MemTracker()
    tracker.track_external(model, *mg.prepare_step(model, b=b, s=s))
    with tracker:
        loss = mg.megatron_loss(model, b, s, model.vocab_size)
    stats = [tracker.memory_tracking[layer].snapshots for layer in layers]
    del loss
    return [_total(st["Post-Forward"][-1]) - _total(st["Pre-Forward"][-1]) for st in stats]


def step_peak(folder: str, mode: Checkpoint, *, b: int, s: int, kernels: str) -> int:
    """MemTracker's allocated peak over one training step of megatron's GPTModel (forward with labels, summed
    loss, backward, foreach AdamW, zero_grad) after a warm-up step; the RoPE table and the attention global
    buffer, which megatron keeps from the first step on, are tracked as external tensors."""
    with mg.megatron_runtime(kernels):
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        model = _reference(folder, mode, fake, kernels)
        with fake, cuda_rms_norm(), mg.routing(model):
            optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

            def step() -> None:
                mg.megatron_loss(model, b, s, model.vocab_size).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            model.rotary_pos_emb.forward.cache_clear()
            step()
            tracker = MemTracker()
            tracker.track_external(model, optimizer, model.rotary_pos_emb(s), *_kept(model))
            with tracker:
                step()
    return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


def _total(snapshot: dict[torch.device, dict[str, int]]) -> int:
    return sum(per_device["Total"] for per_device in snapshot.values())


@pytest.mark.slow
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", mg.MEGATRON_MODES)
def test_megatron_saved_bytes_match_what_memtracker_sees_each_layer_keep(mode, kernels, folder, graphs):
    # MemTracker sees what a layer's forward leaves alive: its saved tensors and its output. Every mode saves the
    # layer's input (the fused RMSNorm, or megatron's checkpoint), which existed before and is the output's size.
    assert [layer.cost(mode).saved(UNSEEN_B, UNSEEN_S) for layer in graphs[kernels].decoder_layers()] == \
        layer_saved(folder, mode, b=UNSEEN_B, s=UNSEEN_S, kernels=kernels)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", mg.MEGATRON_MODES)
def test_megatron_allocated_peak_matches_memtracker_over_a_training_step(mode, kernels, folder, graphs):
    config = Config(engine=Engine.DDP, precision=Precision.BF16, optimizer=Optimizer.ADAMW, micro_batch=STEP_B,
                    checkpoint=(mode,) * 2)
    predicted = estimate(graphs[kernels], parse_cluster("1xCPU"), Workload(seq_len=STEP_S, global_batch=STEP_B),
                         config)
    measured = step_peak(folder, mode, b=STEP_B, s=STEP_S, kernels=kernels)
    assert predicted.memory.allocated_peak == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("arch", DENSE)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", mg.MEGATRON_MODES)
def test_megatron_qwen_saved_bytes_and_peak_match_memtracker(mode, kernels, arch, tiny_folders):
    # Qwen2: the QKV bias (`add_qkv_bias`), tied embeddings, rope_theta 1e6. Qwen3: megatron's `qk_layernorm`
    # (RMSNorm over each head's queries and keys), no QKV bias.
    folder = tiny_folders[arch]
    assert_matches_megatron(mg.lower_megatron(folder, use_cache=False, kernels=kernels), folder, mode, kernels)


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", mg.MEGATRON_MODES)
def test_megatron_moe_saved_bytes_and_peak_match_memtracker(mode, kernels, arch, tiny_folders, moe_graphs):
    # Every MLP an MoE layer (router, dropless all-to-all dispatch, SequentialMLP experts, aux loss; Qwen3-MoE with
    # the query/key norm), run by megatron-core itself under `DroplessRouting` (balanced counts; the next test
    # checks them against real routing).
    assert_matches_megatron(moe_graphs[arch, kernels], tiny_folders[arch], mode, kernels)


def assert_matches_megatron(graph: LayerGraph, folder: str, mode: Checkpoint, kernels: str) -> None:
    """Each layer's saved bytes at the unseen shape equal what MemTracker sees it keep, and the allocated peak of a
    DDP step equals MemTracker's over megatron's own step within the tolerance."""
    assert [layer.cost(mode).saved(UNSEEN_B, UNSEEN_S) for layer in graph.decoder_layers()] == \
        layer_saved(folder, mode, b=UNSEEN_B, s=UNSEEN_S, kernels=kernels)
    config = Config(engine=Engine.DDP, precision=Precision.BF16, optimizer=Optimizer.ADAMW, micro_batch=STEP_B,
                    checkpoint=(mode,) * 2)
    predicted = estimate(graph, parse_cluster("1xCPU"), Workload(seq_len=STEP_S, global_batch=STEP_B), config)
    measured = step_peak(folder, mode, b=STEP_B, s=STEP_S, kernels=kernels)
    assert predicted.memory.allocated_peak == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", mg.MEGATRON_MODES)
def test_dropless_routing_saves_what_real_routing_saves(mode, tiny_folders):
    # The balanced split `DroplessRouting` answers is not what a router picks; what each MoE layer keeps for
    # backward must not depend on it. Real megatron-core on real CPU tensors (random weights, so an uneven split,
    # masked_select and .tolist() on real values) keeps exactly the bytes of the fake trace.
    folder = tiny_folders["mixtral"]
    fake = layer_saved(folder, mode, b=UNSEEN_B, s=UNSEEN_S)
    with mg.megatron_runtime("local"):
        model = mg.build_megatron(transformers_config(resolve(folder)), layers=2,
                                  granularity=GRANULARITY[mode])
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        model.bfloat16()
        counts = []
        for expert in model.decoder.layers[0].mlp.experts.local_experts:
            expert.register_forward_pre_hook(lambda module, args: counts.append(args[0].shape[0]))
        with cuda_rms_norm():
            real = kept_by_layers(model, b=UNSEEN_B, s=UNSEEN_S)
    top_k = tiny_values("mixtral")["num_experts_per_tok"]
    assert sum(counts) == UNSEEN_B * UNSEEN_S * top_k and len(set(counts)) > 1  # the real split is uneven
    assert real == fake


def test_selective_recompute_frees_exactly_the_local_attention_scores(graph):
    # megatron-core's local DotProductAttention keeps, per score (b * heads * s^2), the fp32 softmax output (4 B)
    # and its bf16 copy saved by the probs @ V bmm (2 B), and per layer the causal (s, s) bool mask saved by
    # masked_fill_; selective recompute keeps none of them. Powers are (b, s, 1/t).
    heads = tiny_values("llama")["num_attention_heads"]
    layer = graph.node("layers.1")
    plain = layer.cost(Checkpoint.NONE).saved.as_dict()
    selective = layer.cost(Checkpoint.SELECTIVE).saved.as_dict()
    assert plain[(1, 2, 1)] == 6 * heads and plain[(0, 2, 0)] == 1
    assert (1, 2, 1) not in selective and (0, 2, 0) not in selective
    assert layer.cost(Checkpoint.SELECTIVE).recompute.flops(UNSEEN_B, UNSEEN_S) > 0


def test_megatron_graph_has_the_transformers_models_parameters_and_runtime(graph):
    values = tiny_values("llama")
    hidden, ffn, vocab = values["hidden_size"], values["intermediate_size"], values["vocab_size"]
    qkv = (values["num_attention_heads"] + 2 * values["num_key_value_heads"]) * values["head_dim"]
    per_layer = hidden * qkv + values["num_attention_heads"] * values["head_dim"] * hidden + 3 * hidden * ffn
    per_layer += 2 * hidden
    assert [layer.param_count for layer in graph.decoder_layers()] == [per_layer] * 2
    assert graph.param_count == 2 * per_layer + vocab * hidden + hidden  # tied embeddings (Llama-3.2-1B)
    assert graph.runtime == "megatron"
    assert LayerGraph.from_json(graph.to_json()).to_json() == graph.to_json()


def test_models_megatrons_local_spec_does_not_run_are_refused(tmp_path):
    folder = write_config(tmp_path / "gpt2", tiny_values("gpt2"))
    with pytest.raises(UnsupportedModel, match="megatron"):
        mg.lower_megatron(str(folder), use_cache=False)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", mg.MEGATRON_MODES)
def test_megatron_saved_bytes_at_tp2_equal_the_model_one_tp_rank_holds(mode, kernels, graphs, tmp_path):
    # Without sequence parallelism a TP rank of megatron-core runs the layer with half the heads and query groups
    # and half the FFN width (ColumnParallelLinear linear_qkv/linear_fc1, RowParallelLinear linear_proj/fc2);
    # norms and the residual stream stay whole.
    graph = graphs[kernels]
    assert graph.tp_splits_activations and 2 in graph.tp_degrees
    values = {**tiny_values("llama"), "num_hidden_layers": 2}
    rank = {**values, **{k: values[k] // 2 for k in ("num_attention_heads", "num_key_value_heads",
                                                    "intermediate_size")}}
    ref = layer_saved(str(write_config(tmp_path / "rank", rank)), mode, b=UNSEEN_B, s=UNSEEN_S, kernels=kernels)
    assert [layer.cost(mode).saved(UNSEEN_B, UNSEEN_S, 2) for layer in graph.decoder_layers()] == ref
