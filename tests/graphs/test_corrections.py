"""Each place where the lowering reports what the CUDA kernel keeps instead of what the CPU kernel keeps."""

from __future__ import annotations

import pytest
import torch

from graphs import Checkpoint, Role, lower
from tests.graphs.reference import run_reference, write_config
from tests.graphs.tiny_configs import tiny_values

B, S = 3, 80


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("corrections")


def _lower(folder, name, values, **options):
    return lower(str(write_config(folder / name, values)), use_cache=False, **options)


def test_dropout_masks_count_one_byte_per_element_like_cuda_native_dropout(folder):
    # GPT-2 with residual and MLP dropout: each block has two dropout sites on (b, s, h) tensors. CUDA keeps a
    # bool mask per site (1 byte/element); the CPU kernel keeps it in the activation dtype (4 bytes in fp32).
    plain = tiny_values("gpt2")
    dropped = {**plain, "resid_pdrop": 0.1}
    without = _lower(folder, "nodrop", plain, dtype="float32").node("layers.1").cost().saved(B, S)
    with_masks = _lower(folder, "drop", dropped, dtype="float32").node("layers.1").cost().saved(B, S)
    assert with_masks - without == 2 * B * S * plain["n_embd"] * 1
    cpu = run_reference(dropped, b=B, s=S, dtype=torch.float32, checkpoint=False, attention="sdpa")
    assert cpu.layer_saved[1] - without == 2 * B * S * plain["n_embd"] * 4


def test_sdpa_attention_saves_no_sequence_squared_term_even_with_attention_dropout(folder):
    # GPUs run SDPA as flash attention (dropout applied in-kernel, no mask, no scores); CPU SDPA with dropout
    # would take the math path with (b, h, s, s) scores.
    values = {**tiny_values("gpt2"), "attn_pdrop": 0.1}
    graph = _lower(folder, "attn_drop", values, dtype="float32", attention="sdpa")
    saved = graph.node("layers.1").cost().saved
    assert all(j < 2 for (_, j, _), _ in saved.terms)
    eager = _lower(folder, "eager", values, dtype="float32", attention="eager").node("layers.1").cost().saved
    assert any(j == 2 for (_, j, _), _ in eager.terms)


def test_layer_norm_statistics_are_fp32_in_half_precision_like_cuda(folder):
    # Two LayerNorms per GPT-2 block each keep mean and rstd (b*s elements): fp32 on CUDA, bf16 on CPU.
    values = tiny_values("gpt2")
    graph = _lower(folder, "ln", values, dtype="bfloat16")
    cpu = run_reference(values, b=B, s=S, dtype=torch.bfloat16, checkpoint=False, attention=graph.attention)
    assert graph.node("layers.1").cost().saved(B, S) - cpu.layer_saved[1] == 2 * 2 * B * S * (4 - 2)


def test_loss_keeps_logits_upcast_to_fp32(folder):
    values = tiny_values("llama")
    graph = _lower(folder, "loss", values, dtype="bfloat16")
    # log_softmax saves its fp32 output: vocab * 4 bytes per token (plus the int64 shifted labels).
    assert graph.node("loss").cost().saved.as_dict()[(1, 1, 0)] == values["vocab_size"] * 4 + 8


def test_selective_checkpoint_recomputes_exactly_the_attention_core(folder):
    graph = _lower(folder, "sel", tiny_values("llama"), dtype="bfloat16")
    layer = graph.node("layers.1")
    none, selective = layer.cost(Checkpoint.NONE), layer.cost(Checkpoint.SELECTIVE)
    assert selective.recompute.flops(B, S) == none.forward.attention_flops(B, S) > 0
    assert selective.recompute.attention_flops == selective.recompute.flops
    assert selective.saved(B, S) < none.saved(B, S)
    full = layer.cost(Checkpoint.FULL)
    assert full.saved(B, S) == B * S * graph.dims.hidden * 2  # only the bf16 layer input
    assert full.recompute.flops(B, S) <= full.forward.flops(B, S)


def test_graph_is_a_chain_in_execution_order(folder):
    graph = _lower(folder, "chain", tiny_values("qwen2"), dtype="bfloat16")
    roles = [node.role for node in graph.nodes()]
    assert roles[0] is Role.EMBEDDING and roles[-1] is Role.LOSS
    assert roles.count(Role.DECODER) == 3
    assert list(graph.graph.edges) == [(a.name, b.name) for a, b in zip(graph.nodes(), graph.nodes()[1:], strict=False)]
