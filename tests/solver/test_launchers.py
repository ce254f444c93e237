"""Emitted launcher configs loaded by the real libraries: DeepSpeed's config parser, transformers'
`TrainingArguments` and `Trainer`, accelerate's config loader and launch validation, Megatron's flag names.

Plans come from `solve` with pins that force each decision (ZeRO stage, offload, FSDP2, DDP, checkpointing,
fp16, LoRA, TP). The configs are emitted for the plan's GPUs, not for this CPU host: where a library probes
the local hardware or process group, the test stands in the plan's hardware and says so next to the patch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from costmodels import Engine, Offload
from graphs import Checkpoint, FitplanError, LoraSpec
from solver import solve
from solver.plan.launchers import emit, hf, megatron
from solver.plan.launchers.common import checkpointed_layers
from solver.plan.record import Plan
from tests.graphs.tiny_configs import tiny_values

# Plans as users get them: torch.compile searched, as without FITPLAN_AUTO_COMPILE (tests/conftest.py).
pytestmark = pytest.mark.compile_search

GPT2 = {"seq_len": 512, "global_batch": 64, "time_limit": 5}
# name -> (model, gpus, solve keywords). Each pin forces the decision the name gives.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "zero3-accum": ("gpt2", "8xA100", {**GPT2, "engine": "deepspeed", "zero": 3, "micro_batch": 2}),
    "zero2-offload": ("gpt2", "8xA100", {**GPT2, "engine": "deepspeed", "zero": 2, "offload": "cpu"}),
    "zero3-offload-all": ("gpt2", "8xA100", {**GPT2, "engine": "deepspeed", "zero": 3, "offload": "cpu",
                                             "param_offload": "cpu"}),
    "fsdp2-reshard": ("gpt2", "8xA100", {**GPT2, "engine": "fsdp2", "zero": 3}),
    "fsdp2-keep": ("gpt2", "8xA100", {**GPT2, "engine": "fsdp2", "zero": 2}),
    "fsdp2-offload": ("gpt2", "8xA100", {**GPT2, "engine": "fsdp2", "zero": 3, "param_offload": "cpu"}),
    "ddp-full-ckpt": ("gpt2", "8xA100", {**GPT2, "engine": "ddp", "checkpoint": "full"}),
    # DeepSpeed ZeRO-0 so that DeepSpeed and Megatron can both run it (on one GPU FSDP2 ties and, holding less
    # memory, would win the tie).
    "t4-fp16": ("gpt2", "1xT4", {"seq_len": 512, "global_batch": 8, "time_limit": 5, "precision": ("fp16-mixed",),
                                 "engine": "deepspeed", "zero": 0}),
    "lora": ("gpt2", "8xA100", {**GPT2, "lora": LoraSpec(rank=8)}),
    "tp2": ("Qwen/Qwen2.5-0.5B", "8xA100", {**GPT2, "tp": 2}),
    # Memory-bound: the solver checkpoints only some layers (12 of 24 at the time of writing).
    "partial-ckpt": ("Qwen/Qwen2.5-0.5B", "1xT4", {"seq_len": 2048, "global_batch": 8, "time_limit": 5,
                                                   "engine": "deepspeed", "offload": "none",
                                                   "param_offload": "none"}),
    "pure-bf16-zero2": ("gpt2", "8xA100", {**GPT2, "engine": "deepspeed", "zero": 2, "precision": ("bf16",)}),
    "megatron-selective": ("gpt2", "1xT4", {"seq_len": 512, "global_batch": 8, "time_limit": 5,
                                            "launcher": "megatron", "checkpoint": "selective"}),
    "megatron-fp8-zero1": ("gpt2", "8xH100", {**GPT2, "launcher": "megatron", "zero": 1, "precision": ("fp8",),
                                              "checkpoint": "full"}),
    "megatron-t4-fp16": ("gpt2", "1xT4", {"seq_len": 512, "global_batch": 8, "time_limit": 5,
                                          "precision": ("fp16-mixed",), "launcher": "megatron", "zero": 0}),
}


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """Plans solved once per module, on first use (lowering is cached on disk, then in memory)."""

    class Lazy(dict):
        def __missing__(self, name: str) -> Plan:
            model, gpus, keywords = CASES[name]
            self[name] = solve(model, gpus, **keywords)
            return self[name]

    return Lazy()


DEEPSPEED = ["zero3-accum", "zero2-offload", "zero3-offload-all", "t4-fp16", "partial-ckpt", "pure-bf16-zero2"]
HF = ["zero3-accum", "zero2-offload", "fsdp2-reshard", "fsdp2-keep", "fsdp2-offload", "ddp-full-ckpt", "t4-fp16",
      "lora", "partial-ckpt"]
ACCELERATE = [*HF, "tp2"]
MEGATRON = ["megatron-t4-fp16", "megatron-selective", "megatron-fp8-zero1"]
# accelerate's `mixed_precision` for each fitplan precision ("no" for fp32 and tf32).
ACCELERATE_PRECISION = {"bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16", "fp8": "fp8"}


def world(plan: Plan) -> int:
    cluster = plan.inputs.cluster
    return cluster.nodes * cluster.gpus_per_node


def autos(value: Any, path: str = "") -> list[str]:
    """Paths of every "auto" value (fitplan writes each value explicitly)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in autos(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in autos(v, f"{path}[{i}]")]
    return [path] if value == "auto" else []


