"""Megatron's vocabulary-parallel cross-entropy against megatron-core's own code, every storage followed on real CPU
tensors (`LiveBytes`), and what it changes in the estimate (issue 37: published Megatron and Mist runs called "does
not fit" were priced with transformers' upcast loss).

megatron-core 0.16's `vocab_parallel_cross_entropy` runs as installed (one rank, torch's fake process group), with
the head as `GPTModel.compute_language_model_loss` calls it. The `--fp16-lm-cross-entropy` path that Megatron-LM
core_r0.4.0 and Mist's runtime ran is the same installed code with its two later changes undone by a source edit
(no `.float()`, the max subtracted out of place), as the liger test edits liger's source.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from costmodels import Config, Engine, Precision, Workload, lowering_for
from costmodels.loss import (
    HeadShape,
    Loss,
    head_shape,
    hf_loss,
    loss_nodes,
    loss_terms,
    net,
    peak,
    refusals,
    replace_head_nodes,
    vocab_parallel_loss,
)
from costmodels.memory import allocated_peak, memory_terms
from graphs import lower
from graphs.megatron import cpu_runtime
from tests.costmodels.test_loss import LiveBytes
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

pytest.importorskip("megatron.core")

# core_r0.4.0 (Mist's Megatron-LM, 38879f8) before megatron-core upcast inside the function and subtracted in place.
LEGACY_EDITS = {"vocab_parallel_logits = vocab_parallel_logits.float()\n": "\n",
                "vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)":
                    "vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)"}


@pytest.fixture(scope="module")
def megatron_losses():
    """megatron-core's `compute_language_model_loss` over its installed cross-entropy (upcast) or over the legacy
    fp16 one (the source edits above); call them inside `graphs.megatron.cpu_runtime` (one rank)."""
    with cpu_runtime():  # megatron-core warns on import that TE and apex are absent
        from megatron.core.models.common.language_module.language_module import LanguageModule
        from megatron.core.tensor_parallel import cross_entropy
    source = inspect.getsource(cross_entropy)
    for old, new in LEGACY_EDITS.items():
        assert old in source, f"megatron-core changed: {old!r} not found"
        source = source.replace(old, new)
    legacy = {"__name__": cross_entropy.__name__}
    exec(compile(source, cross_entropy.__file__, "exec"), legacy)
    owner = SimpleNamespace(config=SimpleNamespace(cross_entropy_loss_fusion=False))

    def run(upcast: bool):
        def loss(labels, logits):
            if upcast:
                return LanguageModule.compute_language_model_loss(owner, labels, logits)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr("megatron.core.tensor_parallel.vocab_parallel_cross_entropy",
                              legacy["vocab_parallel_cross_entropy"])
                return LanguageModule.compute_language_model_loss(owner, labels, logits)
        return loss

    return run


@pytest.mark.parametrize(("dtype", "b", "upcast"), [(torch.bfloat16, 2, True), (torch.float32, 2, True),
                                                   (torch.bfloat16, 3, False), (torch.float32, 1, False)])
def test_vocab_parallel_sequence_matches_megatron_core(dtype, b, upcast, megatron_losses):
    s, hidden, vocab = 64, 96, 1536
    c = torch.tensor([], dtype=dtype).element_size()
    weight = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=dtype))
    x0 = torch.randn(s, b, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s))
    compute = megatron_losses(upcast)
    with cpu_runtime(), LiveBytes(weight, x0, labels) as mode:
        h = x0.clone()  # the final norm's output, (s, b, h) as megatron's layers pass it
        start = mode.reset_peak()
        loss = compute(labels, F.linear(h, weight)).sum()
        del h
        forward_peak, kept = mode.peak - start, mode.live - start
        before = mode.reset_peak()
        loss.backward()
        backward_peak = mode.peak - before
    x = HeadShape(b=b, s=s, hidden=hidden, vocab=vocab, itemsize=c, weight_itemsize=c,
                  weight_grad=vocab * hidden * c, tied=False)
    memory = vocab_parallel_loss(x, upcast=upcast)
    assert peak(memory.forward) == pytest.approx(forward_peak, abs=64)  # scalars: the loss and its sum
    assert net(memory.forward) - memory.released == pytest.approx(kept, abs=64)
    assert peak(memory.backward) == pytest.approx(backward_peak, abs=64)


def _graph(tmp_path, config: Config):
    dtype, autocast = lowering_for(config)
    values = {**tiny_values("gpt2"), "vocab_size": 4096, "tie_word_embeddings": False}
    return lower(str(write_config(tmp_path / "gpt2", values)), dtype=dtype, autocast=autocast, attention="sdpa")


def test_megatron_engine_prices_megatron_loss_on_the_hf_lowering(tmp_path):
    """GPT-2 is not lowered by megatron-core, so Megatron's engine prices it on the HF code: its head and loss are
    megatron's (fp32 in place: one fp32 and one 16-bit copy of the logits at most), not the traced transformers'
    loss (`hf_loss`, which equals the lowering: log-softmax, its gradient and the nll gradient in fp32); the legacy
    fp16 path keeps one 16-bit copy less."""
    config = Config(engine=Engine.MEGATRON, precision=Precision.BF16_MIXED, micro_batch=2)
    graph = _graph(tmp_path, config)
    seq = 256
    terms = memory_terms(graph, Workload(seq_len=seq, global_batch=2), config)
    modes = config.layer_modes(len(graph.decoder_layers()))
    x = head_shape(graph, config, b=2, s=seq)
    hf = allocated_peak(replace_head_nodes(terms, *loss_nodes(hf_loss(x), x)), modes)[0]
    core = allocated_peak(terms, modes)[0]
    legacy = allocated_peak(loss_terms(graph, config, terms, Loss.MEGATRON_FP16, seq_len=seq), modes)[0]
    logits = x.tokens * x.vocab
    assert hf - core >= 4 * logits  # at least two fp32 copies of the logits fewer at the loss's peak
    assert core - legacy >= logits
    ddp = Config(engine=Engine.DDP, precision=Precision.BF16_MIXED, micro_batch=2)
    assert refusals(Loss.MEGATRON_FP16, graph, ddp) and not refusals(Loss.MEGATRON_FP16, graph, config)


def megatron_buffer_bytes(elements: int, dtype: torch.dtype, *, fp32_reduce: bool, distributed: bool) -> int:
    """Bytes of megatron-core's own DistributedDataParallel gradient buffers over `elements` parameters of `dtype`
    (one rank), with `grad_reduce_in_fp32` as Megatron-LM sets it: `accumulate_allreduce_grads_in_fp32`, which its
    arguments.py turns on for --bf16 only."""
    with cpu_runtime():
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import MegatronModule
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, params_dtype=dtype,
                                   fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16)
        module = MegatronModule(config)
        module.weight = torch.nn.Parameter(torch.empty(elements, dtype=dtype))
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=fp32_reduce, use_distributed_optimizer=distributed), module)
        return sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for buffer in ddp.buffers)


@pytest.mark.parametrize("zero", [0, 1])
def test_megatron_gradient_buffer_follows_the_precision(zero, tmp_path):
    """Megatron-LM's fp16 runs (the Mist baselines, fitplan's --fp16 Megatron jobs) keep an fp16 gradient buffer,
    its bf16 runs an fp32 one: fitplan's gradient bytes equal megatron-core's buffers for the graph's parameters."""
    from costmodels import estimate, parse_cluster

    for precision, dtype in ((Precision.FP16_MIXED, torch.float16), (Precision.BF16_MIXED, torch.bfloat16)):
        config = Config(engine=Engine.MEGATRON, zero=zero, precision=precision, micro_batch=1)
        graph = _graph(tmp_path, config)
        priced = estimate(graph, parse_cluster("1xH100"), Workload(seq_len=64, global_batch=1), config)
        reference = megatron_buffer_bytes(graph.param_count, dtype, fp32_reduce=dtype == torch.bfloat16,
                                          distributed=zero == 1)
        assert priced.memory.gradients == reference, precision
