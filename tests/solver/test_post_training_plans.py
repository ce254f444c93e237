"""Post-training plans end to end: the issue's GRPO command returns the vLLM placement and share, and the emitted
TRL configs are read back by TRL's own `GRPOConfig` and `DPOConfig`; bad post-training input exits 2."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from costmodels.tasks import Task
from solver.api import solve
from solver.cli.app import app
from solver.plan.launchers import emit
from solver.plan.record import Plan
from solver.search.post_training import PostRequest

trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[dev]')")

GRPO_ARGS = ["solve", "--model", "Qwen/Qwen2.5-7B", "--gpus", "8xH100", "--task", "grpo", "--num-generations", "8",
             "--max-completion", "1024", "--json"]


@pytest.fixture(scope="module")
def grpo_plan() -> dict:
    result = CliRunner().invoke(app, GRPO_ARGS)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def dpo_plan() -> Plan:
    return solve("Qwen/Qwen2.5-7B", "8xH100", global_batch=64, seq_len=2048,
                 post_training=PostRequest(task=Task.DPO), time_limit=10)


def _read_back(config_class, files: dict[str, str], name: str, tmp_path):
    """The emitted config as TRL's class reads it (DeepSpeed's file written beside it, as the launch has it)."""
    kwargs = json.loads(files[name])
    extra = {}
    if "deepspeed" in kwargs:
        (tmp_path / kwargs["deepspeed"]).write_text(files[kwargs["deepspeed"]])
        extra["deepspeed"] = str(tmp_path / kwargs["deepspeed"])
    # this host has no GPU for TrainingArguments' half-precision checks: the flags are compared as emitted
    config = config_class(**{**kwargs, "output_dir": str(tmp_path), "bf16": False, "fp16": False, **extra})
    fields = {f.name for f in dataclasses.fields(config_class)}
    assert set(kwargs) <= fields
    changed = {k for k, v in kwargs.items() if getattr(config, k) != v and not isinstance(v, dict)}
    assert changed <= {"bf16", "fp16", "optim", "output_dir", "deepspeed"}
    return kwargs, config


def test_grpo_plan_places_vllm_with_its_memory_share_and_the_step_time_by_phase(grpo_plan):
    post = grpo_plan["post_training"]
    engine = post["generation"]
    assert engine["vllm_mode"] in ("colocate", "server")
    assert 0 < engine["vllm_gpu_memory_utilization"] <= 0.92
    assert engine["kv_cache_bytes_per_gpu"] > 0 and engine["concurrent_sequences"] >= 1
    assert post["num_generations"] == 8 and post["completion_len"] == 1024
    assert post["examples_per_step"] % 8 == 0
    time = post["time"]
    parts = time["generation"] + time["weight_sync"] + time["logprob_passes"] + time["training"]
    assert time["step_time"] == pytest.approx(parts, rel=1e-12)
    assert time["training"] == pytest.approx(grpo_plan["estimate"]["time"]["step_time"], rel=1e-12)
    assert set(grpo_plan["launchers"]) <= {"hf", "accelerate", "deepspeed"}
    # the placements compared, each with its step time, the chosen one the fastest
    assert len(post["considered"]) > 2


def test_grpo_config_parses_in_trls_grpo_config(grpo_plan, tmp_path):
    plan = Plan.from_json(grpo_plan)
    _, config = _read_back(trl.GRPOConfig, emit(plan, "hf"), "grpo_config.json", tmp_path)
    engine = plan.post_training.generation
    assert config.use_vllm and config.vllm_mode == engine.vllm_mode
    if engine.vllm_mode == "colocate":
        assert config.vllm_gpu_memory_utilization == engine.vllm_gpu_memory_utilization
        assert config.vllm_tensor_parallel_size == engine.vllm_tensor_parallel_size
    assert config.num_generations == 8 and config.max_completion_length == 1024
    assert config.per_device_train_batch_size == plan.decisions.micro_batch
    # TRL's own rule: completions per generation round are whole groups
    generation = config.per_device_train_batch_size * plan.decisions.dp * config.steps_per_generation
    assert generation % config.num_generations == 0


def test_dpo_config_parses_in_trls_dpo_config_with_pairs_per_device(dpo_plan, tmp_path):
    _, config = _read_back(trl.DPOConfig, emit(dpo_plan, "hf"), "dpo_config.json", tmp_path)
    post = dpo_plan.post_training
    assert dpo_plan.decisions.micro_batch == 2 * config.per_device_train_batch_size  # chosen + rejected
    assert config.max_length == dpo_plan.inputs.seq_len and config.beta == pytest.approx(0.1)
    assert config.precompute_ref_log_probs == (post.reference == "precomputed")
    assert post.examples_per_step == 64 and dpo_plan.inputs.global_batch == 128


def test_dpo_reference_copy_costs_memory_that_precomputing_saves(dpo_plan):
    copy = solve("Qwen/Qwen2.5-7B", "8xH100", global_batch=64, seq_len=2048, engine="deepspeed", zero=2,
                 post_training=PostRequest(task=Task.DPO, reference="copy"), time_limit=10)
    pre = solve("Qwen/Qwen2.5-7B", "8xH100", global_batch=64, seq_len=2048, engine="deepspeed", zero=2,
                post_training=PostRequest(task=Task.DPO, reference="precomputed"), time_limit=10)
    assert copy.post_training.reference_bytes_per_gpu > 10 * 2**30  # a 16-bit 7B copy, unsharded below ZeRO-3
    assert pre.post_training.reference_bytes_per_gpu == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--task", "ppo"], "ppo is not planned"),
    (["--task", "grpo", "--num-generations", "1"], "at least 2 generations"),
    (["--task", "orpo", "--reference", "copy"], "no reference"),
    (["--task", "dpo", "--launcher", "torchrun"], "does not run TRL"),
])
def test_bad_post_training_input_exits_2_with_a_hint(args, message):
    result = CliRunner().invoke(app, ["solve", "--model", "Qwen/Qwen2.5-0.5B", "--gpus", "1xA100", *args])
    assert result.exit_code == 2
    assert message in result.stderr


def test_server_mode_trains_on_the_other_gpus_and_emits_the_vllm_serve_line(tmp_path):
    plan = solve("Qwen/Qwen2.5-7B", "8xH100", global_batch=64, time_limit=10,
                 post_training=PostRequest(task=Task.GRPO, completion_len=1024, vllm_mode="server", vllm_tp=2))
    engine = plan.post_training.generation
    assert engine.vllm_mode == "server" and engine.vllm_tensor_parallel_size == 2
    assert engine.training_gpus + engine.generation_gpus == 8
    assert plan.decisions.world_size == engine.training_gpus  # the training step runs on the rest
    assert engine.resident_bytes_during_training == 0
    files = emit(plan, "hf")
    serve = files["vllm_serve.sh"].split()
    devices = next(word for word in serve if word.startswith("CUDA_VISIBLE_DEVICES="))
    assert devices == "CUDA_VISIBLE_DEVICES=" + ",".join(str(i) for i in range(engine.training_gpus, 8))
    assert serve[serve.index("--tensor-parallel-size") + 1] == "2"
    assert int(serve[serve.index("--data-parallel-size") + 1]) * 2 == engine.generation_gpus
    _, config = _read_back(trl.GRPOConfig, files, "grpo_config.json", tmp_path)
    assert config.vllm_mode == "server"
