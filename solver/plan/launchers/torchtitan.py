"""torchtitan: the plan as a torchtitan job, run by torchtitan's own trainer and config manager.

torchtitan 0.3.0 (the PyPI release this targets) reads no TOML job file: since PR #2386 a job is a Python function
returning `Trainer.Config`, selected with `--module M --config F`, with `--section.key value` overrides on top
(torchtitan/config/manager.py). So the plan's settings go into `fitplan_torchtitan.toml`, keyed by torchtitan's own
section and field names, and `fitplan_torchtitan.py` is a fixed config module (templates/fitplan_torchtitan.py, the
same text for every plan) that builds the `Trainer.Config` from it:
`torchrun ... -m torchtitan.train --module fitplan_torchtitan --config fitplan`.
Field names are checked by torchtitan's dataclasses when the job starts (an unknown key is a TypeError there).
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from importlib import resources
from typing import Any

from costmodels import Engine, Offload, Optimizer, Precision
from costmodels.config import Loss
from costmodels.pipeline_schedule import TORCH_CLASS
from graphs import Checkpoint, FitplanError
from solver.plan.capability import unsupported
from solver.plan.launchers.common import (
    BETAS,
    EPS,
    LEARNING_RATE,
    MAX_GRAD_NORM,
    WEIGHT_DECAY,
    about,
    launch_environment,
)
from solver.plan.launchers.nodes import nodes_note, slurm_script, torchrun_argv
from solver.plan.launchers.shell import comment, launch_script
from solver.plan.launchers.templating import python_file
from solver.plan.record import Decisions, Inputs, Plan

TORCHTITAN = "0.3.0"
JOB_FILE = "fitplan_torchtitan.toml"
MODULE = "fitplan_torchtitan"  # the config module's name: `--module` imports it from the launch folder
CONFIG = "fitplan"  # the function in it: `--config`
# The training program every rank runs (torchtitan's own entry point; `torchrun -m`, as its run_train.sh does).
PROGRAM = ["-m", "torchtitan.train", "--module", MODULE, "--config", CONFIG]
# fitplan decides how to run, not for how long: torchtitan's own llama3_8b job length, overridable on the command
# line (--training.steps, --lr-scheduler.warmup-steps), like every other field.
STEPS = 1000
WARMUP_STEPS = 0
DATASET = "c4"  # torchtitan's HuggingFaceTextDataLoader name for allenai/c4 (its llama3_8b job); --dataloader.dataset


# --- what torchtitan 0.3.0 cannot express (knob rules: solver.plan.capability; model rules here) ---------------------

_V = f"torchtitan {TORCHTITAN}"


# fitplan's per-layer mode -> torchtitan's policy for every layer (`activation_checkpoint` subcommands: none, full,
# selective = SelectiveAC: op-level SAC with torchtitan's save list, every second matmul recomputed).
AC_POLICY = {Checkpoint.NONE: "none", Checkpoint.FULL: "full", Checkpoint.OP_SELECTIVE: "selective"}


@cache
def flavors() -> tuple[dict[str, Any], ...]:
    """torchtitan's dense model flavours and their shapes (solver/plan/launchers/data/torchtitan_flavors.json)."""
    text = resources.files("solver.plan.launchers").joinpath("data/torchtitan_flavors.json").read_text(encoding="utf-8")
    return tuple(json.loads(text)["flavors"])


def _shape_of(inputs: Inputs) -> dict[str, Any] | None:
    shape = inputs.shape
    if shape is None:
        return None
    return {"architecture": inputs.architecture, "hidden": inputs.hidden_size, "layers": inputs.num_layers,
            "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "ffn_hidden": shape.ffn_hidden, "vocab": shape.vocab, "tied_embeddings": shape.tied_embeddings,
            "rope_theta": shape.rope_theta, "experts": shape.experts, "top_k": shape.top_k,
            "expert_ffn_hidden": shape.expert_ffn_hidden}


_DENSE = {"experts": 0, "top_k": 0, "expert_ffn_hidden": 0}
"""What a dense flavour's row leaves out."""


