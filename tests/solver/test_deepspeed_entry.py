"""The DeepSpeed launcher's entry point (issue 35 items 14 and 7): where the plan needs what ds_config.json cannot say,
the raw `deepspeed` launch runs the user's script through fitplan_deepspeed.py, which compiles the engine the plan
priced compiled (DeepSpeed 0.19's `DeepSpeedEngine.compile`) and, for ZeRO-3 plans of MoE models, marks each MoE
block a ZeRO-3 leaf with DeepSpeed's own `set_z3_leaf_modules` (checked on a real tiny Mixtral and Qwen3-MoE)."""

from __future__ import annotations

import dataclasses
import inspect
import runpy
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from solver import solve
from solver.plan.launchers import emit
from solver.plan.record import Plan
from tests.graphs.tiny_configs import tiny_values
from tests.solver.test_launchers import write

GPT2 = {"seq_len": 512, "global_batch": 64, "time_limit": 5, "engine": "deepspeed"}


@pytest.fixture(scope="module")
def zero3() -> Plan:
    return solve("gpt2", "8xA100", zero=3, compile="off", **GPT2)


def launched(files: dict[str, str]) -> list[str]:
    """The words after `deepspeed ... --num_gpus N` on the launch line (what the runner starts on each GPU)."""
    line = next(w for w in files["deepspeed_launch.sh"].splitlines() if w.startswith("deepspeed "))
    words = shlex.split(line)
    return words[words.index("--num_gpus") + 2:]


class FakeEngine:
    """Stands in for the DeepSpeedEngine deepspeed.initialize returns (no GPU or process group here)."""

    def __init__(self) -> None:
        self.compiled = 0

    def compile(self) -> None:
        self.compiled += 1


def run_entry(entry: str, folder: Path, monkeypatch, model: torch.nn.Module | None = None) -> dict:
    """fitplan_deepspeed.py run as deepspeed's runner starts it, on a user script that calls deepspeed.initialize
    (faked to return a FakeEngine) and records what it saw."""
    import deepspeed

    seen: dict = {}

    def initialize(args=None, model=None, **kwargs):  # DeepSpeed 0.19's signature starts (args, model, ...)
        seen["engine"] = FakeEngine()
        seen["model"] = model
        return seen["engine"], None, None, None

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setitem(sys.modules, "fitplan_test_hook", SimpleNamespace(SEEN=seen, MODEL=model))
    write({"fitplan_deepspeed.py": entry}, folder)
    (folder / "train.py").write_text("import sys\nimport deepspeed\nimport fitplan_test_hook as hook\n"
                                     "hook.SEEN['argv'] = list(sys.argv)\n"
                                     "deepspeed.initialize(model=hook.MODEL, config='ds_config.json')\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the entry sets sys.argv for the script it runs
    namespace = runpy.run_path(str(folder / "fitplan_deepspeed.py"), run_name="fitplan_entry")
    namespace["main"](["--local_rank=3", str(folder / "train.py"), "--deepspeed", "ds_config.json"])
    return seen


def test_engine_compile_is_deepspeeds_own_method():
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert list(inspect.signature(DeepSpeedEngine.compile).parameters)[:2] == ["self", "backend"]


def test_a_compiled_plan_launches_the_script_through_the_entry_that_compiles_the_engine(zero3, tmp_path, monkeypatch):
    plan = dataclasses.replace(zero3, decisions=dataclasses.replace(zero3.decisions, compile=True))
    files = emit(plan, "deepspeed")
    assert launched(files)[:4] == ["fitplan_deepspeed.py", "train.py", "--deepspeed", "ds_config.json"]
    seen = run_entry(files["fitplan_deepspeed.py"], tmp_path, monkeypatch, torch.nn.Linear(2, 2))
    assert seen["engine"].compiled == 1
    assert seen["argv"] == [str(tmp_path / "train.py"), "--local_rank=3", "--deepspeed", "ds_config.json"]
    assert "fitplan_deepspeed.py" in emit(plan, "hf")  # the HF route's DeepSpeed files carry it too


def test_a_plan_the_config_says_whole_launches_the_script_directly(zero3):
    files = emit(zero3, "deepspeed")
    assert "fitplan_deepspeed.py" not in files
    assert launched(files)[:3] == ["train.py", "--deepspeed", "ds_config.json"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_zero3_moe_plan_makes_each_moe_block_a_zero3_leaf(arch, zero3, tmp_path, monkeypatch):
    from deepspeed.utils import get_z3_leaf_modules
    from transformers import AutoConfig, AutoModelForCausalLM

    values = tiny_values(arch)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config)
    shape = dataclasses.replace(zero3.inputs.shape, experts=config.num_local_experts if arch == "mixtral"
                                else config.num_experts)
    plan = dataclasses.replace(zero3, inputs=dataclasses.replace(zero3.inputs, shape=shape))
    files = emit(plan, "deepspeed")
    assert launched(files)[0] == "fitplan_deepspeed.py"
    seen = run_entry(files["fitplan_deepspeed.py"], tmp_path, monkeypatch, model)
    leaves = get_z3_leaf_modules(seen["model"])
    blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    assert blocks and leaves == blocks  # every MoE block, and nothing else
    assert seen["engine"].compiled == 0  # the plan does not compile
    # ZeRO-2 shards no parameters: no leaves needed, no entry point
    two = dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, zero=2))
    assert "fitplan_deepspeed.py" not in emit(two, "deepspeed")


def test_the_entry_refuses_a_dense_model_under_an_moe_plan(zero3, tmp_path, monkeypatch):
    shape = dataclasses.replace(zero3.inputs.shape, experts=8)
    plan = dataclasses.replace(zero3, inputs=dataclasses.replace(zero3.inputs, shape=shape))
    with pytest.raises(RuntimeError, match="no MoE block"):
        run_entry(emit(plan, "deepspeed")["fitplan_deepspeed.py"], tmp_path, monkeypatch, torch.nn.Linear(2, 2))
