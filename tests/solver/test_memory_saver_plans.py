"""The memory-saving knobs end to end: pinned on `solve`/`estimate` (options generated from the knob record), priced
in the plan's estimate, emitted where a launcher runs them (read back by transformers' own TrainingArguments and
liger-kernel's own patch function) and refused, with the reason, where none does."""

from __future__ import annotations

import inspect
import itertools
import json

import pytest
import torch
from typer.testing import CliRunner

from costmodels import Config, Optimizer
from costmodels.config import Loss
from graphs import FitplanError
from solver.api import estimate, solve
from solver.cli.app import app
from solver.plan.capability import LAUNCHERS, unsupported
from solver.plan.launchers import emit
from solver.plan.record import Plan

MODEL, GPUS = "Qwen/Qwen2.5-0.5B", "1xA10G"
WORKLOAD = {"seq_len": 512, "global_batch": 4}


def training_arguments(files: dict[str, str], tmp_path):
    from transformers import TrainingArguments

    kwargs = json.loads(files["training_args.json"])
    return TrainingArguments(**{**kwargs, "output_dir": str(tmp_path), "bf16": False, "fp16": False})


@pytest.mark.parametrize(("optimizer", "optim"), [(Optimizer.PAGED_ADAMW_8BIT, "paged_adamw_8bit"),
                                                  (Optimizer.PAGED_ADAMW_32BIT, "paged_adamw_32bit")])
def test_a_pinned_paged_optimizer_is_planned_priced_and_emitted(optimizer, optim, tmp_path):
    # DDP: both the HF Trainer and the torchrun script run it (bitsandbytes cannot step FSDP2's DTensors)
    plan = solve(MODEL, GPUS, **WORKLOAD, optimizers=optimizer.value, launcher="hf", engine="ddp", time_limit=5)
    assert plan.decisions.optimizer is optimizer and {"hf", "torchrun"} <= set(plan.launchers)
    config = Config(**{name: getattr(plan.decisions, name) for name in Config.__dataclass_fields__})
    again = estimate(MODEL, GPUS, config, seq_len=WORKLOAD["seq_len"], global_batch=WORKLOAD["global_batch"])
    assert plan.estimate.memory == again.memory and plan.estimate.memory.cpu_bytes_per_node > 0  # paged states
    assert training_arguments(emit(plan, "hf"), tmp_path).optim.value == optim
    script = emitted_script(plan, tmp_path)  # bitsandbytes falls back to unpaged states on CPU; the class is built
    built = script["optimizer_for"](torch.nn.Linear(512, 512), 1e-3)
    assert type(built).__name__ == {Optimizer.PAGED_ADAMW_8BIT: "PagedAdamW8bit",
                                    Optimizer.PAGED_ADAMW_32BIT: "PagedAdamW32bit"}[optimizer]
    with pytest.raises(FitplanError, match="paged AdamW"):
        emit(plan, "megatron")


def emitted_script(plan, folder) -> dict:
    """The emitted train_fitplan.py's namespace (its functions, not run)."""
    import runpy

    (folder / "train_fitplan.py").write_text(emit(plan, "torchrun")["train_fitplan.py"])
    return runpy.run_path(str(folder / "train_fitplan.py"), run_name="fitplan_emitted")