def flavor_of(inputs: Inputs) -> dict[str, Any] | None:
    """The torchtitan flavour whose architecture and shape are the plan's model, or None. An MoE flavour routes
    every layer (its row's ffn_hidden is null): the model's dense FFN width, unused there, is not compared."""
    shape = _shape_of(inputs)
    if shape is None or (inputs.shape is not None and inputs.shape.linear_bias):
        return None
    for row in flavors():
        row = {**_DENSE, **row}
        if all(_same(k, row[k], v) for k, v in shape.items() if not (k == "ffn_hidden" and row[k] is None)):
            return row
    return None


def _same(key: str, ours: Any, theirs: Any) -> bool:
    if key == "rope_theta":
        return theirs is not None and math.isclose(ours, theirs)
    return ours == theirs


def model_problems(inputs: Inputs, attention: str = "sdpa") -> list[str]:
    """What torchtitan cannot run of the plan's model: it builds only its own flavours (model_registry(flavor)), and
    its language models attend with FlexAttention or varlen kernels only."""
    problems = []
    if inputs.shape is None:
        problems.append("a plan without the model's shape (made before plan schema 1.2): re-plan with this fitplan")
    elif flavor_of(inputs) is None:
        known = sorted({f"{row['module']} {row['flavor']}" for row in flavors()})
        problems.append(f"the model {inputs.architecture or inputs.model!r} (no {_V} flavour has its architecture "
                        f"and shape; it builds only {', '.join(known)})")
    if attention == "eager":
        problems.append(f"eager attention ({_V}'s language models attend with FlexAttention or varlen kernels only: "
                        "models/common/config_utils.py get_attention_config)")
    scaling = inputs.shape.rope_scaling if inputs.shape is not None else None
    if scaling is not None and scaling.kind != "llama3":
        problems.append(f"RoPE scaling {scaling.kind} ({_V}'s llama3 and qwen3 flavours are built here with no or "
                        "Llama 3.x scaling)")
    return problems


def rope_settings(inputs: Inputs) -> dict[str, Any]:
    """The model's RoPE scaling as its config.json states it, in torchtitan's RoPE.Config fields
    (models/common/rope.py), which the config module sets on every layer: the llama3 flavours all scale by Llama
    3.1's factor 8, which Meta-Llama-3 (no scaling) and Llama-3.2 (factor 32) do not."""
    scaling = inputs.shape.rope_scaling if inputs.shape is not None else None
    if scaling is None:
        return {"scaling": "none"}
    given = {"scaling_factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
             "high_freq_factor": scaling.high_freq_factor,
             "original_max_position_embeddings": scaling.original_max_positions}
    return {"scaling": "llama", **{key: value for key, value in given.items() if value is not None}}


# --- the job ----------------------------------------------------------------------------------------------------


def _activation_checkpoint(checkpoint: tuple[Checkpoint, ...]) -> str:
    """The one torchtitan policy of a plan whose layers all share one mode (`unsupported` refuses the rest)."""
    modes = set(checkpoint) or {Checkpoint.NONE}
    if len(modes) != 1 or next(iter(modes)) not in AC_POLICY:
        raise FitplanError(f"torchtitan applies one checkpoint policy to every layer, not {sorted(map(str, modes))}.",
                           "Re-plan with --launcher torchtitan.")
    return AC_POLICY[modes.pop()]


def _precision(precision: Precision) -> dict[str, Any]:
    """training.dtype holds the master weights and optimizer states; mixed_precision_param is FSDP2's (or
    autocast's) compute dtype; reductions stay fp32."""
    pure = precision is Precision.BF16
    half = precision in (Precision.BF16_MIXED, Precision.BF16, Precision.FP8)
    return {"dtype": "bfloat16" if pure else "float32", "mixed_precision_param": "bfloat16" if half else "float32",
            "mixed_precision_reduce": "float32"}


def _assets(inputs: Inputs) -> str:
    """The HF assets folder (tokenizer, config, safetensors): the model's own folder when local, else where
    torchtitan's scripts/download_hf_assets.py puts a Hub repo (./assets/hf/<name>, as its llama3_8b job points at
    ./assets/hf/Llama-3.1-8B)."""
    if inputs.model_source == "local":
        return inputs.model
    return f"./assets/hf/{inputs.model.rstrip('/').rsplit('/', 1)[-1]}"


