"""The torchtitan lowering against torchtitan's own model run on fake tensors, at a shape the probes never used."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("torchtitan")

from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, parse_cluster
from graphs import Checkpoint, LayerGraph, UnsupportedModel, lower
from graphs.architectures import supported, titan_family
from graphs.titan import TITAN_MODES, cuda_rms_norm, lower_titan
from tests.graphs.reference import run_reference, write_config
from tests.graphs.tiny_configs import tiny_values
from tests.graphs.titan_reference import layer_reference, step_peak

ARCHS = list(supported("torchtitan"))  # every model type the architecture table lowers through torchtitan
UNSEEN_B, UNSEEN_S = 3, 80  # probes use b in {2, 4} and s in {32, 64, 96}
# MemTracker counts every storage of the step; the model leaves out a few scalars (the loss, AdamW's step
# counters, which stay on the host on a GPU): under 0.1% here. Whole steps run at 256 tokens so that the
# activation peak, not the optimizer step (costmodels' model of it is 0.4-1.3% low on these tiny models), binds.
TOLERANCE = 0.01
STEP_S = 256


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("titan")
    return {arch: str(write_config(root / arch, tiny_values(arch))) for arch in ARCHS}


@pytest.fixture(scope="module")
def graphs(folders: dict[str, str]) -> dict[str, LayerGraph]:
    return {arch: lower_titan(folder, use_cache=False) for arch, folder in folders.items()}


@pytest.fixture(scope="module")
def plain_loss_graph(folders: dict[str, str]) -> LayerGraph:
    return lower_titan(folders["llama"], loss="plain", use_cache=False)


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
    # input). Every mode saves the layer's own input (the fused RMSNorm without checkpointing, the checkpoint
    # otherwise), which existed before the layer ran and is the output's size.
    ref = layer_reference(folders[arch], b=UNSEEN_B, s=UNSEEN_S, dtype=torch.bfloat16, mode=mode)
    assert [layer.cost(mode).saved(UNSEEN_B, UNSEEN_S) for layer in graphs[arch].decoder_layers()] == ref.saved


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
    b, s = 2, STEP_S
    config = Config(engine=Engine.DDP, precision=Precision.BF16, optimizer=Optimizer.ADAMW, micro_batch=b,
                    checkpoint=(mode,) * tiny_values(arch)["num_hidden_layers"])
    predicted = estimate(graphs[arch], parse_cluster("1xCPU"), Workload(seq_len=s, global_batch=b), config)
    measured = step_peak(folders[arch], b=b, s=s, dtype=torch.bfloat16, mode=mode)
    assert predicted.memory.allocated_peak == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [Checkpoint.NONE, Checkpoint.OP_SELECTIVE])
def test_titan_allocated_peak_with_the_plain_loss_matches_memtracker(mode, folders, plain_loss_graph):
    b, s = 2, STEP_S
    config = Config(engine=Engine.DDP, precision=Precision.BF16, optimizer=Optimizer.ADAMW, micro_batch=b,
                    checkpoint=(mode,) * tiny_values("llama")["num_hidden_layers"])
    predicted = estimate(plain_loss_graph, parse_cluster("1xCPU"), Workload(seq_len=s, global_batch=b), config)
    measured = step_peak(folders["llama"], b=b, s=s, dtype=torch.bfloat16, mode=mode, loss="plain")
    assert predicted.memory.allocated_peak == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.slow
def test_chunked_loss_keeps_only_the_hidden_state_gradient_for_backward(graphs, plain_loss_graph):
    # ChunkedLossWrapper runs each chunk's head + cross-entropy backward at once, sums the chunks' gradients of
    # the final hidden states in fp32 (GradAccumulator) and keeps a copy in their dtype (bf16) for the decoder's
    # backward; the fp32 buffer goes when the loss returns.
    hidden = tiny_values("llama")["hidden_size"]
    chunked, plain = graphs["llama"].node("loss").cost(), plain_loss_graph.node("loss").cost()
    assert chunked.saved(UNSEEN_B, UNSEEN_S) == UNSEEN_B * UNSEEN_S * hidden * 2
    assert chunked.fwd_peak(UNSEEN_B, UNSEEN_S) < plain.fwd_peak(UNSEEN_B, UNSEEN_S)


def test_rms_norm_correction_saves_what_the_fused_gpu_kernel_saves():
    # aten derivatives.yaml: _fused_rms_norm's backward takes input, rstd (fp32, one per row) and weight; the CPU
    # build decomposes the op and saves fp32 intermediates instead.
    def saved_bytes(x: torch.Tensor, weight: torch.Tensor) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage()._cdata != weight.untyped_storage()._cdata:
                storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-5)
        return sum(storages.values())

    with FakeTensorMode():
        x = torch.empty(3, 80, 64, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(64, dtype=torch.bfloat16, requires_grad=True)
        composite = saved_bytes(x, weight)
        with cuda_rms_norm():
            fused = saved_bytes(x, weight)
            out = torch.nn.functional.rms_norm(x, (64,), weight, 1e-5)
            out.sum().backward()
    assert fused == 3 * 80 * (64 * 2 + 4) < composite
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


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
    assert [layer.cost(mode).saved(UNSEEN_B, UNSEEN_S, 2) for layer in graph.decoder_layers()] == ref.saved


def test_lower_with_the_torchtitan_runtime_is_the_torchtitan_lowering(folders, graphs):
    graph = lower(folders["llama"], runtime="torchtitan", use_cache=False)
    assert graph.runtime == "torchtitan"
    assert graph.to_json() == graphs["llama"].to_json()
    with pytest.raises(UnsupportedModel, match="LoRA"):
        lower(folders["llama"], runtime="torchtitan", autocast="bfloat16")


def test_titan_moe_layers_carry_their_experts_and_stay_at_tp_1(graphs):
    """Qwen3-MoE through torchtitan's own MoE block: every layer routes top-k of its experts, whose stacked
    weights (experts, out, in) are what expert parallelism divides; TP stays 1 (torchtitan's expert-tensor-parallel
    split is not measured)."""
    values = tiny_values("qwen3_moe")
    graph = graphs["qwen3_moe"]
    experts, top_k, width, hidden = (values[k] for k in ("num_experts", "num_experts_per_tok",
                                                          "moe_intermediate_size", "hidden_size"))
    assert graph.tp_degrees == (1,)
    for layer in graph.decoder_layers():
        assert (layer.moe.experts, layer.moe.top_k) == (experts, top_k)
        stacks = [p for p in layer.params if len(p.shape) == 3]
        assert sorted(p.shape for p in stacks) == sorted([(experts, width, hidden), (experts, hidden, width),
                                                          (experts, width, hidden)])
        assert layer.moe.expert_params == sum(p.numel for p in stacks)


def _titan_block(folder: str) -> torch.nn.Module:
    """torchtitan's first block of the config in `folder`, on the meta device."""
    from graphs.measure import transformers_config
    from graphs.sources import resolve
    from graphs.titan import build_titan, titan_config

    config = transformers_config(resolve(folder))
    return build_titan(titan_config(config, family=titan_family(config.model_type), layers=1))


