"""Every launcher x every knob value the registry says it runs (issues 12, 13): the emitted files, read back by the
real parsers (DeepSpeed's DeepSpeedConfig, transformers' TrainingArguments, accelerate's config loader, Megatron's
flag list and, given Megatron-LM's source, its own parse_args/validate_args (tests/solver/megatron_args.py), the
torchrun script's own functions, axolotl's YAML with DeepSpeed's parse of the ds_config.json it names), express
each decided value; every combination the registry (or, for the model, `support.unsupported`) refuses is refused
by the emitter with that reason. torchtitan has the same walk in test_torchtitan_launcher.py (parsed by
torchtitan's ConfigManager).

One plan is solved (Llama-3.2-1B on 8xH100); the emitters read only the plan's inputs and decisions, so each case
replaces decisions on it, one knob at a time from a base per (engine, ZeRO stage). Expected values are written out
here from the decisions, not taken from the emitters.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from costmodels import Engine, Offload, Optimizer, Precision
from costmodels.config import ContextParallel, Loss
from costmodels.pipeline_schedule import TORCH_CLASS, Schedule, stage_ranks
from graphs import Checkpoint, FitplanError
from solver import solve
from solver.plan.capability import MEGATRON_CP_COMM, REGISTRY
from solver.plan.launchers import emit
from solver.plan.launchers.support import unsupported
from solver.plan.record import Plan
from solver.search.space import ENGINE_STAGES
from tests.solver import megatron_args
from tests.solver.test_launchers import flag_values, parse_deepspeed, unknown_flags, write

# Plans as users get them: torch.compile searched, as without FITPLAN_AUTO_COMPILE (tests/conftest.py).
pytestmark = pytest.mark.compile_search

LAYERS = 16  # Llama-3.2-1B
WORLD = 8
HALF = {Precision.BF16_MIXED: "bf16", Precision.BF16: "bf16", Precision.FP8: "bf16", Precision.FP16_MIXED: "fp16"}
# transformers' OptimizerNames for each optimizer (training_args.py).
HF_OPTIM = {Optimizer.ADAMW: "adamw_torch", Optimizer.ADAMW_FUSED: "adamw_torch_fused",
            Optimizer.ADAFACTOR: "adafactor", Optimizer.ADAMW_8BIT: "adamw_bnb_8bit", Optimizer.SGD: "sgd",
            Optimizer.PAGED_ADAMW_8BIT: "paged_adamw_8bit", Optimizer.PAGED_ADAMW_32BIT: "paged_adamw_32bit"}


def variants() -> list[tuple[str, dict[str, Any]]]:
    """One knob changed at a time from a base of each (engine, ZeRO stage); Config refuses what is no
    configuration at all (e.g. DDP with offload), which the walk skips."""
    none, full = (Checkpoint.NONE,) * LAYERS, (Checkpoint.FULL,) * LAYERS
    changes: list[tuple[str, dict[str, Any]]] = [("base", {})]
    changes += [(f"precision={p}", {"precision": p}) for p in Precision]
    changes += [(f"optimizer={o}", {"optimizer": o}) for o in Optimizer]
    changes += [(f"offload={o}/{p}", {"optimizer_offload": o, "param_offload": p})
                for o, p in ((Offload.CPU, Offload.NONE), (Offload.CPU, Offload.CPU), (Offload.NVME, Offload.NVME))]
    changes += [("tp=2", {"tp": 2, "dp": 4, "grad_accum": 8}),
                ("tp=2+sp", {"tp": 2, "dp": 4, "grad_accum": 8, "sequence_parallel": True}),
                ("compile", {"compile": True}),
                ("checkpoint=full", {"checkpoint": full}),
                ("checkpoint=half-full", {"checkpoint": full[:LAYERS // 2] + none[LAYERS // 2:]}),
                ("checkpoint=selective", {"checkpoint": (Checkpoint.SELECTIVE,) * LAYERS}),
                ("checkpoint=op_selective", {"checkpoint": (Checkpoint.OP_SELECTIVE,) * LAYERS}),
                ("optimizer_in_backward", {"optimizer_in_backward": True, "micro_batch": 8, "grad_accum": 1}),
                ("activation_offload", {"activation_offload": True, "checkpoint": full})]
    changes += [(f"loss={loss}", {"loss": loss}) for loss in Loss]
    # pipeline (issue 13): each schedule, an uneven split, a split into equal virtual chunks, a split needing
    # Megatron's layout, and per-stage recompute; context parallelism in each mode; experts on a dense model
    pipe = {"pp": 2, "dp": 4, "grad_accum": 8, "pp_schedule": Schedule.ONE_F_ONE_B}
    halves = (Checkpoint.FULL,) * 3 + (Checkpoint.NONE,) * 4 + (Checkpoint.FULL,) * 3 + (Checkpoint.NONE,) * 6
    changes += [("pp=2", {**pipe, "pp_split": (8, 8)}), ("pp=2-uneven", {**pipe, "pp_split": (7, 9)}),
                ("pp=2-block-recompute", {**pipe, "pp_split": (7, 9), "checkpoint": halves}),
                ("pp=2-full-recompute", {**pipe, "pp_split": (7, 9), "checkpoint": full}),
                ("pp=4-interleaved", {"pp": 4, "dp": 2, "grad_accum": 8, "pp_schedule": Schedule.INTERLEAVED_1F1B,
                                      "pp_virtual": 2, "pp_split": (2,) * 8}),
                ("pp=4-interleaved-layout", {"pp": 4, "dp": 2, "grad_accum": 8, "pp_virtual": 2,
                                             "pp_schedule": Schedule.INTERLEAVED_1F1B,
                                             "pp_split": (1, 2, 2, 2, 2, 2, 2, 3)}),
                ("pp=2-gpipe", {**pipe, "pp_schedule": Schedule.GPIPE, "pp_split": (8, 8)})]
    changes += [(f"pp=2-{schedule}", {**pipe, "pp_schedule": schedule, "pp_virtual": 2, "pp_split": (4,) * 4})
                for schedule in (Schedule.INTERLEAVED_ZB, Schedule.ZBV)]
    changes += [(f"cp=2-{mode}", {"cp": 2, "dp": 4, "grad_accum": 8, "cp_mode": mode}) for mode in ContextParallel]
    changes += [("ep=2", {"ep": 2}), ("expandable_segments=off", {"expandable_segments": False})]
    changes += [("dp_replicate=2", {"dp_replicate": 2})]  # hybrid sharding: 2 replicas of 4 shard ranks
    cases = []
    for engine, zero in ENGINE_STAGES:
        base = {"engine": engine, "zero": zero, "tp": 1, "dp": WORLD, "micro_batch": 2, "grad_accum": 4,
                "precision": Precision.BF16_MIXED, "optimizer": Optimizer.ADAMW, "optimizer_offload": Offload.NONE,
                "param_offload": Offload.NONE, "checkpoint": none, "compile": False, "sequence_parallel": False}
        cases += [(f"{engine}-{zero}-{name}", {**base, **change}) for name, change in changes]
    return cases


VARIANTS = variants()


@pytest.fixture(scope="module")
def base() -> Plan:
    return solve("meta-llama/Llama-3.2-1B", "8xH100", seq_len=2048, global_batch=64, time_limit=5)


def vary(plan: Plan, knobs: dict[str, Any]) -> Plan | None:
    try:
        decisions = dataclasses.replace(plan.decisions, **knobs)
    except ValueError:  # Config refuses it: no plan can hold it
        return None
    return dataclasses.replace(plan, decisions=decisions)


# --- what each launcher's files express, read back by its own parser --------------------------------------------


def deepspeed_reads(plan: Plan, files: dict[str, str], folder: Path, monkeypatch) -> dict[str, Any]:
    d = plan.decisions
    config = json.loads(files["ds_config.json"])
    parsed = parse_deepspeed(config, WORLD, monkeypatch)
    zero = parsed.zero_config
    devices = {block: getattr(getattr(zero, block), "device", "none") for block in ("offload_optimizer",
                                                                                    "offload_param")}
    offload = {block: Offload(getattr(device, "value", device)) for block, device in devices.items()}
    return {"engine": (Engine.DEEPSPEED, parsed.zero_optimization_stage), "micro_batch": parsed.
            train_micro_batch_size_per_gpu, "grad_accum": parsed.gradient_accumulation_steps,
            "half": "bf16" if parsed.bfloat16_config.enabled else "fp16" if parsed.float16_config.enabled else None,
            "pure_bf16": parsed.bfloat16_config.bf16_master_weights_and_grads,
            "offload": (offload["offload_optimizer"], offload["offload_param"]),
            "optimizer": parsed.optimizer_name, "tp": 1, "dp": parsed.world_size,
            "expected_optimizer": {Optimizer.ADAMW: "adamw", Optimizer.ADAMW_FUSED: "adamw"}.get(d.optimizer)}


def hf_reads(plan: Plan, files: dict[str, str], folder: Path, monkeypatch) -> dict[str, Any]:
    import transformers.training_args
    from transformers import TrainingArguments

    kwargs = json.loads(files["training_args.json"])
    kwargs["output_dir"] = str(folder / "run")
    if "deepspeed" in kwargs:
        kwargs["deepspeed"] = str(write({"ds_config.json": files["ds_config.json"]}, folder) / "ds_config.json")
    # The plan's H100 has bf16 and TF32; this CPU host has neither, and TrainingArguments probes the local device.
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(transformers.training_args, "is_torch_tf32_available", lambda: True)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: WORLD))
    args = TrainingArguments(**kwargs)
    if args.deepspeed:
        engine = (Engine.DEEPSPEED, args.deepspeed_plugin.zero_stage)
    elif args.fsdp:
        engine = (Engine.FSDP2, 3 if args.fsdp_plugin_args["reshard_after_forward"] else 2)
        assert args.fsdp_plugin_args["fsdp_version"] == 2
    else:
        engine = (Engine.DDP, 0)
    checkpointed = bool(args.activation_checkpointing) or bool(
        args.fsdp and args.fsdp_plugin_args.get("activation_checkpointing")) or "fitplan_checkpointing.py" in files
    return {"engine": engine, "micro_batch": args.per_device_train_batch_size, "liger": bool(args.use_liger_kernel),
            "grad_accum": args.gradient_accumulation_steps,
            "half": "bf16" if args.bf16 else "fp16" if args.fp16 else None, "optim": str(args.optim.value),
            "compile": bool(args.torch_compile), "checkpointed": checkpointed, "tf32": args.tf32}


def accelerate_reads(plan: Plan, files: dict[str, str], folder: Path, monkeypatch) -> dict[str, Any]:
    from accelerate.commands.config.config_args import load_config_from_file

    write(files, folder)
    loaded = load_config_from_file(str(folder / "accelerate_config.yaml"))
    kind = loaded.distributed_type.value
    tp = (loaded.parallelism_config or {}).get("parallelism_config_tp_size", 1)
    if kind == "DEEPSPEED":
        config = json.loads((folder / loaded.deepspeed_config["deepspeed_config_file"]).read_text())
        engine = (Engine.DEEPSPEED, config["zero_optimization"]["stage"])
        half = "bf16" if config["bf16"]["enabled"] else "fp16" if config["fp16"]["enabled"] else None
    else:
        engine = (Engine.FSDP2, 3 if loaded.fsdp_config["fsdp_reshard_after_forward"] else 2) if kind == "FSDP" \
            else (Engine.DDP, 0)
        half = {"bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}.get(loaded.mixed_precision)
    compiled = (loaded.dynamo_config or {}).get("dynamo_backend", "NO") != "NO"
    return {"engine": engine, "tp": tp, "processes": loaded.num_processes, "half": half, "compile": compiled,
            "fp8": loaded.mixed_precision == "fp8" or bool(getattr(loaded, "fp8_config", None))}


def megatron_reads(plan: Plan, files: dict[str, str], folder: Path, monkeypatch) -> dict[str, Any]:
    arguments = shlex.split(files["megatron_args.txt"])  # as the shell passes them (the layout has quoted |)
    assert unknown_flags(arguments) == []
    values = flag_values(arguments)
    blocks = int(values["--recompute-num-layers"]) if values.get("--recompute-granularity") == "full" else 0
    got = {"engine": (Engine.MEGATRON, 1 if "--use-distributed-optimizer" in values else 0),
           "bf16_states": "--use-precision-aware-optimizer" in values and all(
               values.get(flag) == "bf16" for flag in ("--main-grads-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")),
           "tp": int(values["--tensor-model-parallel-size"]), "micro_batch": int(values["--micro-batch-size"]),
           "half": "bf16" if "--bf16" in values else "fp16" if "--fp16" in values else None,
           "fp8": "--fp8-format" in values, "blocks": blocks,
           "selective": values.get("--recompute-granularity") == "selective",
           "sequence_parallel": "--sequence-parallel" in values,
           "pp": int(values["--pipeline-model-parallel-size"]), "cp": int(values.get("--context-parallel-size", 1)),
           "cp_comm": values.get("--cp-comm-type"), "ep": int(values.get("--expert-model-parallel-size", 1))}
    if megatron_args.available():  # Megatron-LM's own reading: validated, and the layers each stage builds
        launch = shlex.split(files["megatron_launch.sh"].splitlines()[-1])
        env = dict(w.split("=", 1) for w in launch[1:launch.index("torchrun")]) if launch[0] == "env" else {}
        args, config = megatron_args.validate(folder, arguments, world=WORLD, capability=megatron_args.H100,
                                              env=env, monkeypatch=monkeypatch)
        v = args.virtual_pipeline_model_parallel_size or 1
        got["bf16_states"] = bool(args.use_precision_aware_optimizer) and all(
            dtype == torch.bfloat16 for dtype in (args.main_grads_dtype, args.exp_avg_dtype, args.exp_avg_sq_dtype))
        got.update(pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size, v=v,
                   ep=args.expert_model_parallel_size,
                   split=megatron_args.megatron_stage_layers(config, args.pipeline_model_parallel_size, v),
                   micro_batches=args.global_batch_size // (args.micro_batch_size * args.data_parallel_size))
    return got


def torchrun_reads(plan: Plan, files: dict[str, str], folder: Path, monkeypatch) -> dict[str, Any]:
    """The emitted script's own functions, run on a small real module (its optimizer, dtypes and scaler)."""
    script = write(files, folder) / "train_fitplan.py"
    namespace = runpy.run_path(str(script), run_name="fitplan_emitted")
    d = namespace["PLAN"]["decisions"]
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if plan.decisions.optimizer is Optimizer.ADAMW_8BIT:
        optimizer = "AdamW8bit"  # bitsandbytes' 8-bit optimizers build only on CUDA tensors; the name is checked
        assert "bitsandbytes.optim.AdamW8bit" in script.read_text()
    else:
        built = namespace["optimizer_for"](model, 1e-3)
        # optimizer-in-backward: one optimizer per parameter, stepped by its post-accumulate-grad hook
        inner = {type(each).__name__ for each in getattr(built, "each", {}).values()}
        optimizer = type(built).__name__ + (f"[{inner.pop()}]" if len(inner) == 1 else "")
    scaler = namespace["loss_scaler"](torch.device("cpu"))
    return {"decisions": d, "optimizer": optimizer, "weights": namespace["model_kwargs"]()["dtype"],
            "scaler": scaler is not None, "fp8": "float8" in script.read_text() and d["precision"] == "fp8",
            "pipeline": namespace["PLAN"]["pipeline"]}


