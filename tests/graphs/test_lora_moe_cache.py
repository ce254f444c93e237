"""LoRA trainable counts against PEFT, MoE active FLOPs, and the on-disk lowering cache."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from graphs import LoraSpec, lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj")])
def test_lora_trainable_count_equals_peft_own_count(tmp_path, targets):
    values = tiny_values("llama")
    spec = LoraSpec(rank=8, alpha=16, targets=targets)
    graph = lower(str(write_config(tmp_path, values)), lora=spec, use_cache=False)
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):  # counting only; PEFT's device moves refuse fake tensors
        model = get_peft_model(AutoModelForCausalLM.from_config(copy.deepcopy(config)), spec.peft_config())
    trainable, total = model.get_nb_trainable_parameters()
    assert graph.trainable_count == trainable
    assert graph.param_count == total
    assert all(not p.trainable for p in graph.params() if "lora_" not in p.name)


def test_lora_base_weights_get_no_gradients_and_fewer_backward_flops(tmp_path):
    values = tiny_values("llama")
    full = lower(str(write_config(tmp_path / "full", values)), use_cache=False)
    lora = lower(str(write_config(tmp_path / "lora", values)), lora=LoraSpec(rank=4), use_cache=False)
    layer_full, layer_lora = full.node("layers.1").cost(), lora.node("layers.1").cost()
    assert layer_lora.grads(2, 64) < layer_full.grads(2, 64) / 5
    assert layer_lora.backward.flops(2, 64) < layer_full.backward.flops(2, 64)


def test_lora_adapters_run_in_the_training_dtype_under_bf16(tmp_path):
    # DeepSpeed (module.bfloat16()) and FSDP2 (param_dtype=bf16) run the adapters in bf16; fp32 adapters (PEFT's
    # autocast_adapter_dtype default) would save an fp32 copy of every adapted input, ~50% more than full
    # fine-tuning. The reference: a real PEFT model on fake tensors, cast as DeepSpeed casts it.
    values = tiny_values("llama")
    full = lower(str(write_config(tmp_path / "full", values)), dtype="bfloat16", use_cache=False)
    lora = lower(str(write_config(tmp_path / "lora", values)), dtype="bfloat16", lora=LoraSpec(rank=4),
                 use_cache=False)
    adapters = [p for p in lora.params() if "lora_" in p.name]
    assert adapters and all(p.itemsize == 2 for p in adapters)
    saved_full, saved_lora = full.node("layers.1").cost().saved(2, 64), lora.node("layers.1").cost().saved(2, 64)
    # A frozen linear layer keeps no input for a weight gradient; its adapter keeps the bf16 input once.
    assert saved_lora <= saved_full


def test_moe_forward_flops_follow_active_parameters(tmp_path):
    values = tiny_values("mixtral")
    graph = lower(str(write_config(tmp_path, values)), use_cache=False)
    layer = graph.node("layers.1")
    assert layer.moe is not None and layer.moe.experts == 4 and layer.moe.top_k == 2
    dense = layer.param_count - layer.moe.expert_params
    active = dense + layer.moe.expert_params * layer.moe.top_k // layer.moe.experts
    b, s = 2, 64
    matmul = layer.cost().forward.flops(b, s) - layer.cost().forward.attention_flops(b, s)
    router = 2 * b * s * values["hidden_size"] * layer.moe.experts  # the gate is a dense matmul too
    norms = sum(p.numel for p in layer.params if p.name.endswith("layernorm.weight"))
    assert matmul == 2 * b * s * (active - norms - layer.moe.experts * values["hidden_size"]) + router


def test_lowering_cache_round_trips_and_hits_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_config(tmp_path / "model", tiny_values("qwen2"))
    first = lower(str(folder), dtype="bfloat16")
    from graphs.lowering import lower_resolved

    lower_resolved.cache_clear()
    second = lower(str(folder), dtype="bfloat16")
    assert second.to_json() == first.to_json()
    assert list((tmp_path / "cache" / "lower").glob("*.json"))
    for node_a, node_b in zip(first.nodes(), second.nodes(), strict=False):
        assert node_a == node_b