def write(files: dict[str, str], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def isolated_accelerate():
    """Undo what TrainingArguments and accelerate leave behind: env variables and the shared PartialState."""
    from accelerate.state import AcceleratorState

    saved = dict(os.environ)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(saved)


# --- DeepSpeed: deepspeed.runtime.config.DeepSpeedConfig ---------------------------------------------------


def parse_deepspeed(config: dict, ranks: int, monkeypatch) -> Any:
    """DeepSpeed's own parse of `config` as rank 0 of `ranks` processes.

    DeepSpeedConfig reads the world size from deepspeed.comm; without an initialised process group it catches
    the error and assumes 1 process, which would make its `train_batch_size == micro x accum x world` assertion
    check the wrong world. Standing in the plan's world size makes that assertion run for real.
    """
    import deepspeed.runtime.config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda group=None: ranks)
    return ds_config.DeepSpeedConfig(config)


@pytest.mark.parametrize("name", DEEPSPEED)
def test_ds_config_parses_with_deepspeed_and_matches_plan(name, plans, monkeypatch):
    plan = plans[name]
    d = plan.decisions
    config = json.loads(emit(plan, "deepspeed")["ds_config.json"])
    parsed = parse_deepspeed(config, world(plan), monkeypatch)
    assert parsed.world_size == world(plan) == d.dp
    assert parsed.train_micro_batch_size_per_gpu == d.micro_batch
    assert parsed.gradient_accumulation_steps == d.grad_accum
    assert parsed.train_batch_size == plan.inputs.global_batch
    assert parsed.zero_optimization_stage == d.zero
    zero = parsed.zero_config
    for block, decided in ((zero.offload_optimizer, d.optimizer_offload), (zero.offload_param, d.param_offload)):
        if decided is Offload.NONE:
            assert block is None or block.device == "none"
        else:
            assert block.device == decided.value
            assert block.pin_memory is True
    assert parsed.bfloat16_config.enabled == (d.precision.value in ("bf16-mixed", "bf16", "fp8"))
    assert parsed.float16_config.enabled == (d.precision.value == "fp16-mixed")
    assert parsed.bfloat16_config.bf16_master_weights_and_grads == (d.precision.value == "bf16")
    assert parsed.optimizer_name == "adamw"
    assert autos(config) == []


def test_ds_parser_rejects_batch_that_ignores_world_size(plans, monkeypatch):
    """The stand-in world size makes DeepSpeed's batch assertion bite: micro x accum alone is wrong on 8 GPUs."""
    plan = plans["zero3-accum"]
    config = json.loads(emit(plan, "deepspeed")["ds_config.json"])
    config["train_batch_size"] = plan.decisions.micro_batch * plan.decisions.grad_accum
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        parse_deepspeed(config, world(plan), monkeypatch)


# --- transformers: TrainingArguments and Trainer --------------------------------------------------------------


def training_arguments(plan: Plan, folder: Path, monkeypatch) -> Any:
    """transformers' TrainingArguments built from the emitted kwargs, as one of the plan's ranks."""
    import transformers.training_args
    from transformers import TrainingArguments

    files = emit(plan, "hf")
    kwargs = json.loads(files["training_args.json"])
    assert kwargs == yaml.safe_load(files["training_args.yaml"])
    kwargs["output_dir"] = str(folder / "run")
    if "deepspeed" in kwargs:
        kwargs["deepspeed"] = str(write({"ds_config.json": files["ds_config.json"]}, folder) / "ds_config.json")
    # The plan's GPU (A100) supports bf16; this CPU host does not, and TrainingArguments checks the local device.
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    # One process here; the plan's world size lets HF compare DeepSpeed's train_batch_size for real.
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: world(plan)))
    return TrainingArguments(**kwargs)