def _real_block_and_inputs(folder: str, b: int, s: int) -> tuple[torch.nn.Module, tuple, dict]:
    """torchtitan's first block on real CPU bf16 tensors (values random: what is saved depends on shapes only), and
    the inputs the model passes it, captured from a real forward."""
    model = _titan_block(folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():  # parameters in the training dtype; the RoPE cache stays complex64
            param.data = torch.randn_like(param, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        for buffer in model.buffers():
            buffer.copy_(torch.randn_like(buffer))
    block = next(iter(model.layers.values()))
    seen: list[tuple[tuple, dict]] = []
    handle = block.register_forward_pre_hook(lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, model.lm_head.out_features, (b, s)), torch.arange(s).repeat(b, 1), None)
    handle.remove()
    args, kwargs = seen[0]
    args = (args[0].detach().clone().requires_grad_(True), *args[1:])
    return block, args, kwargs


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_compiled_titan_block_saves_what_inductor_saves(arch, folders):
    # The reference: a real `torch.compile(backend="inductor")` of torchtitan's block on CPU (kernels generated and
    # run), tensor for tensor against the block as the compiled lowering traces it on fake tensors. Both run the CPU
    # RMSNorm: the fused kernel's backward (`cuda_rms_norm`) has no CPU implementation to run for real. The MoE
    # block is left out: traced as torchtitan compiles it (fullgraph, `capture_scalar_outputs`), Dynamo with
    # AOTAutograd and Inductor's partitioner saves exactly what the fake compiled block saves, but Inductor's
    # generated forward then returns one more (tokens, hidden) buffer per block: the base its fused kernel writes
    # for torchtitan's `deterministic_scatter_add` (the combine), an extern kernel (checked at b=3, s=80 on
    # Qwen3-MoE, CPU Inductor). That is why the lowering refuses it compiled and prices it eager.
    from graphs.compiled import compile_forward
    from graphs.fake import to_fake
    from tests.graphs.test_compiled import saved

    torch.manual_seed(0)
    block, args, kwargs = _real_block_and_inputs(folders[arch], UNSEEN_B, UNSEEN_S)
    leaves = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    outside = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers(), *leaves)}
    real = saved(lambda: torch.compile(block, backend="inductor")(*args, **kwargs), outside)
    eager = saved(lambda: block(*args, **kwargs), outside)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _titan_block(folders[arch])
    to_fake(model, mode, param_dtype=torch.bfloat16)
    fake_block = next(iter(model.layers.values()))
    compile_forward(fake_block)
    with mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fargs[0].requires_grad_(True)
        fkwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fleaves = [t for t in (*fargs, *fkwargs.values()) if isinstance(t, torch.Tensor)]
        outside = {id(t.untyped_storage()) for t in (*fake_block.parameters(), *fake_block.buffers(), *fleaves)}
        fake = saved(lambda: fake_block(*fargs, **fkwargs), outside)
    assert fake == real
    assert sum(n for *_, n in fake) < sum(n for *_, n in eager)  # the partitioner recomputes the cheap ops