def axolotl_reads(plan: Plan, files: dict[str, str], folder: Path, monkeypatch) -> dict[str, Any]:
    """axolotl's YAML as yaml reads it (axolotl's own validation of the same files: test_axolotl_launcher.py) and,
    under DeepSpeed, the ds_config.json it names, parsed by DeepSpeed."""
    import yaml

    config = yaml.safe_load(files["axolotl_config.yaml"])
    if "deepspeed" in config:
        parsed = parse_deepspeed(json.loads(files[config["deepspeed"]]), WORLD, monkeypatch)
        engine = (Engine.DEEPSPEED, parsed.zero_optimization_stage)
    elif config.get("fsdp_version") == 2:
        engine = (Engine.FSDP2, 3 if config["fsdp_config"]["reshard_after_forward"] else 2)
    else:
        engine = (Engine.DDP, 0)
    checkpointed = bool(config.get("gradient_checkpointing")) or \
        bool(config.get("fsdp_config", {}).get("activation_checkpointing"))
    return {"engine": engine, "micro_batch": config["micro_batch_size"],
            "grad_accum": config["gradient_accumulation_steps"],
            "half": "bf16" if config["bf16"] else "fp16" if config["fp16"] else None, "tf32": config["tf32"],
            "optim": config["optimizer"], "compile": config["torch_compile"], "checkpointed": checkpointed,
            "liger": config.get("liger_fused_linear_cross_entropy", False) and
            "axolotl.integrations.liger.LigerPlugin" in config.get("plugins", [])}


