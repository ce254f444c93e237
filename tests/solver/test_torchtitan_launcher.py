"""The torchtitan launcher's files, read by torchtitan itself: each emitted job is parsed by torchtitan's own
`ConfigManager` (the parser `torchtitan.train` runs), and every decided knob must be in the `Trainer.Config` it
returns; every combination the launcher refuses must come with a reason. The launch scripts run under bash with fake
`torchrun`/`srun`/`scontrol` that only record their argv, and the recorded worker command is run by Python to the
point where torchtitan has parsed the job (`--help`).

One plan is solved (Llama-3.2-1B, which torchtitan builds as its llama3 1B flavour); the emitter reads only the
plan's inputs and decisions, so each case replaces decisions on that plan. Expected values are written out from the
decisions here, not taken from the emitter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tomllib

from costmodels import Engine, Offload, Optimizer, Precision
from costmodels.config import Loss
from graphs import Checkpoint, FitplanError
from solver import solve
from solver.plan.capability import unsupported
from solver.plan.launchers import torchtitan
from solver.plan.launchers.common import BETAS, EPS, LEARNING_RATE, MAX_GRAD_NORM, WEIGHT_DECAY
from solver.plan.record import ClusterInfo, Inputs, LoraDecision, ModelShape, Plan, RopeScaling

pytest.importorskip("torchtitan")
pytest.importorskip("triton")

CATALOG = Path(__file__).resolve().parents[2] / "graphs" / "catalog"
LAYERS = 16  # Llama-3.2-1B


@pytest.fixture(scope="module")
def base() -> Plan:
    plan = solve("meta-llama/Llama-3.2-1B", "8xH100", seq_len=2048, global_batch=64, time_limit=5, engine="fsdp2",
                 zero=3)
    assert plan.inputs.cluster.nodes == 1 and plan.decisions.dp * plan.decisions.tp == 8
    return plan


def vary(plan: Plan, **changes: Any) -> Plan:
    """`plan` with decisions replaced; `nodes` re-sizes the cluster to that many 8-GPU nodes."""
    nodes = changes.pop("nodes", None)
    if nodes:
        cluster = dataclasses.replace(plan.inputs.cluster, nodes=nodes, spec=f"{nodes}x8xH100")
        plan = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, cluster=cluster))
    return dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, **changes))


FULL = (Checkpoint.FULL,) * LAYERS
NONE = (Checkpoint.NONE,) * LAYERS
BASE = {"engine": Engine.FSDP2, "zero": 3, "tp": 1, "dp": 8, "micro_batch": 2, "grad_accum": 4,
        "precision": Precision.BF16_MIXED, "optimizer": Optimizer.ADAMW_FUSED, "checkpoint": NONE, "compile": False,
        "sequence_parallel": False, "optimizer_offload": Offload.NONE, "param_offload": Offload.NONE, "lora": None,
        "attention": "sdpa"}
# Every knob value torchtitan runs, one change from BASE at a time (plus TP with and without sequence parallelism).
SUPPORTED: dict[str, dict[str, Any]] = {
    "fsdp2-zero3": {},
    "fsdp2-zero2": {"zero": 2},
    "ddp": {"engine": Engine.DDP, "zero": 0},
    "tp2-sp": {"tp": 2, "dp": 4, "grad_accum": 8, "sequence_parallel": True},
    "tp2-no-sp": {"tp": 2, "dp": 4, "grad_accum": 8},
    "ddp-tp2": {"engine": Engine.DDP, "zero": 0, "tp": 2, "dp": 4, "grad_accum": 8},
    "full-ckpt": {"checkpoint": FULL},
    "compile": {"compile": True},
    "pure-bf16": {"precision": Precision.BF16},
    "fp32": {"precision": Precision.FP32},
    "fp8": {"precision": Precision.FP8, "compile": True},
    "fp8-tp2": {"precision": Precision.FP8, "tp": 2, "dp": 4, "grad_accum": 8, "sequence_parallel": True},
    "adamw-foreach": {"optimizer": Optimizer.ADAMW},
    "cpu-offload": {"optimizer_offload": Offload.CPU, "param_offload": Offload.CPU},
    "two-nodes": {"nodes": 2, "dp": 16, "grad_accum": 2, "checkpoint": FULL},
    # hybrid sharding (issue 34): one shard group per node, two replicas
    "hsdp-two-nodes": {"nodes": 2, "dp": 16, "dp_replicate": 2, "grad_accum": 2, "checkpoint": FULL},
    "op-sac": {"checkpoint": (Checkpoint.OP_SELECTIVE,) * LAYERS},
    "chunked-loss": {"loss": Loss.CHUNKED},
    "plain-loss": {"loss": Loss.HF},
}
LORA = LoraDecision(rank=8, alpha=16, targets=("all-linear",), dropout=0.0)
# Every knob value torchtitan cannot run, one change from BASE at a time, and a word its reason must contain.
UNSUPPORTED: dict[str, tuple[dict[str, Any], str]] = {
    "deepspeed": ({"engine": Engine.DEEPSPEED, "zero": 3}, "engine deepspeed"),
    "nvme": ({"optimizer_offload": Offload.NVME, "param_offload": Offload.NVME}, "NVMe"),
    "optimizer-offload-only": ({"optimizer_offload": Offload.CPU}, "together"),
    "ddp-offload": ({"engine": Engine.DDP, "zero": 0, "optimizer_offload": Offload.CPU,
                     "param_offload": Offload.CPU}, "FSDP2"),
    "fp16": ({"precision": Precision.FP16_MIXED}, "loss scaler"),
    "tf32": ({"precision": Precision.TF32}, "TF32"),
    "adamw-8bit": ({"optimizer": Optimizer.ADAMW_8BIT}, "adamw-8bit"),
    "adafactor": ({"optimizer": Optimizer.ADAFACTOR}, "adafactor"),
    "sgd": ({"optimizer": Optimizer.SGD}, "sgd"),
    "selective": ({"checkpoint": (Checkpoint.SELECTIVE,) * LAYERS}, "op-level SAC"),
    "some-layers": ({"checkpoint": (Checkpoint.FULL,) * 8 + (Checkpoint.NONE,) * 8}, "every layer"),
    "every-other-layer": ({"checkpoint": (Checkpoint.FULL, Checkpoint.NONE) * 8}, "every layer"),
    "op-sac-some-layers": ({"checkpoint": (Checkpoint.OP_SELECTIVE,) * 8 + (Checkpoint.FULL,) * 8}, "every layer"),
    "lora": ({"lora": LORA}, "LoRA"),
    "eager-attention": ({"attention": "eager"}, "FlexAttention"),
    # issue 13: pipelines are walked in test_parallel_launchers.py (the 1B flavour ties its embeddings, which
    # torchtitan refuses under PP)
    "context-parallel": ({"cp": 2, "dp": 4, "grad_accum": 8}, "all-gathers"),
    "expert-parallel": ({"ep": 2}, "MoE flavours"),  # refused whatever the model (here a dense one)
}


def emitted(plan: Plan, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in torchtitan.emit(plan).items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def parse(monkeypatch):
    """torchtitan's own ConfigManager on an emitted folder, as `torchtitan.train` runs it.

    Float8LinearConverter refuses to convert unless this host has an SM 8.9+ GPU; the plan is for H100s, so the
    test stands in an H100's capability there (the conversion itself is torchao's, on the config, no GPU needed).
    """
    import torchtitan.components.quantization.float8 as float8
    from torchtitan.config import ConfigManager

    monkeypatch.setattr(float8, "has_cuda_capability", lambda major, minor: (major, minor) <= (9, 0))

    def run(folder: Path, *overrides: str) -> Any:
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.delitem(sys.modules, torchtitan.MODULE, raising=False)  # each folder's module, fresh
        config = ConfigManager().parse_args(["--module", torchtitan.MODULE, "--config", torchtitan.CONFIG,
                                             *overrides])
        monkeypatch.delitem(sys.modules, torchtitan.MODULE, raising=False)
        return config

    return run


def check_expressed(config: Any, plan: Plan) -> None:
    """Every decision of `plan` in torchtitan's parsed Trainer.Config."""
    from torchtitan.components.quantization.float8 import Float8Linear
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    d, inputs = plan.decisions, plan.inputs
    world = inputs.cluster.nodes * inputs.cluster.gpus_per_node
    par, train = config.parallelism, config.training
    # parallelism: the world is exactly tp x dp, sharded (FSDP2) or replicated (DDP)
    assert par.tensor_parallel_degree == d.tp
    assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree * d.tp == world
    if d.engine is Engine.FSDP2:  # sharded over dp / dp_replicate ranks, replicated across dp_replicate groups
        assert (par.data_parallel_shard_degree, par.data_parallel_replicate_degree) == \
            (d.dp // d.dp_replicate, d.dp_replicate)
        assert par.fsdp_reshard_after_forward == {3: "always", 2: "never"}[d.zero]
    else:
        assert (par.data_parallel_shard_degree, par.data_parallel_replicate_degree) == (1, d.dp)
    assert par.enable_sequence_parallel is d.sequence_parallel
    # the mesh torchtitan's trainer builds from them: HSDP where both data-parallel degrees exceed one
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(par, world)
    assert (dims.dp_replicate, dims.dp_shard) == (par.data_parallel_replicate_degree, par.data_parallel_shard_degree)
    assert dims.fsdp_enabled is (d.engine is Engine.FSDP2)
    assert dims.dp_replicate_enabled is (d.dp_replicate > 1 if d.engine is Engine.FSDP2 else d.dp > 1)
    assert par.pipeline_parallel_degree == 1 and par.context_parallel_degree == 1
    # batch: micro-batch per rank, accumulation through the global batch (torchtitan divides it back)
    assert train.local_batch_size == d.micro_batch
    assert train.global_batch_size == inputs.global_batch == d.micro_batch * d.grad_accum * d.dp
    assert train.seq_len == inputs.seq_len
    assert train.max_norm == MAX_GRAD_NORM
    # precision: pure bf16 keeps bf16 masters; mixed casts fp32 masters to bf16 (fp8: bf16 plus float8 Linears)
    masters, compute = {Precision.BF16: ("bfloat16", "bfloat16"), Precision.BF16_MIXED: ("float32", "bfloat16"),
                        Precision.FP8: ("float32", "bfloat16"), Precision.FP32: ("float32", "float32")}[d.precision]
    assert (train.dtype, train.mixed_precision_param, train.mixed_precision_reduce) == (masters, compute, "float32")
    model = config.model_spec.model
    layer_linears = [type(layer.feed_forward.w1) for layer in model.layers]
    fp8 = d.precision is Precision.FP8
    assert all((cls is Float8Linear.Config) is fp8 for cls in layer_linears), layer_linears
    assert type(model.lm_head) is not Float8Linear.Config  # the LM head stays bf16, as priced
    assert train.enable_cpu_offload is (d.param_offload is Offload.CPU)
    assert train.disable_cuda_graphs is True
    # activation checkpointing: one policy for every layer
    if all(mode is Checkpoint.FULL for mode in d.checkpoint):
        assert type(config.activation_checkpoint) is FullAC.Config
    elif all(mode is Checkpoint.OP_SELECTIVE for mode in d.checkpoint):
        assert type(config.activation_checkpoint) is SelectiveAC.Config
    else:
        assert config.activation_checkpoint is None
    # the loss fitplan priced on torchtitan's code: its ChunkedLossWrapper, or the plain cross-entropy (issue 37)
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    assert type(config.loss) is (ChunkedLossWrapper.Config if d.loss is Loss.CHUNKED else CrossEntropyLoss.Config)
    assert config.compile.enable is d.compile
    if d.compile:
        assert "model" in config.compile.components
    # optimizer: AdamW, fused or foreach as decided, with fitplan's hyperparameters
    (group,) = config.optimizer.param_groups
    assert (group.pattern, group.optimizer_name) == (".*", "AdamW")
    assert config.optimizer.implementation == ("fused" if d.optimizer is Optimizer.ADAMW_FUSED else "foreach")
    assert group.optimizer_kwargs == {"lr": LEARNING_RATE, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
    assert config.dataloader.num_workers == d.dataloader_num_workers
    assert config.dataloader.pin_memory is d.dataloader_pin_memory
    # the model torchtitan builds is the planned one
    assert config.model_spec.name == "llama3" and config.model_spec.flavor == "1B"
    assert (model.dim, len(model.layers), model.vocab_size) == (inputs.hidden_size, inputs.num_layers,
                                                               inputs.shape.vocab)
    qkv = model.layers[0].attention.qkv_linear
    assert (qkv.n_heads, qkv.n_kv_heads) == (inputs.shape.heads, inputs.shape.kv_heads)


@pytest.mark.slow
@pytest.mark.parametrize("name", SUPPORTED)
def test_torchtitan_config_manager_parses_every_decided_knob(name, base, parse, tmp_path):
    plan = vary(base, **{**BASE, **SUPPORTED[name]})
    assert unsupported("torchtitan", plan.decisions, checkpoint=plan.decisions.checkpoint,
                       lora=plan.decisions.lora is not None) == []
    check_expressed(parse(emitted(plan, tmp_path)), plan)


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_every_unsupported_value_is_refused_with_its_reason(name, base, tmp_path):
    changes, word = UNSUPPORTED[name]
    # what the search asks about (space.Outer has these knobs; knobs BASE leaves out keep the plan's values)
    decided = {field.name: getattr(base.decisions, field.name) for field in dataclasses.fields(base.decisions)}
    knobs = SimpleNamespace(**{**decided, **BASE, **changes})
    problems = unsupported("torchtitan", knobs, checkpoint=knobs.checkpoint, lora=knobs.lora is not None) + \
        torchtitan.model_problems(base.inputs, knobs.attention)
    assert len(problems) == 1 and word in problems[0] and torchtitan.TORCHTITAN in problems[0], problems
    try:
        plan = vary(base, **{**BASE, **changes})
    except ValueError:  # Config itself refuses the combination, so no plan holds it; the rule above still answers
        return
    with pytest.raises(FitplanError, match="torchtitan launcher cannot run"):
        torchtitan.emit(plan)


@pytest.mark.slow
def test_command_line_overrides_apply_on_top_of_the_job(base, parse, tmp_path):
    plan = vary(base, **BASE)
    config = parse(emitted(plan, tmp_path), "--training.steps", "7", "--lr-scheduler.warmup-steps", "3")
    assert (config.training.steps, config.lr_scheduler.warmup_steps) == (7, 3)
    assert config.training.local_batch_size == plan.decisions.micro_batch  # the rest as the job file says


# --- the model: torchtitan builds only its own flavours --------------------------------------------------------


def test_flavour_table_is_torchtitans():
    """solver/plan/launchers/data/torchtitan_flavors.json row by row against the installed torchtitan's model
    registry."""
    import importlib

    assert torchtitan.flavors()
    for row in torchtitan.flavors():
        model = importlib.import_module(f"torchtitan.models.{row['module']}").model_registry(row["flavor"]).model
        layer = model.layers[0]
        qkv, rope = layer.attention.qkv_linear, layer.attention.rope
        assert (model.dim, len(model.layers), model.vocab_size, bool(model.enable_weight_tying)) == \
            (row["hidden"], row["layers"], row["vocab"], row["tied_embeddings"]), row
        assert (qkv.n_heads, qkv.n_kv_heads, qkv.head_dim) == (row["heads"], row["kv_heads"], row["head_dim"]), row
        assert float(rope.theta) == row["rope_theta"]
        if row["ffn_hidden"] is None:  # an MoE flavour: every layer routes, none has a dense FFN
            assert all(block.moe is not None and block.feed_forward is None for block in model.layers), row
            moe = layer.moe
            assert (moe.num_experts, moe.router.top_k, moe.routed_experts.inner_experts.hidden_dim) == \
                (row["experts"], row["top_k"], row["expert_ffn_hidden"]), row
        else:
            assert all(block.moe is None for block in model.layers), row
            assert layer.feed_forward.w1.out_features == row["ffn_hidden"], row
            assert "experts" not in row, row


def catalog_inputs(name: str, cluster: ClusterInfo) -> Inputs:
    """Inputs carrying a catalog model's shape as its config.json states it (the reference for the match)."""
    values = json.loads((CATALOG / f"{name.replace('/', '--')}.json").read_text())
    heads = values["num_attention_heads"]
    scaling = values.get("rope_scaling") or {}
    rope_scaling = RopeScaling(kind=scaling["rope_type"], factor=scaling["factor"],
                               low_freq_factor=scaling["low_freq_factor"], high_freq_factor=scaling["high_freq_factor"],
                               original_max_positions=scaling["original_max_position_embeddings"]) \
        if scaling.get("rope_type") == "llama3" else None
    shape = ModelShape(heads=heads, kv_heads=values.get("num_key_value_heads") or heads,
                       head_dim=values.get("head_dim") or values["hidden_size"] // heads,
                       ffn_hidden=values["intermediate_size"], vocab=values["vocab_size"],
                       max_positions=values["max_position_embeddings"], normalization="RMSNorm", gated_silu=True,
                       rope=True, rope_theta=float(values.get("rope_theta", 10000.0)),  # LlamaConfig default
                       rope_scaling=rope_scaling,
                       tied_embeddings=bool(values.get("tie_word_embeddings")), linear_bias=False,
                       experts=values.get("num_local_experts") or values.get("num_experts") or 0,
                       top_k=values.get("num_experts_per_tok") or 0,
                       expert_ffn_hidden=values.get("moe_intermediate_size") or 0)
    return Inputs(model=name, model_source="catalog", architecture=values["architectures"][0],
                  hidden_size=values["hidden_size"], num_layers=values["num_hidden_layers"], cluster=cluster,
                  seq_len=2048, global_batch=8, tokens_per_step=16384, headroom=0.1, shape=shape)


@pytest.mark.parametrize(("model", "flavor"), [
    ("meta-llama/Llama-3.2-1B", "llama3 1B"), ("meta-llama/Llama-3.2-3B", "llama3 3B"),
    ("meta-llama/Llama-3.1-8B", "llama3 8B"), ("meta-llama/Llama-3.1-70B", "llama3 70B"),
    ("meta-llama/Llama-3.1-405B", "llama3 405B"), ("Qwen/Qwen3-8B", "qwen3 8B"), ("Qwen/Qwen3-32B", "qwen3 32B"),
    ("meta-llama/Llama-2-7b-hf", None), ("Qwen/Qwen2.5-7B", None), ("mistralai/Mistral-7B-v0.1", None),
    ("Qwen/Qwen3-30B-A3B", "qwen3 30B-A3B"), ("mistralai/Mixtral-8x7B-v0.1", None),
])
def test_catalog_models_map_to_the_torchtitan_flavour_of_their_shape(model, flavor, base):
    inputs = catalog_inputs(model, base.inputs.cluster)
    row = torchtitan.flavor_of(inputs)
    assert (row and f"{row['module']} {row['flavor']}") == flavor
    problems = torchtitan.model_problems(inputs)
    assert (problems == []) is (flavor is not None)
    if flavor is None:
        assert "flavour" in problems[0]


@pytest.mark.slow
def test_moe_flavour_job_builds_the_planned_qwen3_moe_model(base, parse, tmp_path):
    """A plan of Qwen3-30B-A3B (its decisions FSDP2 over 8 GPUs, as a torchtitan plan of it runs) emits a job whose
    model torchtitan builds as its 30B-A3B flavour: every layer routed over the planned experts."""
    inputs = catalog_inputs("Qwen/Qwen3-30B-A3B", base.inputs.cluster)
    plan = dataclasses.replace(vary(base, **{**BASE, "checkpoint": (Checkpoint.FULL,) * inputs.num_layers}),
                               inputs=inputs)
    assert unsupported("torchtitan", plan.decisions, checkpoint=plan.decisions.checkpoint, lora=False) == []
    config = parse(emitted(plan, tmp_path))
    assert (config.model_spec.name, config.model_spec.flavor) == ("qwen3", "30B-A3B")
    model = config.model_spec.model
    assert (model.dim, len(model.layers), model.vocab_size) == (inputs.hidden_size, inputs.num_layers,
                                                               inputs.shape.vocab)
    assert all(block.moe.num_experts == inputs.shape.experts for block in model.layers)
    assert config.parallelism.expert_parallel_degree == 1


@pytest.mark.parametrize(("model", "flavor"), [("meta-llama/Meta-Llama-3-8B", "8B"),
                                               ("meta-llama/Llama-3.2-1B", "1B"), ("meta-llama/Llama-3.1-8B", "8B")])
def test_job_builds_the_rope_frequencies_transformers_builds(model, flavor, base, parse, tmp_path):
    """Issue 35 item 6: torchtitan's llama3 flavours all scale RoPE by Llama 3.1's factor 8; the job sets the model's
    own scaling (none for Meta-Llama-3, factor 32 for Llama-3.2), so the rotary frequencies are transformers'."""
    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from graphs import resolve

    inputs = catalog_inputs(model, base.inputs.cluster)
    plan = dataclasses.replace(vary(base, **{**BASE, "checkpoint": NONE[:1] * inputs.num_layers}), inputs=inputs)
    config = parse(emitted(plan, tmp_path))
    assert config.model_spec.flavor == flavor
    ropes = {id(layer.attention.rope): layer.attention.rope for layer in config.model_spec.model.layers}
    values = resolve(model).as_dict()
    expected = LlamaRotaryEmbedding(AutoConfig.for_model(values.pop("model_type"), **values)).inv_freq
    for rope in ropes.values():
        cache = dataclasses.replace(rope, max_seq_len=2).build().cache  # exp(i * position * frequency)
        torch.testing.assert_close(torch.angle(cache[1]).double(), expected.double(), rtol=1e-5, atol=1e-7)


def test_solved_plan_maps_to_llama3_1b(base):
    row = torchtitan.flavor_of(base.inputs)
    assert (row["module"], row["flavor"]) == ("llama3", "1B")


# --- the files: TOML text and launch lines -----------------------------------------------------------------------

HOSTILE = "x;touch PWNED1 $(touch PWNED2) `touch PWNED3` 'q' \"dq\" \\ # \x01\x7f\ttab é 😀\n[training]\nsteps = 1"


def test_toml_values_round_trip_through_tomllib():
    values = {"s": HOSTILE, "i": 7, "f": 2e-05, "g": 0.5, "b": False, "l": ["a", "b"], "t": [0.9, 0.999],
              "nested": {"x": 1, "deeper": {"y": "z"}}}
    text = torchtitan.toml_text({"top": 1, "section": values}, header=HOSTILE)
    assert tomllib.loads(text) == {"top": 1, "section": {**values, "t": [0.9, 0.999]}}


def test_hostile_local_model_path_stays_one_toml_string(base, tmp_path):
    plan = vary(base, **BASE)
    plan = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, model=HOSTILE, model_source="local"))
    folder = emitted(plan, tmp_path / "out")
    job = tomllib.loads((folder / torchtitan.JOB_FILE).read_text())
    assert job["hf_assets_path"] == HOSTILE
    assert job["training"]["steps"] == torchtitan.STEPS  # the "[training]" inside the name made no table
    calls = run_bash(folder / "torchtitan_launch.sh", tmp_path / "run", {})
    assert len(calls) == 1 and not list(tmp_path.rglob("PWNED*"))


