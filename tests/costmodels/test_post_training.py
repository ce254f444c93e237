"""TRL post-training memory (`costmodels/post_training.py`) against real TRL 1.16 steps on CPU with a tiny
random-initialised Llama, measured by torch's MemTracker (`trl_reference.py`): DPO, KTO and GRPO.

The CPU run takes TRL's torch fallback of the fused log-prob head (`PostTraining(triton=False)`: every shifted
position scored, full fp32 tiles); the GPU path shares everything else (policy step, reference copy, the head's
buffers and gradients). Within 1%: per-row scalars of the tiles and the small per-token tensors of the loss
(a few bytes per token) are not itemised.
"""

from __future__ import annotations

import pytest

from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, lowering_for, parse_cluster
from costmodels.loss import head_shape
from costmodels.post_training import fused_head, reference_weight_bytes
from costmodels.tasks import PostTraining, Reference, Task
from graphs import Checkpoint, lower
from tests.costmodels.trl_reference import dpo_step_peak, grpo_step_peak, kto_step_peak
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

TOLERANCE = 0.01
PROMPT, COMPLETION = 32, 32


def _graph(folder, values):
    config = Config(engine=Engine.DDP, precision=Precision.FP32, optimizer=Optimizer.ADAMW)
    dtype, autocast = lowering_for(config)
    return lower(str(write_config(folder, values)), dtype=dtype, autocast=autocast, attention="sdpa")


def _predicted(graph, values, *, sequences: int, seq_len: int, post: PostTraining) -> int:
    config = Config(engine=Engine.DDP, precision=Precision.FP32, optimizer=Optimizer.ADAMW, micro_batch=sequences,
                    checkpoint=(Checkpoint.NONE,) * values["num_hidden_layers"])
    workload = Workload(seq_len=seq_len, global_batch=sequences, post=post)
    return estimate(graph, parse_cluster("1xCPU"), workload, config).memory.allocated_peak


@pytest.mark.parametrize("pairs", [1, 2])
@pytest.mark.parametrize("reference", [Reference.COPY, Reference.PRECOMPUTED])
def test_dpo_step_peak_matches_memtracker_over_a_real_trl_step(pairs, reference, tmp_path):
    values = tiny_values("llama")
    post = PostTraining(task=Task.DPO, reference=reference, prompt_len=PROMPT, triton=False)
    predicted = _predicted(_graph(tmp_path / "m", values), values, sequences=2 * pairs, seq_len=PROMPT + COMPLETION,
                           post=post)
    measured = dpo_step_peak(values, pairs=pairs, prompt=PROMPT, completion=COMPLETION, reference=reference.value)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


def test_kto_step_peak_with_its_kl_forwards_matches_memtracker_over_a_real_trl_step(tmp_path):
    """KTO's KL term runs a no-grad policy forward before the training forward and a second no-grad reference
    forward beside the reference's: neither raises the peak (each is one reference spike's size, run in turn)."""
    values = tiny_values("llama")
    post = PostTraining(task=Task.KTO, reference=Reference.COPY, prompt_len=PROMPT, triton=False)
    predicted = _predicted(_graph(tmp_path / "m", values), values, sequences=2, seq_len=PROMPT + COMPLETION,
                           post=post)
    measured = kto_step_peak(values, examples=2, prompt=PROMPT, completion=COMPLETION)
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_training_peak_matches_memtracker_over_a_real_trl_step(beta, tmp_path):
    values = tiny_values("llama")
    prompt, completion, completions = 16, 48, 4
    post = PostTraining(task=Task.GRPO, reference=Reference.COPY if beta else Reference.NONE, prompt_len=prompt,
                        num_generations=4, triton=False)
    predicted = _predicted(_graph(tmp_path / "m", values), values, sequences=completions,
                           seq_len=prompt + completion, post=post)
    measured = grpo_step_peak(values, completions=completions, generations=4, prompt=prompt, completion=completion,
                              beta=beta, folder=tmp_path / "policy")
    assert predicted == pytest.approx(measured, rel=TOLERANCE)


def test_reference_copy_bytes_equal_the_frozen_models_parameters(tmp_path):
    from tests.costmodels.trl_reference import tiny_model

    values = tiny_values("llama")
    graph = _graph(tmp_path / "m", values)
    model = tiny_model(values)
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    post = PostTraining(task=Task.DPO, reference=Reference.COPY)
    assert reference_weight_bytes(graph, Config(), post) == real
    assert reference_weight_bytes(graph, Config(), PostTraining(task=Task.DPO, reference=Reference.ADAPTER)) == 0


def test_fused_head_on_gpu_scores_only_completion_rows(tmp_path):
    """Triton devices project only labelled positions (`hidden_states[mask]`): the saved rows halve with a prompt
    of half the sequence; the torch fallback scores every shifted position."""
    values = tiny_values("llama")
    graph = _graph(tmp_path / "m", values)
    x = head_shape(graph, Config(micro_batch=8), b=8, s=512)
    full = fused_head(x, PostTraining(task=Task.DPO), entropy=False, grad=True)
    half = fused_head(x, PostTraining(task=Task.DPO, prompt_len=256), entropy=False, grad=True)
    cpu = fused_head(x, PostTraining(task=Task.DPO, prompt_len=256, triton=False), entropy=False, grad=True)
    row = values["hidden_size"] * x.itemsize + 8 + 4  # hidden row, int64 target, fp32 log-prob
    assert full.saved - half.saved == 8 * (511 - 256) * row
    assert cpu.saved == 8 * 511 * row


def test_reference_strategies_differ_by_the_copy_and_the_reference_forward(tmp_path):
    """A copy is a whole-step buffer; LoRA's adapter-disabled reference runs the same forward without it;
    precomputed log-probs run neither."""
    from costmodels.memory import memory_terms

    values = tiny_values("llama")
    graph = _graph(tmp_path / "m", values)
    config = Config(engine=Engine.DDP, precision=Precision.FP32, optimizer=Optimizer.ADAMW, micro_batch=4)

    def terms(reference):
        post = PostTraining(task=Task.DPO, reference=reference, prompt_len=PROMPT, triton=False)
        return memory_terms(graph, Workload(seq_len=64, global_batch=4, post=post), config)

    copy, adapter, pre = terms(Reference.COPY), terms(Reference.ADAPTER), terms(Reference.PRECOMPUTED)
    assert copy.buffers - adapter.buffers == reference_weight_bytes(graph, config, PostTraining(
        task=Task.DPO, reference=Reference.COPY))
    assert adapter.buffers == pre.buffers
    head = copy.names.index("head")
    assert copy.nodes[head] == adapter.nodes[head]  # the same reference forward
    assert adapter.nodes[head][0][1].fwd_peak > pre.nodes[head][0][1].fwd_peak