@pytest.mark.parametrize("name", HF)
def test_training_arguments_construct_and_reflect_plan(name, plans, tmp_path, monkeypatch, isolated_accelerate):
    plan = plans[name]
    d = plan.decisions
    args = training_arguments(plan, tmp_path, monkeypatch)
    assert args.per_device_train_batch_size == d.micro_batch
    assert args.gradient_accumulation_steps == d.grad_accum
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * world(plan) == \
        plan.inputs.global_batch
    assert (args.bf16, args.fp16) == (d.precision.value in ("bf16-mixed", "bf16", "fp8"),
                                      d.precision.value == "fp16-mixed")
    assert args.optim == hf.OPTIM[d.optimizer]
    layers = checkpointed_layers(plan)
    every_layer = len(layers) == len(d.checkpoint)
    # Partial plans checkpoint through the emitted snippet (see test_partial_checkpointing_survives_trainer_train).
    assert bool(args.activation_checkpointing) == (every_layer and d.engine is not Engine.FSDP2)
    assert autos(hf.training_arguments(plan)) == []
    if d.engine is Engine.DEEPSPEED:
        # HF raises these mismatches at Trainer setup ("Please correct the following DeepSpeed config values").
        assert args.hf_deepspeed_config.mismatches == []
        assert args.deepspeed_plugin.zero_stage == d.zero
        assert args.hf_deepspeed_config.is_zero3() == (d.zero == 3)
        assert args.hf_deepspeed_config.is_offload() == (d.optimizer_offload is not Offload.NONE or
                                                         d.param_offload is not Offload.NONE)
        assert not args.fsdp
    elif d.engine is Engine.FSDP2:
        # transformers 5.x deprecates the string form of `fsdp` ("full_shard offload"): all of it is in fsdp_config.
        assert hf.training_arguments(plan)["fsdp"] is True
        plugin = args.fsdp_plugin_args  # what the Trainer hands accelerate's FullyShardedDataParallelPlugin
        assert plugin["fsdp_version"] == 2
        assert plugin["reshard_after_forward"] == (d.zero == 3)
        assert plugin.get("cpu_offload", False) == (d.param_offload is not Offload.NONE)
        assert plugin["transformer_cls_names_to_wrap"] == plan.inputs.layer_class
        assert plugin["activation_checkpointing"] == (every_layer and bool(layers))
        assert args.deepspeed is None
    else:
        assert not args.fsdp and args.deepspeed is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_checkpoint_snippet_sets_planned_layers_on_real_model(arch, plans):
    """The emitted snippet finds the decoder layers of Llama-style and GPT-2-style models alike."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    modes = (Checkpoint.FULL, Checkpoint.NONE, Checkpoint.FULL)
    plan = with_checkpoint(plans["ddp-full-ckpt"], modes)
    model = tiny_model(arch, AutoConfig, AutoModelForCausalLM)
    namespace: dict[str, Any] = {}
    exec(emit(plan, "hf")["fitplan_checkpointing.py"], namespace)
    namespace["apply_fitplan_checkpointing"](model)
    flags = [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert flags == [True, False, True]


def test_partial_checkpointing_survives_trainer_train(plans, tmp_path, isolated_accelerate):
    """Trainer.train() re-enables every layer when activation_checkpointing is set; partial plans must not set it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.modeling_layers import GradientCheckpointingLayer

    plan = with_checkpoint(plans["ddp-full-ckpt"], (Checkpoint.FULL, Checkpoint.NONE, Checkpoint.NONE))
    files = emit(plan, "hf")
    model = tiny_model("llama", AutoConfig, AutoModelForCausalLM)
    namespace: dict[str, Any] = {}
    exec(files["fitplan_checkpointing.py"], namespace)
    namespace["apply_fitplan_checkpointing"](model)
    kwargs = json.loads(files["training_args.json"])
    # A one-step CPU run: the emitted keys stay, the device, precision and batch are this host's.
    kwargs.update(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=2,
                  report_to=[], save_strategy="no", disable_tqdm=True)
    ids = torch.randint(0, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids}] * 2
    Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=data).train()
    flags = [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert flags == [True, False, False]


def with_checkpoint(plan: Plan, modes: tuple[Checkpoint, ...]) -> Plan:
    return dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, checkpoint=modes))


