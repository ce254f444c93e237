"""Expert parallelism against independent references: per-rank states of a tiny Mixtral against the HF model's own
tensors sliced as EP slices them (meta device) and a real AdamW's states; the experts' saved activations against
saved-tensor hooks over transformers' experts module; Mixtral-8x22B's expert bytes from its config."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, lowering_for, parse_cluster
from costmodels import expert_parallel as ep_model
from costmodels.estimator import InvalidConfig
from costmodels.states import model_states
from graphs import Checkpoint, LayerGraph, lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

TOP_K = 2


def _values(arch: str = "mixtral") -> dict:
    return tiny_values(arch)


@functools.cache
def _tiny_graph(folder: str, arch: str = "mixtral", dtype: str = "float32") -> LayerGraph:
    return lower(str(write_config(Path(folder) / arch, _values(arch))), dtype=dtype,
                 autocast=None, attention="sdpa", use_cache=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LayerGraph:
    """The tiny Mixtral (4 experts, top-2) lowered in fp32, as DDP with fp32 precision runs it."""
    dtype, autocast = lowering_for(Config(engine=Engine.DDP, precision=Precision.FP32))
    assert (dtype, autocast) == ("float32", None)
    return _tiny_graph(str(tmp_path_factory.mktemp("ep")))


def _hf_model(device: str, arch: str = "mixtral") -> torch.nn.Module:
    fields = dict(_values(arch))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _ep_local(name: str, tensor: torch.Tensor, ep: int, rank: int) -> torch.Tensor:
    """What EP rank `rank` keeps of a parameter: its slice of the experts of a stacked expert tensor (as
    Megatron's and torchtitan's expert parallelism place them: experts rank * E / ep onward), the rest whole."""
    if ".experts." in name and tensor.dim() == 3:
        local = tensor.shape[0] // ep
        return tensor[rank * local:(rank + 1) * local]
    return tensor


def _config(ep: int, **kwargs) -> Config:
    return Config(engine=Engine.DDP, precision=Precision.FP32, optimizer=Optimizer.ADAMW, dp=ep, ep=ep, **kwargs)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_parameter_bytes_equal_hf_tensors_sliced_by_ep_rank(tiny, ep):
    # Exact: both sides count whole elements of the same slices (meta tensors carry shape and dtype).
    model = _hf_model("meta")
    for rank in range(ep):
        local = sum(_ep_local(n, p, ep, rank).numel() * p.element_size() for n, p in model.named_parameters())
        assert model_states(tiny, _config(ep)).params == local


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_optimizer_bytes_equal_a_real_adamw_on_the_local_experts(tiny, ep):
    # A real torch.optim.AdamW (foreach, as on CUDA) stepped once over rank 0's tensors on the CPU; exact bytes of
    # exp_avg and exp_avg_sq (the `step` counters live on the host, as fitplan counts them for plain AdamW).
    model = _hf_model("cpu")
    params = [torch.nn.Parameter(_ep_local(n, p.detach(), ep, 0).clone()) for n, p in model.named_parameters()]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    opt.step()
    held = sum(opt.state[p][k].numel() * opt.state[p][k].element_size() for p in params
               for k in ("exp_avg", "exp_avg_sq"))
    assert model_states(tiny, _config(ep)).optimizer == held


def test_expert_states_shard_over_the_expert_data_parallel_ranks(tiny):
    # 8 data-parallel ranks, ep=2: rank 0 keeps 2 of the 4 experts, their optimizer states split over the 4
    # expert-data-parallel ranks; every other tensor's over all 8 (DeepSpeed-MoE keeps expert parameters in their
    # own groups). fp32 AdamW: two 4-byte moments per element, no master copy.
    config = Config(engine=Engine.DEEPSPEED, zero=1, precision=Precision.FP32, dp=8, ep=2)
    model = _hf_model("meta")
    expected = 0
    for name, p in model.named_parameters():
        local = _ep_local(name, p, 2, 0)
        ranks = 4 if local is not p else 8
        expected += 8 * -(-local.numel() // ranks)
    assert model_states(tiny, config).optimizer == expected


def test_ep_1_changes_nothing(tiny):
    for engine, zero in ((Engine.DDP, 0), (Engine.DEEPSPEED, 1), (Engine.DEEPSPEED, 3), (Engine.FSDP2, 3)):
        config = Config(engine=engine, zero=zero, precision=Precision.FP32, dp=4)
        assert model_states(tiny, replace(config, ep=1)) == model_states(tiny, config)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_expert_saved_bytes_equal_saved_tensor_hooks_over_hf_experts(tmp_path, arch):
    # transformers' grouped-mm experts (bf16, as the lowering traces MoE models) on the CPU; what autograd saves
    # for backward, parameters excluded. Tolerance: the per-expert token counts (E int32 values) are a constant the
    # model leaves out.
    graph = _tiny_graph(str(tmp_path), arch)
    layer = next(layer for layer in graph.decoder_layers() if layer.moe)
    fields = dict(_values(arch))
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, experts_implementation="grouped_mm")
    experts = next(m.mlp.experts for m in model.model.layers if hasattr(m.mlp, "experts"))
    own = {p.untyped_storage().data_ptr() for p in experts.parameters()}
    b, s = 2, 32
    tokens = torch.randn(b * s, hf_config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    index = torch.stack([torch.randperm(layer.moe.experts)[:layer.moe.top_k] for _ in range(b * s)])
    weights = torch.rand(b * s, layer.moe.top_k, dtype=torch.bfloat16)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(tokens, index, weights)
    config = Config(engine=Engine.FSDP2, zero=3, dp=2, ep=2)
    predicted = ep_model.expert_saved_bytes(layer, config, b=b, s=s, hidden=graph.dims.hidden, itemsize=2)
    assert 0 <= sum(saved.values()) - predicted <= 4 * layer.moe.experts


def test_dispatch_sends_every_token_expert_pair_once(tiny):
    layer = next(layer for layer in tiny.decoder_layers() if layer.moe)
    config = Config(engine=Engine.FSDP2, zero=3, dp=4, ep=4)
    assert ep_model.dispatch_bytes(layer, config, b=2, s=16, hidden=128, itemsize=2) == 2 * 16 * TOP_K * 128 * 2
    assert ep_model.dispatch_bytes(layer, _config(1), b=2, s=16, hidden=128, itemsize=2) == 0


def test_ep_group_leaves_the_node_once_tp_times_ep_exceeds_it():
    cluster = parse_cluster("8x8xH100")
    assert not ep_model.ep_group(cluster, 1, 8).spans_nodes
    assert not ep_model.ep_group(cluster, 2, 4).spans_nodes
    assert ep_model.ep_group(cluster, 2, 8).spans_nodes
    assert ep_model.ep_group(cluster, 2, 8).per_node == 4


def test_expert_dp_group_is_tp_times_ep_apart():
    # Megatron's expert rank order tp-ep-dp-pp: with tp=2, ep=8 the 4 expert-data-parallel peers of a rank are 16
    # ranks apart, one per node; with tp=1, ep=2 and 16 ranks, 4 of the 8 peers share a node.
    cluster = parse_cluster("8x8xH100")
    group = ep_model.expert_dp_group(cluster, Config(engine=Engine.DEEPSPEED, zero=1, tp=2, dp=32, ep=8))
    assert (group.size, group.spans_nodes, group.per_node) == (4, True, 1)
    group = ep_model.expert_dp_group(parse_cluster("2x8xH100"), Config(engine=Engine.DEEPSPEED, zero=1, dp=16, ep=2))
    assert (group.size, group.spans_nodes, group.per_node) == (8, True, 4)


def test_refusals_name_the_experts_and_dense_models(tiny):
    assert ep_model.refusals(tiny, _config(1)) == []
    assert ep_model.refusals(tiny, _config(4)) == []
    assert "divide the 4 experts" in ep_model.refusals(tiny, _config(8))[0]
    # megatron-core's TransformerConfig refuses expert parallelism with tensor parallelism but no sequence parallel
    assert "sequence_parallel" in ep_model.refusals(tiny, _config(2, tp=2))[0]
    assert ep_model.refusals(tiny, _config(2, tp=2, sequence_parallel=True)) == []
    assert ep_model.valid_degrees(tiny, 8) == [1, 2, 4]


def test_estimate_refuses_ep_not_dividing_the_experts(tiny):
    cluster = parse_cluster("8xH100")
    with pytest.raises(InvalidConfig) as error:
        estimate(tiny, cluster, Workload(seq_len=64, global_batch=8), _config(8))
    assert "experts" in str(error.value) and error.value.hint


def test_estimate_refuses_ep_on_a_dense_model(tmp_path):
    graph = _tiny_graph(str(tmp_path), "llama")
    with pytest.raises(InvalidConfig) as error:
        estimate(graph, parse_cluster("2xH100"), Workload(seq_len=64, global_batch=2), _config(2))
    assert "dense" in str(error.value)


@functools.cache
def _mixtral() -> LayerGraph:
    return lower("mistralai/Mixtral-8x22B-v0.1", dtype="bfloat16")


def test_mixtral_8x22b_expert_parameters_per_gpu_fall_by_ep():
    # The expert bytes from the published config alone: layers x experts x 3 matrices of hidden x intermediate
    # (w1, w2, w3), halved by tp=2, 2 bytes each. DeepSpeed ZeRO-1 keeps 16-bit parameters whole on every rank.
    fields = _mixtral().dims
    expert_bytes = fields.layers * fields.experts * 3 * fields.hidden * fields.intermediate // 2 * 2
    params = {ep: model_states(_mixtral(), Config(engine=Engine.DEEPSPEED, zero=1, tp=2, dp=32, ep=ep)).params
              for ep in (1, 8)}
    assert params[1] - params[8] == expert_bytes - expert_bytes // 8
    assert params[1] / params[8] > 6  # the attention, embeddings and routers (about 2.5% of the model) stay whole


def test_mixtral_8x22b_estimate_with_ep_adds_exposed_all_to_all():
    graph = _mixtral()
    cluster = parse_cluster("8x8xH100")
    modes = (Checkpoint.FULL,) * graph.dims.layers
    results = {}
    for ep in (1, 8):
        config = Config(engine=Engine.DEEPSPEED, zero=1, tp=2, dp=32, ep=ep, micro_batch=1, grad_accum=2,
                        checkpoint=modes, sequence_parallel=True)
        results[ep] = estimate(graph, cluster, Workload(seq_len=4096, global_batch=64), config)
    details = dict(results[8].time.details)
    assert dict(results[1].time.details).get("ep_all_to_all_exposed", 0.0) == 0.0
    assert details["ep_all_to_all_exposed"] > 0
    assert results[8].memory.parameters < results[1].memory.parameters / 6
    # ZeRO-1 keeps full 16-bit gradients: the local experts' only under EP (the lowering traced all experts').
    fields = graph.dims
    expert_bytes = fields.layers * fields.experts * 3 * fields.hidden * fields.intermediate // 2 * 2
    fall = results[1].memory.gradients - results[8].memory.gradients
    assert fall == pytest.approx(expert_bytes * 7 / 8, rel=0.01)  # 1%: the fp32 partition is the same either way
    assert any(f"x{ep_model.ROUTING_IMBALANCE:g}" in note for note in results[8].notes)


def test_mixtral_8x22b_expert_gradients_are_not_reduced_when_ep_takes_every_data_parallel_rank():
    # tp=8, dp=8, ep=8: each rank holds one expert whole and no other rank holds it, so only the dense weights
    # (attention, embeddings, routers: under 5% of Mixtral-8x22B) are reduced across data-parallel ranks.
    graph = _mixtral()
    cluster = parse_cluster("8x8xH100")
    totals = {}
    for ep in (1, 8):
        config = Config(engine=Engine.DEEPSPEED, zero=1, tp=8, dp=8, ep=ep, micro_batch=1, grad_accum=1,
                        checkpoint=(Checkpoint.FULL,) * graph.dims.layers, sequence_parallel=True)
        result = estimate(graph, cluster, Workload(seq_len=4096, global_batch=8), config)
        totals[ep] = dict(result.time.details)["dp_collectives_total"]
    assert 0 < totals[8] < 0.05 * totals[1]