def exported(files: dict[str, str]) -> dict[str, str]:
    """The variables the launch files set, as bash reads them: each shell script's `export` lines run in an empty
    environment (the launch scripts' and the HF launcher's fitplan_env.sh, which it writes only when there are
    variables; slurm_launch.sh must agree)."""
    found = []
    for name in sorted(n for n in files if n.endswith(".sh") and n != "hostfile"):
        exports = "\n".join(line for line in files[name].splitlines() if line.startswith("export ")
                            and not line.startswith("export MASTER_ADDR"))
        shown = subprocess.run(["bash", "-c", exports + "\nexport -p"], env={}, capture_output=True, text=True,
                               check=True).stdout
        variables = dict(shlex.split(line.removeprefix("declare -x "))[0].split("=", 1)
                         for line in shown.splitlines() if "=" in line)
        found.append({k: v for k, v in variables.items() if k not in ("PWD", "SHLVL", "OLDPWD", "_")})
    assert all(each == found[0] for each in found), found
    return found[0] if found else {}


READERS = {"deepspeed": deepspeed_reads, "hf": hf_reads, "accelerate": accelerate_reads,
           "megatron": megatron_reads, "torchrun": torchrun_reads, "axolotl": axolotl_reads}
TORCH_OPTIMIZER = {Optimizer.ADAMW: "AdamW", Optimizer.ADAMW_FUSED: "AdamW", Optimizer.ADAFACTOR: "Adafactor",
                   Optimizer.ADAMW_8BIT: "AdamW8bit", Optimizer.SGD: "SGD",
                   Optimizer.PAGED_ADAMW_8BIT: "PagedAdamW8bit", Optimizer.PAGED_ADAMW_32BIT: "PagedAdamW32bit"}


