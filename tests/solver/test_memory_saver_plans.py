"""The memory-saving knobs end to end: pinned on `solve`/`estimate` (options generated from the knob record), priced
in the plan's estimate, emitted where a launcher runs them (read back by transformers' own TrainingArguments and
liger-kernel's own patch function) and refused, with the reason, where none does."""

from __future__ import annotations

import inspect
import json

import pytest
from typer.testing import CliRunner

from costmodels import Config, Optimizer
from costmodels.config import Loss
from graphs import FitplanError
from solver.api import estimate, solve
from solver.capability import LAUNCHERS, unsupported
from solver.cli import app
from solver.launchers import emit

MODEL, GPUS = "Qwen/Qwen2.5-0.5B", "1xA10G"
WORKLOAD = {"seq_len": 512, "global_batch": 4}


def training_arguments(files: dict[str, str], tmp_path):
    from transformers import TrainingArguments

    kwargs = json.loads(files["training_args.json"])
    return TrainingArguments(**{**kwargs, "output_dir": str(tmp_path), "bf16": False, "fp16": False})


@pytest.mark.parametrize(("optimizer", "optim"), [(Optimizer.PAGED_ADAMW_8BIT, "paged_adamw_8bit"),
                                                  (Optimizer.PAGED_ADAMW_32BIT, "paged_adamw_32bit")])
def test_a_pinned_paged_optimizer_is_planned_priced_and_emitted_for_the_trainer(optimizer, optim, tmp_path):
    plan = solve(MODEL, GPUS, **WORKLOAD, optimizers=optimizer.value, launcher="hf", time_limit=5)
    assert plan.decisions.optimizer is optimizer and "hf" in plan.launchers and "torchrun" not in plan.launchers
    config = Config(**{name: getattr(plan.decisions, name) for name in Config.__dataclass_fields__})
    again = estimate(MODEL, GPUS, config, seq_len=WORKLOAD["seq_len"], global_batch=WORKLOAD["global_batch"])
    assert plan.estimate.memory == again.memory and plan.estimate.memory.cpu_bytes_per_node > 0  # paged states
    assert training_arguments(emit(plan, "hf"), tmp_path).optim.value == optim
    with pytest.raises(FitplanError, match="paged AdamW"):
        emit(plan, "torchrun")


def test_the_fused_linear_loss_is_emitted_as_liger_s_fused_loss_alone(tmp_path):
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    plan = solve(MODEL, GPUS, **WORKLOAD, loss="fused-linear", launcher="hf", time_limit=5)
    assert plan.decisions.loss is Loss.FUSED_LINEAR and plan.launchers == ("hf",)
    args = training_arguments(emit(plan, "hf"), tmp_path)
    assert args.use_liger_kernel
    patch = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN["qwen2"]).parameters
    assert set(args.liger_kernel_config) <= set(patch)  # every key reaches Liger's qwen2 patch
    assert [k for k, on in args.liger_kernel_config.items() if on] == ["fused_linear_cross_entropy"]
    plain = solve(MODEL, GPUS, **WORKLOAD, launcher="hf", time_limit=5)
    assert plan.estimate.memory.allocated_peak < plain.estimate.memory.allocated_peak
    assert "use_liger_kernel" not in json.loads(emit(plain, "hf")["training_args.json"])


@pytest.mark.parametrize(("knobs", "reason"), [
    ({"optimizer_in_backward": True}, "optimizer-in-backward"),
    ({"loss": Loss.CHUNKED}, "chunked cross-entropy"),
    ({"activation_offload": True}, "activation offloading"),
])
def test_every_launcher_refuses_what_no_launcher_runs(knobs, reason):
    for launcher in LAUNCHERS:
        assert any(reason in p for p in unsupported(launcher, Config(**knobs))), launcher


def test_only_the_trainer_runs_the_fused_loss():
    runs = [name for name in LAUNCHERS if not unsupported(name, Config(loss=Loss.FUSED_LINEAR))]
    assert runs == ["hf"]


def invoke(args: list[str]):
    return CliRunner().invoke(app, args)


def test_estimate_cli_prices_each_knob_and_refuses_accumulation_in_backward():
    common = ["estimate", "--model", MODEL, "--gpus", GPUS, "--seq-len", "2048", "--micro-batch", "4", "--json",
              "--precision", "bf16", "--checkpoint", "full"]
    plain = json.loads(invoke(common).stdout)
    for flags in (["--optimizer", "paged-adamw-8bit"], ["--loss", "fused-linear"], ["--activation-offload"]):
        result = invoke([*common, *flags])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout) != plain, flags
    refused = invoke([*common, "--optimizer-in-backward", "--grad-accum", "2"])
    assert refused.exit_code == 2 and "grad_accum=2" in refused.stderr


def test_solve_cli_refuses_offload_without_full_checkpointing_and_in_backward_without_a_launcher():
    common = ["solve", "--model", MODEL, "--gpus", GPUS, "--seq-len", "512", "--global-batch", "4",
              "--time-limit", "5"]
    offload = invoke([*common, "--activation-offload", "on", "--checkpoint", "none"])
    assert offload.exit_code == 2 and "full checkpointing" in offload.stderr
    in_backward = invoke([*common, "--optimizer-in-backward", "on"])
    assert in_backward.exit_code == 2
