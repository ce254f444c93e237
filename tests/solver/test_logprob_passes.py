"""The no-grad log-prob forwards a post-training step is priced with (`logprob_forwards`) equal the forwards a
real TRL 1.16 step runs through the policy and the reference under no_grad (tiny Llama on CPU): DPO's reference
pass, and KTO's KL term (the policy's and the reference's forwards on mismatched completions) beside its
reference pass."""

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