def test_the_fused_linear_loss_is_emitted_as_liger_s_whole_patch(tmp_path):
    """use_liger_kernel with the kernels the plan was lowered with (graphs/liger.py): Liger's fused linear
    cross-entropy, RMSNorm, SwiGLU and RoPE."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    from graphs.liger import LIGER_KERNELS

    plan = solve(MODEL, GPUS, **WORKLOAD, loss="fused-linear", launcher="hf", time_limit=5)
    assert plan.decisions.loss is Loss.FUSED_LINEAR and {"torchrun", "hf"} <= set(plan.launchers)
    assert Plan.from_json(json.loads(plan.dumps())).decisions == plan.decisions  # the knob round-trips
    args = training_arguments(emit(plan, "hf"), tmp_path)
    assert args.use_liger_kernel
    patch = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN["qwen2"]).parameters
    assert set(args.liger_kernel_config) <= set(patch)  # every key reaches Liger's qwen2 patch
    assert args.liger_kernel_config == {"fused_linear_cross_entropy": True, **LIGER_KERNELS}
    assert {k for k, on in args.liger_kernel_config.items() if on} == {"fused_linear_cross_entropy", "rope",
                                                                        "rms_norm", "swiglu"}
    assert any("Liger's RMSNorm, SwiGLU and RoPE" in note for note in plan.estimate.notes)
    plain = solve(MODEL, GPUS, **WORKLOAD, launcher="hf", time_limit=5)
    assert plan.estimate.memory.allocated_peak < plain.estimate.memory.allocated_peak
    assert "use_liger_kernel" not in json.loads(emit(plain, "hf")["training_args.json"])
    # the torchrun script makes the same call transformers makes, with the same kernels
    import liger_kernel.transformers

    calls = []
    script = emitted_script(plan, tmp_path)
    original = liger_kernel.transformers._apply_liger_kernel_to_instance
    liger_kernel.transformers._apply_liger_kernel_to_instance = lambda **kw: calls.append(kw)
    try:
        model = torch.nn.Linear(2, 2)
        script["apply_liger"](model)
    finally:
        liger_kernel.transformers._apply_liger_kernel_to_instance = original
    assert calls == [{"model": model, **args.liger_kernel_config}]


@pytest.mark.parametrize(("knobs", "reason", "runners"), [
    ({"loss": Loss.CHUNKED}, "chunked cross-entropy", ("torchrun", "torchtitan")),
    ({"activation_offload": True}, "activation offloading", ("torchrun",)),
])
def test_only_the_torchrun_script_runs_torchtunes_savers(knobs, reason, runners):
    """torchtune is no launcher; the generated torchrun script runs its chunked loss and activation offloading
    (tests/solver/test_torchrun_savers.py), except in a pipeline; torchtitan runs a chunked loss of its own
    (ChunkedLossWrapper, pipelined or not: issue 37)."""
    for launcher in LAUNCHERS:
        problems = [p for p in unsupported(launcher, Config(**knobs)) if reason in p]
        assert bool(problems) == (launcher not in runners), launcher
    staged = Config(**knobs, pp=2, grad_accum=2)
    assert any(reason in p for p in unsupported("torchrun", staged))


def test_the_trainer_and_the_torchrun_script_run_the_fused_loss_and_only_the_script_steps_in_backward():
    runs = [name for name in LAUNCHERS if not unsupported(name, Config(loss=Loss.FUSED_LINEAR))]
    assert runs == ["torchrun", "hf"]
    runs = [name for name in LAUNCHERS if not unsupported(name, Config(optimizer_in_backward=True))]
    assert runs == ["torchrun"]


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


def test_solve_cli_refuses_offload_without_full_checkpointing_and_what_no_allowed_launcher_or_kernel_runs():
    common = ["solve", "--model", MODEL, "--gpus", GPUS, "--seq-len", "512", "--global-batch", "4",
              "--time-limit", "5"]
    offload = invoke([*common, "--activation-offload", "on", "--checkpoint", "none"])
    assert offload.exit_code == 2 and "full checkpointing" in offload.stderr
    in_backward = invoke([*common, "--optimizer-in-backward", "on", "--launcher", "hf"])
    assert in_backward.exit_code == 2 and "launchers that run it: torchrun" in " ".join(in_backward.stderr.split())
    gpt2 = invoke([*common[:2], "gpt2", *common[3:], "--loss", "fused-linear"])
    assert gpt2.exit_code == 2 and "no fused linear cross-entropy patch for model type 'gpt2'" in \
        " ".join(gpt2.stderr.split())


@pytest.mark.distributed
def test_emitted_script_steps_in_backward_and_keeps_no_gradient(tmp_path):
    """torchtune's hooks in the generated script, on two gloo ranks under FSDP2: two steps train, no gradient is
    left after backward (the estimate's gradients are 0), and the per-parameter optimizers hold exactly the states
    the plan's estimate counts."""
    import math

    from solver.cli.commands import emit_files
    from tests.graphs.reference import write_config
    from tests.graphs.tiny_configs import tiny_values
    from tests.solver.test_train_script import run

    model_dir = write_config(tmp_path / "tiny", tiny_values("llama"))
    plan = solve(str(model_dir), "2xCPU", seq_len=32, global_batch=4, engine="fsdp2", zero=3, tp=1,
                 optimizer_in_backward="on", offload="none", param_offload="none", time_limit=5)
    assert plan.decisions.optimizer_in_backward and plan.decisions.grad_accum == 1
    assert plan.launchers == ("torchrun",) and plan.estimate.memory.gradients == 0
    emit_files(plan, "torchrun", tmp_path / "out")
    ranks, losses = run(tmp_path / "out" / "train_fitplan.py", model_dir, tmp_path / "report")
    assert len(ranks) == 2 and len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert all(r["grad_bytes"] == 0 and r["grad_norms"] == [] for r in ranks)
    assert max(r["optimizer_bytes"] for r in ranks) == plan.estimate.memory.optimizer_states


# --- the search choosing them (--allow-savers) ------------------------------------------------------------------

SAVER_CASE = {"model": MODEL, "gpus": "1xT4", "seq_len": 4096, "global_batch": 16, "time_limit": 120}
"""A 152k-token vocabulary at 4096 tokens on a 16 GB card: the logits alone are GiBs, so the savers matter."""


@pytest.mark.slow
def test_allowed_savers_give_the_best_plan_of_each_saver_setting_pinned_alone():
    """An exact decomposition as the reference: the search over every optimizer-in-backward, loss and
    activation-offload setting equals the fastest of the solves with each setting pinned (those some launcher
    runs), and beats the plan without savers here (Liger's kernels and no full logits: a larger micro-batch)."""
    chosen = solve(**SAVER_CASE, allow_savers=True)
    assert chosen.solver.status == "OPTIMAL"
    assert any("--allow-savers" in note for note in chosen.inputs.assumed)
    steps = {}
    for in_backward, loss, offload in itertools.product((False, True), Loss, (False, True)):
        try:
            plan = solve(**SAVER_CASE, optimizer_in_backward=in_backward, loss=loss.value,
                         activation_offload=offload)
        except FitplanError:  # nothing fits, or no launcher runs the setting
            continue
        assert plan.solver.status == "OPTIMAL"
        steps[in_backward, loss, offload] = plan.estimate.time.step_time
    assert chosen.estimate.time.step_time == pytest.approx(min(steps.values()), rel=1e-9)
    decided = chosen.decisions
    assert (decided.optimizer_in_backward, decided.loss, decided.activation_offload) in steps
    assert chosen.estimate.time.step_time < steps[False, Loss.HF, False]
    assert chosen.decisions.loss is Loss.FUSED_LINEAR  # chunked runs in one dtype: not under fp16-mixed
    assert "memory savers: loss fused-linear (liger-kernel)" in chosen.advice  # the guide line: what it runs on


def test_offloading_configurations_keep_every_layer_fully_checkpointed():
    from graphs import Checkpoint
    from solver.search.space import Outer

    offloading, keeping = Outer(activation_offload=True), Outer()
    assert [m for m in Checkpoint if offloading.runs(m)] == [Checkpoint.FULL]
    assert all(keeping.runs(m) for m in Checkpoint)


def test_liger_s_loss_without_liger_kernel_is_left_out_of_a_list_and_refused_alone(monkeypatch):
    monkeypatch.setattr("solver.search.pin_rules.liger_version", lambda: None)
    plan = solve(MODEL, GPUS, **WORKLOAD, loss=("hf", "fused-linear"), time_limit=5)
    assert plan.decisions.loss is Loss.HF
    assert any("liger-kernel is not installed" in note for note in plan.inputs.assumed)
    with pytest.raises(FitplanError, match="needs liger-kernel"):
        solve(MODEL, GPUS, **WORKLOAD, loss="fused-linear", time_limit=5)


def test_solve_cli_allow_savers_shows_the_chosen_savers():
    result = invoke(["solve", "--model", MODEL, "--gpus", "1xT4", "--seq-len", "4096", "--global-batch", "16",
                     "--allow-savers", "--time-limit", "60"])
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())
    assert "memory savers │ loss fused-linear" in shown


