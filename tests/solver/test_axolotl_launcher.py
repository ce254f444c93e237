"""The axolotl launcher (issue 14): every key of every emitted config is one of axolotl's documented fields, axolotl's
own config validation (`axolotl.utils.config.validate_config`, as `axolotl train` runs it) accepts the files and
reads back the plan's decisions, the LoRA variants (QLoRA, DoRA, rsLoRA, modules_to_save) reach their keys, and what
axolotl cannot run is refused with its reason.

The field list (tests/solver/data/axolotl_fields.json) was read from axolotl 0.19.0's pydantic schema (PyPI): the
names and aliases of AxolotlInputConfig, LigerArgs, FSDPConfig and SyntheticDataset; every key the emitter writes
also appears in src/axolotl/utils/schemas at axolotl-ai-cloud/axolotl commit 067b021 (v0.18.0 and later).

axolotl pins torch <= 2.12 and transformers 5.14, so it is not a dev dependency: its validation runs when axolotl
imports here, or when AXOLOTL_PYTHON names an interpreter that has it (e.g. a venv with `pip install --no-deps
axolotl addict kernels` that sees this project's packages), and is skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from costmodels import Engine, Offload, Optimizer, Precision
from costmodels.config import Loss
from graphs import Checkpoint, FitplanError
from solver.plan.launchers import emit
from solver.plan.launchers.support import unsupported
from solver.plan.record import LoraDecision, Plan
from tests.solver import test_launcher_matrix as matrix
from tests.solver.test_launcher_matrix import HF_OPTIM, LAYERS, VARIANTS, WORLD, vary

# Plans as users get them: torch.compile searched, as without FITPLAN_AUTO_COMPILE (tests/conftest.py).
pytestmark = pytest.mark.compile_search

base = matrix.base  # the matrix's plan (Llama-3.2-1B on 8xH100), a module fixture

FIELDS = json.loads((Path(__file__).parent / "data" / "axolotl_fields.json").read_text())
CONFIG = "axolotl_config.yaml"
FULL = (Checkpoint.FULL,) * LAYERS
# LoRA cases on a DDP base (a quantized base runs only there); the others walk every engine.
LORAS = {
    "lora": LoraDecision(rank=16, alpha=32, targets=("all-linear",), dropout=0.05),
    "qlora-nf4-dq": LoraDecision(rank=16, alpha=32, targets=("all-linear",), dropout=0.0, quantization="nf4",
                                 double_quant=True),
    "qlora-fp4": LoraDecision(rank=8, alpha=16, targets=("q_proj", "v_proj"), dropout=0.0, quantization="fp4"),
    "dora-rslora-save": LoraDecision(rank=8, alpha=16, targets=("all-linear",), dropout=0.0, use_dora=True,
                                     use_rslora=True, modules_to_save=("lm_head", "embed_tokens")),
}


def undocumented(config: dict[str, Any]) -> list[str]:
    """The keys of an emitted config (top level, fsdp_config, dataset entries) that axolotl does not document."""
    known = set(FIELDS["config"]) | (set(FIELDS["liger"]) if config.get("plugins") else set())
    wrong = [key for key in config if key not in known]
    wrong += [f"fsdp_config.{k}" for k in config.get("fsdp_config") or {} if k not in FIELDS["fsdp_config"]]
    wrong += [f"datasets.{k}" for entry in config.get("datasets", []) for k in entry
              if k not in FIELDS["synthetic_dataset"]]
    return wrong


def cases(base_plan: Plan) -> list[tuple[str, Plan]]:
    """Every knob variant of the launcher matrix, and the LoRA variants on DDP and on each sharding engine."""
    found = [(name, plan) for name, knobs in VARIANTS if (plan := vary(base_plan, knobs)) is not None]
    lora_bases = {"ddp": {"engine": Engine.DDP, "zero": 0, "precision": Precision.BF16_MIXED},
                  "fsdp2": {"engine": Engine.FSDP2, "zero": 3, "precision": Precision.BF16_MIXED},
                  "deepspeed": {"engine": Engine.DEEPSPEED, "zero": 2, "precision": Precision.BF16_MIXED}}
    for engine, knobs in lora_bases.items():
        for name, lora in LORAS.items():
            if engine == "ddp" or lora.quantization is None:
                found.append((f"{engine}-{name}", vary(base_plan, {**knobs, "lora": lora, "checkpoint": FULL})))
    return found


@pytest.fixture(scope="module")
def emitted(base) -> dict[str, tuple[Plan, dict[str, str]]]:
    """name -> (plan, files) for every case axolotl runs; the walk must also refuse some."""
    result, refused = {}, 0
    for name, plan in cases(base):
        if unsupported("axolotl", plan.decisions, plan.inputs):
            refused += 1
            continue
        result[name] = plan, emit(plan, "axolotl")
    assert len(result) > 50 and refused > 50
    return result


def test_every_emitted_key_is_a_documented_axolotl_field(emitted):
    for name, (_, files) in emitted.items():
        assert undocumented(yaml.safe_load(files[CONFIG])) == [], name


def test_the_field_check_flags_a_misspelled_key(emitted):
    _, files = emitted["ddp-0-base"] if "ddp-0-base" in emitted else next(iter(emitted.values()))
    config = yaml.safe_load(files[CONFIG])
    assert undocumented({**config, "gradient_checkpoint": True}) == ["gradient_checkpoint"]
    assert undocumented({**config, "liger_fused_linear_cross_entropy": True}) == ["liger_fused_linear_cross_entropy"]


def test_emitted_configs_express_the_decisions(emitted):
    for name, (plan, files) in emitted.items():
        d, config = plan.decisions, yaml.safe_load(files[CONFIG])
        assert (config["micro_batch_size"], config["gradient_accumulation_steps"]) == (d.micro_batch, d.grad_accum)
        assert (config["sequence_len"], config["base_model"]) == (plan.inputs.seq_len, plan.inputs.model), name
        assert config["optimizer"] == HF_OPTIM[d.optimizer]
        assert (config["bf16"], config["fp16"], config["tf32"]) == (
            d.precision in (Precision.BF16_MIXED, Precision.BF16), d.precision is Precision.FP16_MIXED,
            d.precision is Precision.TF32), name
        checkpointed = config.get("gradient_checkpointing", False) or \
            (config.get("fsdp_config") or {}).get("activation_checkpointing", False)
        assert checkpointed == all(m is Checkpoint.FULL for m in d.checkpoint), name
        assert ("deepspeed" in config) == (d.engine is Engine.DEEPSPEED) == ("ds_config.json" in files)
        assert (config.get("fsdp_version") == 2) == (d.engine is Engine.FSDP2)
        if d.engine is Engine.DEEPSPEED:
            assert json.loads(files["ds_config.json"])["zero_optimization"]["stage"] == d.zero
        if d.engine is Engine.FSDP2:
            fsdp = config["fsdp_config"]
            assert fsdp["reshard_after_forward"] == (d.zero == 3)
            assert fsdp["offload_params"] == (d.param_offload is Offload.CPU)
        fused = d.loss is Loss.FUSED_LINEAR
        assert config.get("liger_fused_linear_cross_entropy", False) == fused
        assert (config.get("plugins") == ["axolotl.integrations.liger.LigerPlugin"]) == fused


def test_lora_variants_reach_axolotls_peft_keys(emitted):
    for engine in ("ddp", "fsdp2", "deepspeed"):
        for name, lora in LORAS.items():
            if f"{engine}-{name}" not in emitted:
                assert engine != "ddp" and lora.quantization is not None
                continue
            config = yaml.safe_load(emitted[f"{engine}-{name}"][1][CONFIG])
            quantized = lora.quantization is not None
            assert config["adapter"] == ("qlora" if quantized else "lora")
            assert (config["load_in_4bit"], config["load_in_8bit"]) == (quantized, False)
            assert (config["lora_r"], config["lora_alpha"], config["lora_dropout"]) == (lora.rank, lora.alpha,
                                                                                         lora.dropout)
            targets = config["lora_target_modules"]
            assert (targets,) == lora.targets if targets == "all-linear" else tuple(targets) == lora.targets
            assert (config["peft_use_dora"], config["peft_use_rslora"]) == (lora.use_dora, lora.use_rslora)
            assert tuple(config.get("lora_modules_to_save", ())) == lora.modules_to_save
            assert config.get("bnb_config_kwargs") == ({"bnb_4bit_quant_type": lora.quantization,
                                                        "bnb_4bit_use_double_quant": lora.double_quant}
                                                       if quantized else None)
            # PEFT's modules as traced: no axolotl Triton LoRA kernels, adapters in PEFT's default fp32
            assert not any(config[k] for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel",
                                               "lora_embedding_kernel"))
            assert config["peft_autocast_adapter_dtype"] is True


@pytest.mark.parametrize(("knobs", "reason"), [
    ({"tp": 2, "dp": 4, "grad_accum": 8}, "tensor or sequence parallelism"),
    ({"checkpoint": FULL[:LAYERS // 2] + (Checkpoint.NONE,) * (LAYERS // 2)}, "checkpointing only some layers"),
    ({"checkpoint": (Checkpoint.SELECTIVE,) * LAYERS}, "selective recompute"),
    ({"precision": Precision.FP8}, "fp8"),
    ({"engine": Engine.DDP, "zero": 0, "precision": Precision.BF16_MIXED}, "full fine-tuning under DDP"),
    ({"engine": Engine.FSDP2, "zero": 3, "precision": Precision.BF16}, "pure bf16 under FSDP2"),
    ({"engine": Engine.FSDP2, "zero": 3, "optimizer_in_backward": True, "micro_batch": 8, "grad_accum": 1},
     "optimizer-in-backward"),
    ({"engine": Engine.DDP, "zero": 0, "precision": Precision.BF16, "pp": 2, "dp": 4, "grad_accum": 8,
      "pp_split": (8, 8)}, "pipeline parallelism"),
])
def test_what_axolotl_cannot_run_is_refused_with_its_reason(base, knobs, reason):
    plan = vary(base, {"engine": Engine.DEEPSPEED, "zero": 2, **knobs})
    assert plan is not None
    with pytest.raises(FitplanError, match=reason):
        emit(plan, "axolotl")


def test_packing_follows_how_the_plan_priced_its_rows(base):
    full_rows = yaml.safe_load(emit(vary(base, {"engine": Engine.DEEPSPEED, "zero": 2}), "axolotl")[CONFIG])
    assert (full_rows["sample_packing"], full_rows["pad_to_sequence_len"]) == (True, True)
    padded = dataclasses.replace(vary(base, {"engine": Engine.DEEPSPEED, "zero": 2}),
                                 inputs=dataclasses.replace(base.inputs, packing="none"))
    config = yaml.safe_load(emit(padded, "axolotl")[CONFIG])
    assert (config["sample_packing"], config["pad_to_sequence_len"]) == (False, False)


# --- axolotl's own validation --------------------------------------------------------------------------------------

VALIDATE = r'''
import json, os, sys
import yaml
from axolotl.utils.config import prepare_plugins, validate_config
from axolotl.utils.dict import DictDefault

# The plan's GPUs (8 x H100: bf16, tf32, sm_90), as `axolotl train` reads them from the device (cli/config.py).
GPUS = {"bf16": True, "tf32": True, "fp8": True, "n_gpu": int(sys.argv[2]), "n_node": 1, "compute_capability": "sm_90"}
results = {}
for case in sorted(os.listdir(sys.argv[1])):
    os.chdir(os.path.join(sys.argv[1], case))
    with open("axolotl_config.yaml") as f:
        cfg = DictDefault(yaml.safe_load(f))
    try:
        prepare_plugins(cfg)
        out = validate_config(cfg, capabilities=GPUS, env_capabilities={"torch_version": "2.12.0"})
        results[case] = {key: out.get(key) for key in cfg}
    except Exception as error:
        results[case] = {"error": f"{type(error).__name__}: {error}"[:2000]}
print(json.dumps(results, default=str))
'''


def axolotl_python() -> str | None:
    """An interpreter where axolotl imports: AXOLOTL_PYTHON, or this one."""
    if os.environ.get("AXOLOTL_PYTHON"):
        return os.environ["AXOLOTL_PYTHON"]
    return sys.executable if importlib.util.find_spec("axolotl") else None


@pytest.mark.slow
def test_axolotls_own_validation_accepts_every_emitted_config_and_keeps_its_values(emitted, tmp_path):
    python = axolotl_python()
    if python is None:
        pytest.skip("axolotl is not installed (set AXOLOTL_PYTHON to an interpreter that has it)")
    chosen = dict(list(emitted.items())[::6])  # one in six of the walk, every loss and every LoRA case
    chosen.update({name: case for name, case in emitted.items() if name.split("-", 1)[1] in LORAS or "loss=" in name})
    for name, (_, files) in chosen.items():
        folder = tmp_path / "cases" / name.replace("/", "-")
        folder.mkdir(parents=True)
        for file, text in files.items():
            (folder / file).write_text(text)
    (tmp_path / "validate.py").write_text(VALIDATE)
    env = {**os.environ, "AXOLOTL_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([python, str(tmp_path / "validate.py"), str(tmp_path / "cases"), str(WORLD)],
                         capture_output=True, text=True, timeout=900, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == len(chosen)
    for name, (plan, files) in chosen.items():
        got, sent = results[name.replace("/", "-")], yaml.safe_load(files[CONFIG])
        assert "error" not in got, (name, got)
        d = plan.decisions
        assert (got["micro_batch_size"], got["gradient_accumulation_steps"]) == (d.micro_batch, d.grad_accum)
        assert got["optimizer"] == HF_OPTIM[d.optimizer] and got["sequence_len"] == plan.inputs.seq_len
        # axolotl keeps every value the file gave (aliases are stored under their field names)
        for key, value in sent.items():
            if key not in ("model_type", "datasets", "fsdp_config"):
                assert got[key] == value or (isinstance(value, float) and got[key] == pytest.approx(value)), \
                    (name, key, got[key], value)


# --- the case -----------------------------------------------------------------------------------------------


def _solve_and_emit(out: Path, *flags: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from solver.cli.app import app

    run = CliRunner().invoke(app, ["solve", "--model", "Qwen/Qwen2.5-7B", "--gpus", "1xRTX4090", "--launcher",
                                   "axolotl", "--emit", "axolotl", "--emit-dir", str(out), "--time-limit", "60",
                                   "--compile", "off", "--json", *flags])
    assert run.exit_code == 0, run.output
    plan = json.loads(run.stdout)
    assert "axolotl" in plan["launchers"]
    config = yaml.safe_load((out / CONFIG).read_text())
    assert undocumented(config) == []
    assert config["micro_batch_size"] == plan["decisions"]["micro_batch"] and config["sample_packing"] is True
    assert config["optimizer"] == HF_OPTIM[Optimizer(plan["decisions"]["optimizer"])]
    return plan, config


@pytest.mark.slow
def test_qwen_7b_on_one_rtx4090_emits_axolotl_configs_for_lora_and_qlora(tmp_path):
    """`solve --model Qwen/Qwen2.5-7B --gpus 1xRTX4090 --allow-lora --launcher axolotl --emit axolotl`: full
    fine-tuning cannot fit a 24 GB card, and the faster of the adapters that do (16-bit LoRA or QLoRA) comes out
    as axolotl's YAML; asked for QLoRA with paged 8-bit AdamW, the same card gets a qlora config. Compile is pinned
    off: the test is not about it, and the compiled LoRA lowerings (24 s each, cold) were most of its time."""
    plan, config = _solve_and_emit(tmp_path / "allow", "--allow-lora")
    lora = plan["decisions"]["lora"]
    assert lora is not None and any("full fine-tuning does not fit" in line for line in plan["inputs"]["assumed"])
    assert config["adapter"] == ("qlora" if lora["quantization"] else "lora") and config["lora_r"] == lora["rank"]
    plan, config = _solve_and_emit(tmp_path / "qlora", "--lora-rank", "16", "--lora-quantization", "nf4",
                                   "--double-quant", "--optimizers", "paged-adamw-8bit")
    assert (plan["decisions"]["lora"]["quantization"], plan["decisions"]["optimizer"]) == ("nf4", "paged-adamw-8bit")
    assert (config["adapter"], config["load_in_4bit"], config["lora_r"]) == ("qlora", True, 16)
    assert config["bnb_config_kwargs"] == {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    assert config["optimizer"] == "paged_adamw_8bit"