def tiny_model(arch: str, auto_config, auto_model):
    values = tiny_values(arch)
    config = auto_config.for_model(values.pop("model_type"), **values)
    assert config.num_hidden_layers == 3
    return auto_model.from_config(config)


def test_partial_plan_checkpoints_through_snippet_only(plans):
    """A partial plan emits the per-layer snippet and leaves the Trainer's all-layer flag off."""
    plan = plans["partial-ckpt"]
    assert 0 < len(checkpointed_layers(plan)) < len(plan.decisions.checkpoint)
    files = emit(plan, "hf")
    assert "fitplan_checkpointing.py" in files
    assert "activation_checkpointing" not in json.loads(files["training_args.json"])
    assert "fitplan_checkpointing.py" in emit(plan, "accelerate")


def test_lora_plan_emits_an_adapter_config_that_peft_loads(plans, tmp_path):
    from peft import LoraConfig

    for launcher in ("hf", "accelerate"):
        folder = write(emit(plans["lora"], launcher), tmp_path / launcher)
        loaded = LoraConfig.from_pretrained(str(folder))
        assert loaded.r == plans["lora"].decisions.lora.rank
        assert loaded.lora_alpha == plans["lora"].decisions.lora.alpha


# --- accelerate: config loader and launch validation ---------------------------------------------------------


