"""`estimate --task` prices a post-training step as `solve --task` does: for the configuration a plan pins, the
estimate's memory and time equal the plan's (flags, the library call, and the plan itself given as --config);
`check` refuses a post-training plan, whose step its torchrun script does not run."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from costmodels.tasks import Task
from solver.api import estimate, solve
from solver.cli.app import app
from solver.plan.record import Plan
from solver.search.pins import KNOBS
from solver.search.post_training import PostRequest

MODEL, GPUS = "Qwen/Qwen2.5-0.5B", "2xA100"


def _config(plan: Plan) -> dict:
    return {name: getattr(plan.decisions, name) for name in KNOBS}


@pytest.fixture(scope="module")
def dpo_plan() -> Plan:
    return solve(MODEL, GPUS, global_batch=16, seq_len=1024, time_limit=10, deterministic=True,
                 post_training=PostRequest(task=Task.DPO, reference="copy"))


@pytest.fixture(scope="module")
def grpo_plan() -> Plan:
    return solve(MODEL, GPUS, global_batch=16, time_limit=10, deterministic=True,
                 post_training=PostRequest(task=Task.GRPO, beta=0.04, completion_len=256, num_generations=4,
                                           vllm_mode="colocate", utilization=0.3, sleep=False))


def test_estimate_of_a_dpo_plans_configuration_equals_the_plan(dpo_plan):
    assert dpo_plan.post_training.reference == "copy"
    priced = estimate(MODEL, GPUS, _config(dpo_plan), seq_len=1024, global_batch=16,
                      post_training=PostRequest(task=Task.DPO, reference="copy"))
    assert priced.memory == dpo_plan.estimate.memory
    assert priced.time.step_time == pytest.approx(dpo_plan.estimate.time.step_time, rel=1e-12)
    precomputed = estimate(MODEL, GPUS, _config(dpo_plan), seq_len=1024, global_batch=16,
                           post_training=PostRequest(task=Task.DPO, reference="precomputed"))
    assert precomputed.memory.allocated_peak < priced.memory.allocated_peak  # the copy is counted


def test_estimate_of_a_grpo_plans_configuration_equals_the_plan(grpo_plan):
    request = PostRequest(task=Task.GRPO, beta=0.04, completion_len=256, num_generations=4)
    priced = estimate(MODEL, GPUS, _config(grpo_plan), seq_len=grpo_plan.inputs.seq_len,
                      global_batch=grpo_plan.inputs.global_batch, post_training=request)
    assert priced.memory == grpo_plan.estimate.memory
    assert priced.time.step_time == pytest.approx(grpo_plan.estimate.time.step_time, rel=1e-12)


def test_estimate_cli_with_task_flags_and_with_the_plan_file_equal_the_plan(dpo_plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(dpo_plan.to_json()))
    from_file = CliRunner().invoke(app, ["estimate", "--model", MODEL, "--gpus", GPUS, "--config", str(path),
                                         "--json"])
    assert from_file.exit_code in (0, 3), from_file.stderr
    decisions = dpo_plan.to_json()["decisions"]
    config = tmp_path / "config.json"  # the plan's decisions as a file of Config fields
    config.write_text(json.dumps({name: decisions[name] for name in KNOBS}))
    from_flags = CliRunner().invoke(app, ["estimate", "--model", MODEL, "--gpus", GPUS, "--seq-len", "1024",
                                          "--task", "dpo", "--reference", "copy",
                                          "--config", str(config), "--json"])
    assert from_flags.exit_code in (0, 3), from_flags.stderr
    for result in (from_file, from_flags):
        data = json.loads(result.stdout)
        assert data["memory"] == json.loads(json.dumps(dpo_plan.to_json()["estimate"]["memory"]))
        assert data["time"]["step_time"] == pytest.approx(dpo_plan.estimate.time.step_time, rel=1e-9)


def test_estimate_keeps_the_colocated_engines_share_free_as_solve_does(grpo_plan):
    args = ["estimate", "--model", MODEL, "--gpus", GPUS, "--task", "grpo", "--beta", "0.04", "--max-completion",
            "256", "--num-generations", "4", "--vllm-mode", "colocate", "--vllm-gpu-memory-utilization", "0.3",
            "--micro-batch", str(grpo_plan.decisions.micro_batch), "--json"]
    data = json.loads(CliRunner().invoke(app, args).stdout)
    assert data["verdict"]["headroom"] == pytest.approx(0.05 + 0.3)
    assert grpo_plan.inputs.headroom == pytest.approx(0.05 + 0.3)  # the share solve kept free for the step


@pytest.mark.parametrize(("args", "message"), [
    (["--task", "ppo"], "ppo is not planned: TRL 1.16 has no PPO trainer"),
    (["--task", "dpo", "--launcher", "torchrun"], "does not run TRL"),
    (["--task", "kto", "--micro-batch", "1"], "needs at least 2 per micro-batch"),
    (["--task", "dpo", "--micro-batch", "3"], "whole examples of 2 sequences"),
    (["--task", "grpo", "--vllm-mode", "colocate", "--vllm-gpu-memory-utilization", "0.99"], "nothing is left"),
])
def test_bad_task_input_to_estimate_exits_2(args, message):
    result = CliRunner().invoke(app, ["estimate", "--model", MODEL, "--gpus", GPUS, *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())


def test_check_refuses_a_post_training_plan_naming_the_way_to_price_it(dpo_plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(dpo_plan.to_json()))
    result = CliRunner().invoke(app, ["check", str(path), "--device", "cpu"])
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert "TRL's dpo trainer" in message and "fitplan estimate --config" in message


def test_the_ppo_refusal_holds_while_trl_has_no_ppo_trainer():
    """The refusal's reason: TRL 1.16 exports no PPO trainer, top-level or experimental (when it gains one again,
    PPO can be priced against a real step as DPO, KTO and GRPO are)."""
    import importlib.util

    trl = pytest.importorskip("trl")
    assert not hasattr(trl, "PPOTrainer")
    assert importlib.util.find_spec("trl.experimental.ppo") is None