# A recipe's own point (issue 35 item 1): Llama-3.1-8B full fine-tuning in pure bf16 with paged 8-bit AdamW on one
# 24 GB RTX 4090, as torchtune's single-device recipe runs it (optimizer in backward, chunked loss, micro-batch 2).
RTX4090_RECIPE = {"model": "meta-llama/Llama-3.1-8B", "gpus": "1xRTX4090", "seq_len": 2048, "global_batch": 2,
                  "precision": ("bf16",), "optimizer": ("paged-adamw-8bit",), "time_limit": 30}


def test_allowed_savers_search_optimizer_in_backward_and_reach_the_recipe_s_point():
    from costmodels import fits
    from solver.api import DEFAULT_HEADROOM, cluster_from

    recipe = estimate(RTX4090_RECIPE["model"], RTX4090_RECIPE["gpus"],
                      {"precision": "bf16", "optimizer": "paged-adamw-8bit", "optimizer_in_backward": True,
                       "loss": "chunked", "micro_batch": 2, "checkpoint": "full", "compile": True},
                      seq_len=2048, global_batch=2)
    assert fits(recipe, cluster_from("1xRTX4090"), DEFAULT_HEADROOM).fits
    plan = solve(**RTX4090_RECIPE, allow_savers=True)
    assert plan.decisions.optimizer_in_backward and plan.decisions.grad_accum == 1
    assert plan.estimate.time.step_time <= recipe.time.step_time * (1 + 1e-9)
    assert any("no gradient clipping" in line for line in plan.advice), plan.advice
    # without --allow-savers nothing fits, and the diagnosis names the saver that would
    with pytest.raises(FitplanError) as refused:
        solve(**RTX4090_RECIPE)
    assert "--optimizer-in-backward on" in refused.value.hint