FAKES = {
    "torchrun": None, "srun": None,
    # Slurm's hostname expansion, as `scontrol show hostnames` prints it: one host per line, the first hosts the
    # rendezvous.
    "scontrol": "printf 'gpu-a17\\ngpu-a18\\n'",
}


def run_bash(script: Path, work: Path, env: dict[str, str], *args: str) -> list[list[str]]:
    """Run `script` with bash in a copy of its folder, fake launchers first on PATH; the argv of each call."""
    bin_dir, calls = work / "bin", work / "calls"
    for folder in (bin_dir, calls, work / "cwd"):
        folder.mkdir(parents=True)
    for name, body in FAKES.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n" if body else
                        f"#!/bin/sh\nprintf '%s\\0' {name} \"$@\" > \"$(mktemp \"$ARGV_DIR/call.XXXXXX\")\"\n"
                        f"printf '%s' \"${{PYTORCH_CUDA_ALLOC_CONF-unset}}\" > \"$ARGV_DIR/../alloc_conf.{name}\"\n")
        path.chmod(0o755)
    for file in script.parent.iterdir():
        (work / "cwd" / file.name).write_bytes(file.read_bytes())
    done = subprocess.run(["bash", script.name, *args], cwd=work / "cwd", capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGV_DIR": str(calls), "HOME": str(work), **env},
                          check=False)
    assert done.returncode == 0, done.stderr
    return [call.read_bytes().decode().split("\0")[:-1] for call in sorted(calls.iterdir())]


