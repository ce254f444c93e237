"""--use-rslora and --modules-to-save (issue 14) from the CLI to the plan and the files: rsLoRA changes only the
adapters' scaling, so nothing is priced for it; modules_to_save trains full copies, priced by the PEFT lowering
(tests/graphs/test_quantized.py checks the bytes against the real PEFT model and a real AdamW step). The HF files
carry both in adapter_config.json, which PEFT's own LoraConfig reads back; axolotl's YAML in its peft keys; the
launchers whose files build plain LoRA refuse them by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from typer.testing import CliRunner

from graphs import FitplanError, LoraSpec
from solver.api import estimate
from solver.cli.app import app
from solver.plan.launchers import emit
from solver.plan.record import Plan

MODEL, GPUS = "Qwen/Qwen2.5-0.5B", "1xL4"
ESTIMATE = ["estimate", "--model", MODEL, "--gpus", GPUS, "--seq-len", "512", "--micro-batch", "1", "--json"]


def _memory(*flags: str) -> dict:
    run = CliRunner().invoke(app, [*ESTIMATE, "--lora-rank", "8", *flags])
    assert run.exit_code in (0, 3), run.output  # 3: does not fit, still a report
    return json.loads(run.stdout)["memory"]


@pytest.mark.slow
def test_cli_modules_to_save_prices_the_trained_copy_and_rslora_prices_nothing():
    plain, rslora = _memory(), _memory("--use-rslora")
    assert rslora == plain
    saved = _memory("--modules-to-save", "lm_head")
    api = estimate(MODEL, GPUS, {"micro_batch": 1}, seq_len=512, lora=LoraSpec(rank=8, alpha=16,
                                                                             modules_to_save=("lm_head",)))
    assert saved == json.loads(json.dumps(dataclasses.asdict(api.memory)))
    # the copy of the 151,936 x 896 output head trains: its optimizer states come on top of the adapters'
    assert saved["optimizer_states"] - plain["optimizer_states"] >= 151_936 * 896 * 4
    assert saved["parameters"] > plain["parameters"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--use-rslora"], "--use-rslora needs --lora-rank"),
    (["--modules-to-save", "lm_head"], "--modules-to-save needs --lora-rank"),
    (["--lora-rank", "8", "--modules-to-save", "lm head"], "not a module name"),
])
def test_cli_refuses_the_flags_without_adapters_or_with_bad_names(flags, message):
    run = CliRunner().invoke(app, [*ESTIMATE, *flags])
    assert run.exit_code == 2 and message in run.stderr, run.output


def test_cli_refuses_them_for_a_launcher_that_builds_plain_lora():
    run = CliRunner().invoke(app, ["solve", "--model", MODEL, "--gpus", GPUS, "--lora-rank", "8", "--use-rslora",
                                   "--launcher", "torchrun", "--json"])
    assert run.exit_code == 2 and "cannot load" in run.stderr, run.output


@pytest.mark.slow
def test_solve_records_them_and_the_hf_and_axolotl_files_carry_them(tmp_path):
    from peft import LoraConfig

    out = tmp_path / "out"
    # compile pinned off: not what this checks, and the compiled LoRA lowerings were most of its time
    run = CliRunner().invoke(app, ["solve", "--model", MODEL, "--gpus", GPUS, "--seq-len", "512", "--global-batch",
                                   "4", "--lora-rank", "8", "--use-rslora", "--modules-to-save", "lm_head",
                                   "--compile", "off", "--time-limit", "5", "--emit", "hf,axolotl,torchrun",
                                   "--emit-dir", str(out), "--json"])
    assert run.exit_code == 0, run.output
    plan = Plan.from_json(json.loads(run.stdout))
    lora = plan.decisions.lora
    assert (lora.use_rslora, lora.modules_to_save) == (True, ("lm_head",))
    assert lora.spec() == LoraSpec(rank=8, alpha=16, use_rslora=True, modules_to_save=("lm_head",))
    assert "torchrun" not in plan.launchers and {"hf", "axolotl"} <= set(plan.launchers)
    adapters = LoraConfig.from_pretrained(str(out))
    assert (adapters.use_rslora, adapters.modules_to_save, adapters.r) == (True, ["lm_head"], 8)
    config = yaml.safe_load((out / "axolotl_config.yaml").read_text())
    assert (config["peft_use_rslora"], config["lora_modules_to_save"]) == (True, ["lm_head"])
    assert not (out / "train_fitplan.py").exists()  # torchrun refused, with its reason on stderr
    assert "rsLoRA and modules_to_save" in " ".join(run.stderr.split())  # rich wraps stderr lines
    with pytest.raises(FitplanError, match="rsLoRA"):
        emit(plan, "deepspeed")
