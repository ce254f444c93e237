"""KTO and DPO steps as TRL 1.16 runs them (tiny Llama on CPU). The no-grad log-prob forwards a post-training step
is priced with (`logprob_forwards`) equal the forwards a real step runs through the policy and the reference under
no_grad: DPO's reference pass, and KTO's KL term (the policy's and the reference's forwards on mismatched
completions) beside its reference pass. A KTO plan has the two examples per micro-batch `KTOTrainer` requires."""

from __future__ import annotations

import pytest

from costmodels.tasks import Reference, Task
from solver.search.post_training import logprob_forwards
from tests.costmodels.trl_reference import dpo_trainer, forward_calls, kto_trainer
from tests.graphs.tiny_configs import tiny_values

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[dev]')")


@pytest.mark.parametrize(("task", "make"), [
    (Task.KTO, lambda values: kto_trainer(values, examples=2, prompt=16, completion=16)),
    (Task.DPO, lambda values: dpo_trainer(values, pairs=1, prompt=16, completion=16, reference="copy")),
])
def test_priced_logprob_forwards_equal_the_no_grad_forwards_trl_runs(task, make):
    calls = forward_calls(make(tiny_values("llama")))
    assert calls["policy"]["grad"] == 1  # the training forward, priced as the training step
    assert logprob_forwards(task, Reference.COPY) == calls["policy"]["no_grad"] + calls["reference"]["no_grad"]


def _kto(global_batch: int):
    from solver.api import solve
    from solver.search.post_training import PostRequest

    return solve("Qwen/Qwen2.5-0.5B", "2xA100", global_batch=global_batch, seq_len=1024, time_limit=10,
                 deterministic=True, post_training=PostRequest(task=Task.KTO))


def test_a_kto_plan_has_the_two_examples_per_device_ktotrainer_requires():
    plan = _kto(8)
    per_device = plan.post_training.per_device_train_batch_size
    assert per_device >= 2 and plan.decisions.micro_batch == per_device
    kto_trainer(tiny_values("llama"), examples=per_device, prompt=16, completion=16)  # TRL accepts it


def test_kto_with_one_example_per_rank_is_refused_naming_trls_rule():
    from solver.search.diagnose import Infeasible

    with pytest.raises(Infeasible, match="KTO trains at least two examples per micro-batch"):
        _kto(2)  # dp=2 would give one example per rank, which KTOTrainer refuses