PROGRAM = ["-m", "torchtitan.train", "--module", "fitplan_torchtitan", "--config", "fitplan"]


@pytest.fixture(scope="module")
def two_nodes(base, tmp_path_factory) -> Path:
    plan = vary(base, **{**BASE, **SUPPORTED["two-nodes"]})
    return emitted(plan, tmp_path_factory.mktemp("two-nodes"))


def test_each_node_runs_torchrun_with_its_rank_and_the_master_from_the_environment(two_nodes, tmp_path):
    calls = run_bash(two_nodes / "torchtitan_launch.sh", tmp_path, {"NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3"},
                     "--training.steps", "5")
    assert calls == [["torchrun", "--nnodes", "2", "--nproc_per_node", "8", "--node_rank", "1", "--master_addr",
                      "10.1.2.3", "--master_port", "29500", *PROGRAM, "--training.steps", "5"]]


def test_slurm_script_runs_one_torchrun_per_node_with_c10d_rendezvous_at_the_first_host(two_nodes, tmp_path):
    text = (two_nodes / "slurm_launch.sh").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=8" in text
    calls = run_bash(two_nodes / "slurm_launch.sh", tmp_path, {"SLURM_JOB_NODELIST": "gpu-a[17-18]",
                                                               "SLURM_JOB_ID": "4242"})
    assert calls == [["srun", "torchrun", "--nnodes", "2", "--nproc_per_node", "8", "--rdzv_backend", "c10d",
                      "--rdzv_id", "4242", "--rdzv_endpoint", "gpu-a17:29500", *PROGRAM]]