def pipeline_settings(d: Decisions) -> dict[str, Any]:
    """[parallelism]'s pipeline fields: the schedule by torch's class name less "Schedule" (get_schedule_class),
    micro-batches of micro_batch sequences (local_batch_size holds the m of a step), and the split as the module
    names of each stage (module_fqns_per_model_part: stage s runs on rank s mod pp, or in a V for ZBVZeroBubble)."""
    if d.pp == 1:
        return {"pipeline_parallel_degree": 1}
    if not d.pp_split:
        raise FitplanError("The plan records no pipeline split, which torchtitan's module_fqns_per_model_part needs.",
                           "Re-plan with this fitplan (its plans record the split), or pin one with --pp-split.")
    stages, start = [], 0
    for s, layers in enumerate(d.pp_split):
        names = [f"layers.{i}" for i in range(start, start + layers)]
        stages.append((["tok_embeddings"] if s == 0 else []) + names +
                      (["norm", "lm_head"] if s == len(d.pp_split) - 1 else []))
        start += layers
    return {"pipeline_parallel_degree": d.pp,
            "pipeline_parallel_schedule": TORCH_CLASS[d.pp_schedule].removeprefix("Schedule"),
            "pipeline_parallel_microbatch_size": d.micro_batch, "module_fqns_per_model_part": stages}


