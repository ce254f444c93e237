"""Issue 37 defect 1: a plan for the torchtitan launcher is priced with the loss its job runs, and `--loss` chooses
it: hf is torchtitan's plain CrossEntropyLoss over full fp32 logits, chunked its ChunkedLossWrapper. The reference
is torchtitan's own model and loss run on fake tensors under MemTracker (tests/graphs/titan_reference.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

from graphs import Checkpoint, FitplanError
from solver.api import estimate
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values
from tests.graphs.titan_reference import step_peak

B, S = 2, 256  # a whole step at 256 tokens: the activation peak binds (as in tests/graphs/test_titan.py)
TOLERANCE = 0.01  # test_titan.py's: MemTracker counts the loss scalar and AdamW's step counters too


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    values = {**tiny_values("llama"), "vocab_size": 4096}  # a vocabulary wide enough that full logits weigh
    return str(write_config(tmp_path_factory.mktemp("titan-loss") / "llama", values))


def priced(folder: str, loss: str) -> int:
    config = {"engine": "ddp", "precision": "bf16", "optimizer": "adamw", "micro_batch": B, "checkpoint": "none",
              "loss": loss}
    return estimate(folder, "1xCPU", config, seq_len=S, launcher="torchtitan").memory.allocated_peak


@pytest.mark.slow
@pytest.mark.parametrize(("knob", "runtime_loss"), [("hf", "plain"), ("chunked", "chunked")])
def test_torchtitan_plans_price_the_loss_the_knob_chooses(llama, knob, runtime_loss):
    measured = step_peak(llama, b=B, s=S, dtype=torch.bfloat16, mode=Checkpoint.NONE, loss=runtime_loss)
    assert priced(llama, knob) == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.slow
def test_torchtitans_plain_loss_costs_its_full_logits(llama):
    # full fp32 logits of B x S tokens over the vocabulary, at least one copy more than the chunked loss holds
    assert priced(llama, "hf") - priced(llama, "chunked") > B * S * 4096 * 4 // 2


def test_torchtitan_refuses_the_fused_linear_loss(llama):
    with pytest.raises(FitplanError, match="fused linear"):
        priced(llama, "fused-linear")