def test_the_launched_processes_get_the_allocator_setting_the_memory_model_assumes(two_nodes, tmp_path):
    """torchrun (and srun, which passes its environment on) start with expandable segments (overhead.py)."""
    nodes = {"NODE_RANK": "0", "MASTER_ADDR": "10.1.2.3", "SLURM_JOB_NODELIST": "gpu-a[17-18]"}
    for script, launcher in (("torchtitan_launch.sh", "torchrun"), ("slurm_launch.sh", "srun")):
        run_bash(two_nodes / script, tmp_path / script, nodes)
        assert (tmp_path / script / f"alloc_conf.{launcher}").read_text() == "expandable_segments:True"


def test_one_node_emits_no_slurm_script(base):
    assert "slurm_launch.sh" not in torchtitan.emit(vary(base, **BASE))


@pytest.mark.slow
def test_the_worker_command_torchrun_starts_parses_the_job(two_nodes, tmp_path):
    """What each rank runs (`python -m torchtitan.train --module ... --config ...` in the launch folder, as torchrun -m
    starts it) finds the config module there: the same argv given to torchtitan's config manager's own main, which
    parses exactly as torchtitan.train does and prints the Trainer.Config."""
    (call,) = run_bash(two_nodes / "torchtitan_launch.sh", tmp_path / "bash", {})
    worker = call[call.index("-m"):]
    assert worker[:2] == ["-m", "torchtitan.train"]
    done = subprocess.run([sys.executable, "-m", "torchtitan.config.manager", *worker[2:]], cwd=two_nodes,
                          capture_output=True, text=True, timeout=120, check=False, env={**os.environ,
                                                                                         "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-2000:]
    for shown in ("flavor='1B'", "local_batch_size=2,", "global_batch_size=64,", "data_parallel_shard_degree=16,"):
        assert shown in done.stdout, shown