@pytest.mark.slow
def test_the_compiled_titan_lowering_saves_less_only_where_blocks_compile(folders, graphs):
    # At a shape the probes never used, each layer saves what saved-tensor hooks see it save in torchtitan's own model
    # with every block compiled (the compiled block checked against Inductor above); checkpointed blocks save what
    # they save eager; the work (FLOPs, bytes moved, kernels) stays the eager trace's, which the time model fuses.
    compiled = lower_titan(folders["llama"], use_cache=False, compiled=True)
    eager = graphs["llama"]
    ref = layer_reference(folders["llama"], b=UNSEEN_B, s=UNSEEN_S, dtype=torch.bfloat16, mode=Checkpoint.NONE,
                          compiled=True)
    assert [layer.cost(Checkpoint.NONE).saved(UNSEEN_B, UNSEEN_S) for layer in compiled.decoder_layers()] == ref.hooked
    for plain, fused in zip(eager.decoder_layers(), compiled.decoder_layers(), strict=True):
        assert fused.cost(Checkpoint.NONE).saved(UNSEEN_B, UNSEEN_S) < plain.cost(Checkpoint.NONE).saved(UNSEEN_B,
                                                                                                        UNSEEN_S)
        for mode in (Checkpoint.FULL, Checkpoint.OP_SELECTIVE):
            assert fused.cost(mode).saved(UNSEEN_B, UNSEEN_S) == plain.cost(mode).saved(UNSEEN_B, UNSEEN_S)
        for mode in TITAN_MODES:
            assert fused.cost(mode).forward == plain.cost(mode).forward
    with pytest.raises(UnsupportedModel, match="compiled MoE"):
        lower_titan(folders["qwen3_moe"], use_cache=False, compiled=True)