def check_expressed(launcher: str, plan: Plan, got: dict[str, Any]) -> None:
    d = plan.decisions
    half = HALF.get(d.precision)
    checkpointed = any(m is not Checkpoint.NONE for m in d.checkpoint)
    if launcher == "deepspeed":
        assert got["engine"] == (d.engine, d.zero)
        assert (got["micro_batch"], got["grad_accum"], got["dp"]) == (d.micro_batch, d.grad_accum, d.dp)
        assert got["half"] == half and got["pure_bf16"] == (d.precision is Precision.BF16)
        assert got["offload"] == (d.optimizer_offload, d.param_offload)
        assert got["optimizer"] == got["expected_optimizer"]
    elif launcher == "hf":
        assert got["engine"] == (d.engine, d.zero)
        assert (got["micro_batch"], got["grad_accum"]) == (d.micro_batch, d.grad_accum)
        assert got["half"] == half and got["optim"] == HF_OPTIM[d.optimizer]
        assert got["compile"] == d.compile and got["checkpointed"] == checkpointed
        assert bool(got["tf32"]) == (d.precision is Precision.TF32)
        assert got["liger"] == (d.loss is Loss.FUSED_LINEAR)
    elif launcher == "axolotl":
        assert got["engine"] == (d.engine, d.zero)
        assert (got["micro_batch"], got["grad_accum"]) == (d.micro_batch, d.grad_accum)
        assert got["half"] == half and got["optim"] == HF_OPTIM[d.optimizer]
        assert got["compile"] == d.compile and got["checkpointed"] == checkpointed
        assert got["tf32"] == (d.precision is Precision.TF32)
        assert got["liger"] == (d.loss is Loss.FUSED_LINEAR)
    elif launcher == "accelerate":
        assert got["engine"] == (d.engine, d.zero) and got["tp"] == d.tp and got["processes"] == WORLD
        assert got["half"] == half and got["compile"] == d.compile
        assert got["fp8"] == (d.precision is Precision.FP8)
    elif launcher == "megatron":
        assert got["engine"] == (d.engine, d.zero) and got["tp"] == d.tp and got["micro_batch"] == d.micro_batch
        assert got["half"] == half and got["fp8"] == (d.precision is Precision.FP8)
        assert got["bf16_states"] == (d.optimizer is Optimizer.ADAMW_BF16)
        split = d.pp_split or (LAYERS,)
        full = [m is Checkpoint.FULL for m in d.checkpoint]
        starts = [sum(split[:k]) for k in range(len(split))]  # block recompute: the first k layers of each stage
        assert full == [i - start < got["blocks"] for start, n in zip(starts, split, strict=True)
                        for i in range(start, start + n)]
        assert got["selective"] == (Checkpoint.SELECTIVE in d.checkpoint)
        assert got["sequence_parallel"] == d.sequence_parallel
        assert (got["pp"], got["cp"], got["ep"]) == (d.pp, d.cp, d.ep)
        assert got["cp_comm"] == (MEGATRON_CP_COMM[d.cp_mode] if d.cp > 1 else None)
        if "split" in got:
            assert (got["v"], got["split"], got["micro_batches"]) == (d.pp_virtual, split, d.grad_accum)
    elif launcher == "torchrun":
        assert got["decisions"] == json.loads(json.dumps(dataclasses.asdict(d), default=str))
        expected = TORCH_OPTIMIZER[d.optimizer]
        assert got["optimizer"] == (f"InBackward[{expected}]" if d.optimizer_in_backward else expected)
        assert got["weights"] == (torch.bfloat16 if d.precision is Precision.BF16 else torch.float32)
        assert got["scaler"] == (d.precision is Precision.FP16_MIXED)
        assert got["fp8"] == (d.precision is Precision.FP8)
        # the pipeline's torch schedule class, each global stage's rank (a V for ZB-V) and layers, as priced
        pipeline = None if d.pp == 1 else {"schedule": TORCH_CLASS[d.pp_schedule], "split": list(d.pp_split),
                                           "stage_ranks": list(stage_ranks(d.pp_schedule, d.pp, d.pp_virtual))}
        assert (got["pipeline"] and {k: got["pipeline"][k] for k in ("schedule", "split", "stage_ranks")}) == pipeline


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(READERS))
def test_every_registered_knob_value_is_expressed_or_refused_with_its_reason(launcher, base, tmp_path,
                                                                              monkeypatch):
    from accelerate.state import AcceleratorState

    ran = refused = 0
    for name, knobs in VARIANTS:
        plan = vary(base, knobs)
        if plan is None:
            continue
        d = plan.decisions
        problems = unsupported(launcher, d, plan.inputs)
        if (d.engine, d.zero) not in REGISTRY[launcher].engines:
            assert any(f"engine {d.engine}" in p for p in problems), (name, problems)
        if problems:
            with pytest.raises(FitplanError) as refusal:
                emit(plan, launcher)
            assert all(p in str(refusal.value) for p in problems), name
            refused += 1
            continue
        folder = tmp_path / name.replace("/", "-")
        folder.mkdir()
        files = emit(plan, launcher)
        with monkeypatch.context() as patch:
            check_expressed(launcher, plan, READERS[launcher](plan, files, folder, patch))
        assert exported(files) == ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
                                   if d.expandable_segments else {}), name
        AcceleratorState._reset_state(reset_partial_state=True)
        ran += 1
    assert ran and refused  # each launcher runs some of the walk and refuses some of it


def test_the_walk_covers_every_value_of_every_walked_knob():
    seen: dict[str, set] = {}
    for _, knobs in VARIANTS:
        for key, value in knobs.items():
            seen.setdefault(key, set()).add(value)
    assert seen["precision"] == set(Precision) and seen["optimizer"] == set(Optimizer)
    assert {(knobs["engine"], knobs["zero"]) for _, knobs in VARIANTS} == set(ENGINE_STAGES)
    assert {m for modes in seen["checkpoint"] for m in modes} == set(Checkpoint)
    assert seen["compile"] == {False, True} and seen["sequence_parallel"] == {False, True}
    assert seen["loss"] == set(Loss)
    assert seen["optimizer_in_backward"] == {True} and seen["activation_offload"] == {True}  # False: the bases
    assert seen["pp_schedule"] == set(Schedule) and seen["cp_mode"] == set(ContextParallel)
    assert seen["pp"] == {2, 4} and seen["cp"] == {2} and seen["ep"] == {2}
    assert seen["expandable_segments"] == {False}  # True: the bases
    assert seen["dp_replicate"] == {2}  # 1: the bases
