"""Every launcher x every knob value the registry says it runs (issue 12): the emitted files, read back by the real
parsers (DeepSpeed's DeepSpeedConfig, transformers' TrainingArguments, accelerate's config loader, Megatron's flag
list, the torchrun script's own functions), express each decided value; every combination the registry refuses is
refused by the emitter with the registry's reason. torchtitan has the same walk in test_torchtitan_launcher.py
(parsed by torchtitan's ConfigManager).

One plan is solved (Llama-3.2-1B on 8xH100); the emitters read only the plan's inputs and decisions, so each case
replaces decisions on it, one knob at a time from a base per (engine, ZeRO stage). Expected values are written out
here from the decisions, not taken from the emitters.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch

from costmodels import Engine, Offload, Optimizer, Precision
from costmodels.config import Loss
from graphs import Checkpoint, FitplanError
from solver import solve
from solver.capability import REGISTRY, unsupported
from solver.launchers import emit
from solver.plan import Plan
from solver.space import ENGINE_STAGES
from tests.solver.test_launchers import flag_values, parse_deepspeed, unknown_flags, write

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
    arguments = files["megatron_args.txt"].split()
    assert unknown_flags(arguments) == []
    values = flag_values(arguments)
    full = int(values["--recompute-num-layers"]) if values.get("--recompute-granularity") == "full" else 0
    return {"engine": (Engine.DEEPSPEED, 1 if "--use-distributed-optimizer" in values else 0),
            "tp": int(values["--tensor-model-parallel-size"]), "micro_batch": int(values["--micro-batch-size"]),
            "half": "bf16" if "--bf16" in values else "fp16" if "--fp16" in values else None,
            "fp8": "--fp8-format" in values, "full_layers": full,
            "selective": values.get("--recompute-granularity") == "selective",
            "sequence_parallel": "--sequence-parallel" in values}


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
            "scaler": scaler is not None, "fp8": "float8" in script.read_text() and d["precision"] == "fp8"}


READERS = {"deepspeed": deepspeed_reads, "hf": hf_reads, "accelerate": accelerate_reads,
           "megatron": megatron_reads, "torchrun": torchrun_reads}
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
    elif launcher == "accelerate":
        assert got["engine"] == (d.engine, d.zero) and got["tp"] == d.tp and got["processes"] == WORLD
        assert got["half"] == half and got["compile"] == d.compile
        assert got["fp8"] == (d.precision is Precision.FP8)
    elif launcher == "megatron":
        assert got["engine"] == (d.engine, d.zero) and got["tp"] == d.tp and got["micro_batch"] == d.micro_batch
        assert got["half"] == half and got["fp8"] == (d.precision is Precision.FP8)
        assert got["full_layers"] == sum(m is Checkpoint.FULL for m in d.checkpoint)
        assert got["selective"] == (Checkpoint.SELECTIVE in d.checkpoint)
        assert got["sequence_parallel"] == d.sequence_parallel
    elif launcher == "torchrun":
        assert got["decisions"] == json.loads(json.dumps(dataclasses.asdict(d), default=str))
        expected = TORCH_OPTIMIZER[d.optimizer]
        assert got["optimizer"] == (f"InBackward[{expected}]" if d.optimizer_in_backward else expected)
        assert got["weights"] == (torch.bfloat16 if d.precision is Precision.BF16 else torch.float32)
        assert got["scaler"] == (d.precision is Precision.FP16_MIXED)
        assert got["fp8"] == (d.precision is Precision.FP8)


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
        problems = unsupported(launcher, d, checkpoint=d.checkpoint, lora=d.lora is not None)
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
        with monkeypatch.context() as patch:
            check_expressed(launcher, plan, READERS[launcher](plan, emit(plan, launcher), folder, patch))
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