@pytest.mark.parametrize("name", ACCELERATE)
def test_accelerate_config_loads_with_accelerate_and_matches_plan(name, plans, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    plan = plans[name]
    d = plan.decisions
    folder = write(emit(plan, "accelerate"), tmp_path)
    loaded = load_config_from_file(str(folder / "accelerate_config.yaml"))
    assert loaded.num_processes == d.tp * d.dp == world(plan)
    assert loaded.num_machines == plan.inputs.cluster.nodes
    assert loaded.use_cpu is False
    expected_type = {Engine.DEEPSPEED: "DEEPSPEED", Engine.FSDP2: "FSDP"}.get(d.engine, "MULTI_GPU")
    assert loaded.distributed_type.value == expected_type
    precision = ACCELERATE_PRECISION.get(d.precision.value, "no")
    # Under DeepSpeed the JSON's precision block rules; accelerate refuses a second source that disagrees (fp32:
    # "no" agrees with the JSON's disabled fp16/bf16 blocks, and stays).
    dropped = d.engine is Engine.DEEPSPEED and precision != "no"
    assert loaded.mixed_precision == (None if dropped else precision)
    if d.engine is Engine.FSDP2:
        fsdp = loaded.fsdp_config
        assert fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_reshard_after_forward"] == (d.zero == 3)
        assert fsdp["fsdp_offload_params"] == (d.param_offload is not Offload.NONE)
        assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == plan.inputs.layer_class
    if d.engine is Engine.DEEPSPEED:
        assert (folder / loaded.deepspeed_config["deepspeed_config_file"]).is_file()
        assert loaded.deepspeed_config["zero3_init_flag"] == (d.zero == 3)
    if d.tp > 1:
        parallel = loaded.parallelism_config
        assert parallel["parallelism_config_tp_size"] == d.tp
        assert parallel["parallelism_config_dp_shard_size"] * parallel["parallelism_config_dp_replicate_size"] == d.dp
    assert autos(yaml.safe_load((folder / "accelerate_config.yaml").read_text())) == []


@pytest.mark.parametrize("name", ["zero2-offload", "t4-fp16", "fsdp2-reshard", "ddp-full-ckpt", "tp2"])
def test_accelerate_launch_env_carries_plan(name, plans, tmp_path, monkeypatch, isolated_accelerate):
    """`accelerate launch`'s own validation turns the config into the env each worker reads; DeepSpeed's plugin
    is then built from that env as a worker would."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    plan = plans[name]
    d = plan.decisions
    write(emit(plan, "accelerate"), tmp_path)
    monkeypatch.chdir(tmp_path)
    args = launch_command_parser().parse_args(["--config_file", "accelerate_config.yaml", "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.num_processes == world(plan)
    if d.engine is Engine.DEEPSPEED:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
        for key, value in env.items():
            if key.startswith("ACCELERATE_"):
                monkeypatch.setenv(key, value)
        plugin = DeepSpeedPlugin()
        plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])  # raises if the two precisions disagree
        assert plugin.zero_stage == d.zero
        assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == d.micro_batch
        assert plugin.deepspeed_config["bf16"]["enabled"] == (d.precision.value in ("bf16-mixed", "bf16", "fp8"))
        assert plugin.deepspeed_config["fp16"]["enabled"] == (d.precision.value == "fp16-mixed")
        return
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_MIXED_PRECISION"] == ACCELERATE_PRECISION.get(d.precision.value, "no")
    if d.engine is Engine.FSDP2:
        assert (env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"]) == ("2", str(d.zero == 3).lower())
    if d.tp > 1:
        assert env["PARALLELISM_CONFIG_TP_SIZE"] == str(d.tp)


def test_accelerate_emits_checkpoint_snippet_when_config_cannot_express_it(plans):
    """accelerate's YAML only has FSDP's all-layer switch: DDP plans and partial plans get the per-layer snippet."""
    ddp_all = emit(plans["ddp-full-ckpt"], "accelerate")
    layers = len(plans["fsdp2-reshard"].decisions.checkpoint)
    fsdp_all = with_checkpoint(plans["fsdp2-reshard"], (Checkpoint.FULL,) * layers)
    fsdp_some = with_checkpoint(fsdp_all, (Checkpoint.FULL,) + (Checkpoint.NONE,) * (layers - 1))
    assert "fitplan_checkpointing.py" in ddp_all
    assert "fitplan_checkpointing.py" not in emit(fsdp_all, "accelerate")
    assert yaml.safe_load(emit(fsdp_all, "accelerate")["accelerate_config.yaml"])["fsdp_config"][
        "fsdp_activation_checkpointing"] is True
    some = emit(fsdp_some, "accelerate")
    assert "fitplan_checkpointing.py" in some
    assert yaml.safe_load(some["accelerate_config.yaml"])["fsdp_config"]["fsdp_activation_checkpointing"] is False


# --- Megatron-LM: flag names ---------------------------------------------------------------------------------


def unknown_flags(arguments: list[str]) -> list[str]:
    """Flags Megatron-LM does not define (fitplan's list mirrors megatron/training/arguments.py)."""
    return [a for a in arguments if a.startswith("--") and a not in megatron.KNOWN_FLAGS]


def flag_values(arguments: list[str]) -> dict[str, str | bool]:
    values: dict[str, str | bool] = {}
    for i, token in enumerate(arguments):
        if token.startswith("--"):
            following = arguments[i + 1] if i + 1 < len(arguments) else "--"
            values[token] = True if following.startswith("--") else following
    return values


def test_unknown_flags_flags_a_bad_list():
    assert unknown_flags(["--tensor-model-parallel-size", "2", "--bf16"]) == []
    assert unknown_flags(["--tensor-model-parallel-size", "2", "--tensor-parallel-degree", "2", "--bf-16"]) == [
        "--tensor-parallel-degree", "--bf-16"]


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_flags_are_known_and_match_plan(name, plans):
    plan = plans[name]
    d = plan.decisions
    arguments = megatron.arguments(plan)
    assert "megatron" in plan.launchers and d.engine is Engine.MEGATRON
    assert unknown_flags(arguments) == []
    assert emit(plan, "megatron")["megatron_args.txt"].split() == arguments
    values = flag_values(arguments)
    assert values["--tensor-model-parallel-size"] == str(d.tp)
    assert values["--micro-batch-size"] == str(d.micro_batch)
    assert values["--global-batch-size"] == str(plan.inputs.global_batch)
    assert ("--bf16" in values, "--fp16" in values) == (d.precision.value in ("bf16-mixed", "bf16", "fp8"),
                                                        d.precision.value == "fp16-mixed")
    full = sum(m is Checkpoint.FULL for m in d.checkpoint)
    if full:
        assert (values["--recompute-granularity"], values["--recompute-num-layers"]) == ("full", str(full))
    elif Checkpoint.SELECTIVE in d.checkpoint:
        assert values["--recompute-granularity"] == "selective"
    else:
        assert "--recompute-granularity" not in values
    assert ("--use-distributed-optimizer" in values) == (d.zero == 1)


# --- emitters refuse what they cannot express ------------------------------------------------------------------


def selective(plan: Plan) -> Plan:
    return with_checkpoint(plan, (Checkpoint.SELECTIVE,) * len(plan.decisions.checkpoint))


def pure_bf16_zero0(plan: Plan) -> Plan:
    from costmodels import Precision

    return dataclasses.replace(plan, decisions=dataclasses.replace(
        plan.decisions, engine=Engine.DEEPSPEED, zero=0, optimizer_offload=Offload.NONE,
        param_offload=Offload.NONE, precision=Precision.BF16))


REFUSALS = [
    ("ddp-full-ckpt", selective, "hf", "selective recompute"),
    ("zero3-accum", selective, "accelerate", "selective recompute"),
    ("zero3-accum", selective, "deepspeed", "selective recompute"),
    ("tp2", None, "hf", "tensor parallelism"),
    ("fsdp2-reshard", None, "deepspeed", "engine fsdp2"),
    ("zero3-accum", None, "torchrun", "engine deepspeed ZeRO-3"),
    ("lora", None, "megatron", "LoRA"),
    ("zero3-offload-all", None, "megatron", "parameter offload"),
    # DeepSpeed 0.19 rejects bf16_master_weights_and_grads at stage 0 (runtime/config.py _do_error_check).
    ("zero3-accum", pure_bf16_zero0, "deepspeed", "pure bf16"),
    ("zero3-accum", pure_bf16_zero0, "hf", "pure bf16"),
]


@pytest.mark.parametrize(("name", "change", "launcher", "problem"), REFUSALS)
def test_emit_refuses_what_launcher_cannot_express(name, change, launcher, problem, plans):
    plan = change(plans[name]) if change else plans[name]
    with pytest.raises(FitplanError, match=problem) as error:
        emit(plan, launcher)
    assert launcher in str(error.value)


def test_emit_unknown_launcher_names_the_choices(plans):
    with pytest.raises(FitplanError, match="Unknown launcher"):
        emit(plans["zero3-accum"], "nemo")


@pytest.mark.parametrize("name", list(CASES))
def test_every_launcher_the_plan_lists_emits_it(name, plans):
    """`plan.launchers` promises these emitters accept the plan (and the others refuse it)."""
    plan = plans[name]
    for launcher in ("deepspeed", "hf", "accelerate", "torchrun", "megatron"):
        if launcher in plan.launchers:
            assert emit(plan, launcher)
        else:
            with pytest.raises(FitplanError):
                emit(plan, launcher)


@pytest.mark.parametrize(("launcher", "gpus", "pins"), [
    ("hf", "1xT4", {"checkpoint": "selective"}),
    ("deepspeed", "1xA100", {"precision": ("bf16",)}),  # picks ZeRO-0 pure bf16
])
def test_solve_for_a_launcher_returns_a_plan_it_can_emit(launcher, gpus, pins):
    try:
        plan = solve("gpt2", gpus, seq_len=512, global_batch=8, time_limit=5, launcher=launcher, **pins)
    except FitplanError:
        return  # refusing pins the launcher cannot express is also correct
    assert launcher in plan.launchers


# --- guide methods carried by the emitted configs (tf32, torch.compile, data loading) ---------------------------


def test_tf32_compile_and_dataloader_settings_reach_trainingarguments_and_accelerate(monkeypatch, tmp_path):
    import transformers.training_args
    from accelerate.commands.config.config_args import load_config_from_file

    plan = solve("gpt2", "8xA100", seq_len=512, global_batch=64, precision=("tf32",), compile="on", time_limit=5)
    assert plan.decisions.precision.value == "tf32" and plan.decisions.compile
    # tf32 needs an Ampere GPU at construction time; this machine has none, so the probe is stood in for.
    monkeypatch.setattr(transformers.training_args, "is_torch_tf32_available", lambda: True)
    args = training_arguments(plan, tmp_path, monkeypatch)
    assert args.tf32 is True and args.torch_compile is True
    assert args.dataloader_num_workers == plan.decisions.dataloader_num_workers >= 1
    assert args.dataloader_pin_memory is True
    folder = write(emit(plan, "accelerate"), tmp_path / "acc")
    loaded = load_config_from_file(str(folder / "accelerate_config.yaml"))
    assert str(loaded.dynamo_config.get("dynamo_backend", "")).upper().endswith("INDUCTOR")
    fsdp = solve("gpt2", "8xA100", seq_len=512, global_batch=64, precision=("tf32",), compile="on", time_limit=5,
                 launcher="torchrun")
    script = emit(fsdp, "torchrun")["train_fitplan.py"]
    assert "allow_tf32 = d[\"precision\"] == \"tf32\"" in script and "layer.compile()" in script
