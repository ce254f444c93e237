"""The CPU forms of the GPU kernels a default Megatron-LM run uses (`graphs.te_kernels`): each computes what
megatron-core's own unfused code computes (real tensors, real gradients) and saves for backward what the cited
kernel saves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

import graphs.megatron as mg
from graphs.measure import transformers_config
from graphs.sources import resolve
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

S, B = 12, 2


def kernels_run(run: Any) -> list[str]:
    """The ops the lowering's recorder sees launch a kernel while `run()` executes, forward and backward."""
    from graphs.recorder import Recorder, launches_kernel

    with Recorder([]) as recorder:
        run()
    return [op.name for op in recorder.ops if launches_kernel(op)]


def saved_by(run: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the tensors autograd saves while `run()` executes."""
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return saved


@pytest.fixture(scope="module")
def attentions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    """The core attention of megatron's local spec and its TE flash form, same layer, real CPU weights (none)."""
    folder = write_config(tmp_path_factory.mktemp("te") / "llama", {**tiny_values("llama"), "num_hidden_layers": 1})
    config = transformers_config(resolve(str(folder)))
    cores = {}
    with mg.megatron_runtime("te"):
        for kernels in mg.KERNELS:
            model = mg.build_megatron(config, layers=1, dtype=torch.float32, kernels=kernels).to_empty(device="cpu")
            cores[kernels] = model.decoder.layers[0].self_attention.core_attention
    return cores


def _qkv(core: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    heads, groups = core.num_attention_heads_per_partition, core.num_query_groups_per_partition
    width = core.hidden_size_per_attention_head
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(S, B, n, width, generator=generator, requires_grad=True) for n in (heads, groups, groups))


def test_flash_core_attention_computes_megatrons_causal_attention_and_saves_what_flash_attention_saves(attentions):
    local, flash = attentions["local"], attentions["te"]
    assert local.num_query_groups_per_partition < local.num_attention_heads_per_partition  # GQA
    q, k, v = _qkv(local)
    with mg.megatron_runtime("local"):
        mask = torch.triu(torch.ones(S, S), diagonal=1).bool()[None, None]
        expected = local(q, k, v, mask)
    got = flash(q, k, v, None)
    assert got.shape == expected.shape == (S, B, local.hidden_size_per_partition)
    torch.testing.assert_close(got, expected)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (q, k, v)))
    # flash-attn's FlashAttnFunc: q, k, v (k and v per query group, not repeated), the output and the fp32
    # log-sum-exp of each query row; nothing of size s^2.
    heads, groups = local.num_attention_heads_per_partition, local.num_query_groups_per_partition
    width = local.hidden_size_per_attention_head
    assert sorted(saved_by(lambda: flash(q, k, v, None)), key=str) == sorted([
        ((B, heads, S, width), torch.float32), ((B, groups, S, width), torch.float32),
        ((B, groups, S, width), torch.float32), ((B, heads, S, width), torch.float32),
        ((B, heads, S), torch.float32)], key=str)


def test_fused_rope_computes_megatrons_unfused_rope_and_saves_only_the_frequencies():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from graphs.te_kernels import fused_rope

    generator = torch.Generator().manual_seed(1)
    t = torch.randn(S, B, 4, 16, generator=generator, requires_grad=True)
    freqs = torch.randn(S, 1, 1, 16, generator=generator)
    expected = _apply_rotary_pos_emb_bshd(t, freqs)
    got = fused_rope(t, freqs)
    torch.testing.assert_close(got, expected)
    weights = torch.randn(t.shape, generator=generator)
    torch.testing.assert_close(torch.autograd.grad((got * weights).sum(), t),
                               torch.autograd.grad((expected * weights).sum(), t))
    # TE's FusedRoPEFunc keeps the table only; the unfused code keeps cos and sin per call.
    assert saved_by(lambda: fused_rope(t, freqs)) == [(tuple(freqs.shape), torch.float32)]
    assert len(saved_by(lambda: _apply_rotary_pos_emb_bshd(t, freqs))) > 1
    # One kernel each way, as TE's fused_rope_forward / fused_rope_backward (the unfused code launches a dozen).
    assert [name for name in kernels_run(lambda: fused_rope(t, freqs).backward(weights)) if "te_rope" in name] == \
        ["fitplan.te_rope", "fitplan.te_rope_back"]


def test_megatrons_fused_swiglu_runs_eagerly_and_saves_only_its_input():
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    generator = torch.Generator().manual_seed(2)
    y = torch.randn(S, B, 2 * 8, generator=generator, requires_grad=True)
    with mg.megatron_runtime("te"):
        got = bias_swiglu_impl(y, None)
        grad = torch.autograd.grad(got.square().sum(), y)
        saved = saved_by(lambda: bias_swiglu_impl(y, None))
        launched = kernels_run(lambda: bias_swiglu_impl(y, None).sum().backward())
    gate, up = y.chunk(2, -1)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(grad, torch.autograd.grad((torch.nn.functional.silu(gate) * up).square().sum(), y))
    assert saved == [((S * B, 16), torch.float32)]  # the input, as bias_swiglu_impl flattens it (a view)
    assert [name for name in launched if "swiglu" in name] == ["fitplan.te_swiglu", "fitplan.te_swiglu_back"]
    assert not any("silu" in name or "sigmoid" in name for name in launched)