def job(plan: Plan) -> dict[str, Any]:
    """The plan as torchtitan settings: {section: {field: value}} in torchtitan 0.3.0's names (Trainer.Config)."""
    d, inputs = plan.decisions, plan.inputs
    flavor = flavor_of(inputs)
    if flavor is None:
        raise FitplanError(f"torchtitan cannot build {inputs.model!r}: {'; '.join(model_problems(inputs))}.",
                           "Plan a model torchtitan has a flavour for, or choose another launcher.")
    fsdp, fp8 = d.engine is Engine.FSDP2, d.precision is Precision.FP8
    return {
        "hf_assets_path": _assets(inputs),
        "model": {"name": flavor["module"], "flavor": flavor["flavor"], "rope": rope_settings(inputs),
                  "converters": ["float8"] if fp8 else [],
                  # the LM head stays bf16, as fitplan prices it (torchtitan's llama3_405b filters it the same way);
                  # 0.3.0's Float8LinearConverter offers the rowwise recipes only
                  **({"float8": {"recipe_name": "rowwise", "filter_fqns": ["lm_head"]}} if fp8 else {})},
        # a pipeline runs the rank's m micro-batches in one step; otherwise torchtitan accumulates global / (local x dp)
        "training": {"local_batch_size": d.micro_batch * (d.grad_accum if d.pp > 1 else 1),
                     "global_batch_size": d.micro_batch * d.grad_accum * d.dp,
                     "seq_len": inputs.seq_len, "steps": STEPS, "max_norm": MAX_GRAD_NORM,
                     "enable_cpu_offload": d.param_offload is Offload.CPU, **_precision(d.precision),
                     # fitplan prices eager steps on the caching allocator; 0.3.0 captures forward+backward in a CUDA
                     # graph by default (its own memory pool, gradients kept allocated between steps)
                     "disable_cuda_graphs": True},
        # DDP replicates over every data-parallel rank; FSDP2 shards over dp / dp_replicate of them and, where
        # dp_replicate > 1, replicates across the groups (torchtitan's HSDP: its dp_replicate x dp_shard mesh)
        "parallelism": {"data_parallel_replicate_degree": d.dp_replicate if fsdp else d.dp,
                        "data_parallel_shard_degree": d.dp // d.dp_replicate if fsdp else 1,
                        "fsdp_reshard_after_forward": "always" if d.zero == 3 else "never",
                        "tensor_parallel_degree": d.tp, "enable_sequence_parallel": d.sequence_parallel,
                        **pipeline_settings(d), "context_parallel_degree": d.cp,
                        "expert_parallel_degree": d.ep},
        "activation_checkpoint": {"mode": _activation_checkpoint(d.checkpoint)},
        # the loss fitplan priced on torchtitan's code (solver.search.route.TITAN_LOSSES)
        "loss": {"name": "chunked" if d.loss is Loss.CHUNKED else "cross_entropy"},
        "compile": {"enable": d.compile, "components": ["model", "loss"]},
        "optimizer": {"name": "AdamW", "implementation": "fused" if d.optimizer is Optimizer.ADAMW_FUSED else "foreach",
                      "lr": LEARNING_RATE, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        "lr_scheduler": {"warmup_steps": WARMUP_STEPS},
        "dataloader": {"dataset": DATASET, "num_workers": d.dataloader_num_workers,
                       "pin_memory": d.dataloader_pin_memory},
    }


def toml_value(value: object) -> str:
    """One TOML value: a string as a basic string (JSON escapes are TOML escapes; DEL, a control character to TOML,
    escaped too), floats with a decimal point or exponent, booleans and arrays."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} has no TOML form fitplan writes")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _printable(text: str) -> str:
    """`text` with the control characters TOML forbids in comments (all but tab and line breaks) escaped."""
    return "\n".join(re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", line)
                     for line in text.splitlines())


def toml_text(settings: dict[str, Any], *, header: str = "") -> str:
    """`settings` as TOML: top-level values first, then one [table] per section (nested dicts as [a.b])."""
    lines = [comment(_printable(header)).rstrip("\n")] if header else []

    def table(name: str, values: dict[str, Any]) -> None:
        scalars = {k: v for k, v in values.items() if not isinstance(v, dict)}
        if name:
            lines.append(f"\n[{name}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in scalars.items())
        for key, value in values.items():
            if isinstance(value, dict):
                table(f"{name}.{key}" if name else key, value)

    table("", settings)
    return "\n".join(lines).lstrip("\n") + "\n"


HEADER = f"""torchtitan job emitted by fitplan, read by fitplan_torchtitan.py (torchtitan {TORCHTITAN}). Keys are
torchtitan's own Trainer.Config section and field names; [model] names the flavour model_registry builds and the
converters applied to it, [optimizer] the one AdamW parameter group, [activation_checkpoint] mode the policy
("none", "full", "selective" = op-level SAC, "memory_budget"). Command-line flags override any of it:
--training.steps 200 --lr-scheduler.warmup-steps 20."""


@cache
def config_module() -> str:
    """fitplan_torchtitan.py: the config module that reads the job file into torchtitan's Trainer.Config."""
    return python_file((f"{MODULE}.py",), {"JOB_FILE": JOB_FILE, "TORCHTITAN": TORCHTITAN}, name=f"{MODULE}.py")


def _notes(plan: Plan) -> str:
    flavor = flavor_of(plan.inputs) or {}
    scaling = plan.inputs.shape.rope_scaling if plan.inputs.shape is not None else None
    rope = f" with the model's RoPE scaling ({scaling.kind}, factor {scaling.factor:g})" if scaling else \
        " without RoPE scaling, as the model's config.json"
    return (f"{nodes_note(plan)}\nRun from the folder holding {JOB_FILE} and {MODULE}.py (torchtitan {TORCHTITAN}; "
            f"torchao for fp8). torchtitan builds its own {flavor.get('module')} {flavor.get('flavor')} model"
            f"{rope}; the tokenizer comes from hf_assets_path ({_assets(plan.inputs)}; for a Hub model: python "
            f"scripts/download_hf_assets.py --repo_id {plan.inputs.model} --assets tokenizer, from a torchtitan "
            "checkout). To start from the HF weights add --checkpoint.enable --checkpoint.initial-load-path "
            "/abs/path/to/hf/folder --checkpoint.initial-load-in-hf.")


def emit(plan: Plan) -> dict[str, str]:
    """fitplan_torchtitan.toml (the job), fitplan_torchtitan.py (the config module torchtitan loads it through),
    torchtitan_launch.sh (torchrun on each node) and, beyond one node, slurm_launch.sh."""
    d = plan.decisions
    from solver.plan.launchers.parallelism import parallelism_problems

    problems = unsupported("torchtitan", d, checkpoint=d.checkpoint, lora=d.lora is not None) + \
        model_problems(plan.inputs, d.attention) + parallelism_problems("torchtitan", d, plan.inputs)
    if problems:
        raise FitplanError(f"The torchtitan launcher cannot run this plan as decided: {'; '.join(problems)}.",
                           "Re-plan with --launcher torchtitan, or choose another launcher.")
    text = toml_text(job(plan), header=f"{about(plan)}\n{HEADER}")
    launch = launch_script([*torchrun_argv(plan), *PROGRAM], about=about(plan),
                           environment=launch_environment(plan), forward=True, notes=_notes(plan))
    files = {JOB_FILE: text, f"{MODULE}.py": config_module(), "torchtitan_launch.sh": launch}
    if plan.inputs.cluster.nodes > 1:
        files["slurm_launch.sh"] = slurm_script(plan, list(PROGRAM), about=about(plan))
    return files
