"""Partial checkpointing without a call in the user's script (issue 35 item 9): accelerate's launch runs train.py
through the emitted fitplan_checkpointing.py, which gives every Trainer and every model Accelerator.prepare gets
the planned layers; checked by running it in front of real scripts on a tiny Llama (transformers' Trainer,
accelerate's Accelerator on CPU)."""

from __future__ import annotations

import runpy
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from graphs import Checkpoint
from solver.plan.launchers import emit
from tests.solver import test_launchers
from tests.solver.test_launchers import tiny_model, with_checkpoint, write

plans, isolated_accelerate = test_launchers.plans, test_launchers.isolated_accelerate  # their fixtures, shared

MODES = (Checkpoint.FULL, Checkpoint.NONE, Checkpoint.FULL)
TRAINER = ("from transformers import Trainer, TrainingArguments\n"
           "Trainer(model=hook.MODEL, args=TrainingArguments(output_dir=hook.OUT, use_cpu=True, report_to=[]))\n")
ACCELERATOR = "from accelerate import Accelerator\nAccelerator(cpu=True).prepare(hook.MODEL)\n"


def flags(model) -> list[bool]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def run_through_entry(files: dict[str, str], body: str, folder: Path, monkeypatch) -> SimpleNamespace:
    """fitplan_checkpointing.py's main on a user script `body` (which reaches the model through `hook`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hook = SimpleNamespace(MODEL=tiny_model("llama", AutoConfig, AutoModelForCausalLM), OUT=str(folder / "run"),
                           ARGV=None)
    monkeypatch.setitem(sys.modules, "fitplan_test_hook", hook)
    write(files, folder)
    script = "import sys\nimport fitplan_test_hook as hook\nhook.ARGV = list(sys.argv)\n"
    (folder / "train.py").write_text(script + body)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    from accelerate import Accelerator
    from transformers import Trainer

    monkeypatch.setattr(Trainer, "__init__", Trainer.__init__)  # install() replaces them: restored after the test
    monkeypatch.setattr(Accelerator, "prepare", Accelerator.prepare)
    entry = runpy.run_path(str(folder / "fitplan_checkpointing.py"), run_name="fitplan_entry")
    entry["main"]([str(folder / "train.py"), "--epochs", "1"])
    return hook


def program(files: dict[str, str]) -> list[str]:
    """The words of accelerate_launch.sh's launch line from accelerate's last option on (the program it runs)."""
    words = shlex.split(next(w for w in files["accelerate_launch.sh"].splitlines() if w.startswith("accelerate ")))
    return words[words.index("--main_process_port") + 2:]


def test_accelerate_launch_runs_the_script_through_the_checkpointing_entry(plans):
    files = emit(with_checkpoint(plans["ddp-full-ckpt"], MODES), "accelerate")
    assert program(files) == ["fitplan_checkpointing.py", "train.py", "$@"]
    every = emit(plans["ddp-full-ckpt"], "accelerate")  # DDP with every layer: still the snippet (no config key)
    assert program(every)[0] == "fitplan_checkpointing.py"


def test_a_plan_without_checkpointing_launches_train_py_directly(plans):
    none = with_checkpoint(plans["ddp-full-ckpt"], (Checkpoint.NONE,) * 3)
    files = emit(none, "accelerate")
    assert "fitplan_checkpointing.py" not in files
    assert program(files) == ["train.py", "$@"]


@pytest.mark.parametrize("body", [TRAINER, ACCELERATOR], ids=["trainer", "accelerator"])
def test_the_entry_gives_the_users_model_the_planned_layers(body, plans, tmp_path, monkeypatch, isolated_accelerate):
    files = emit(with_checkpoint(plans["ddp-full-ckpt"], MODES), "hf")
    hook = run_through_entry(files, body, tmp_path, monkeypatch)
    assert flags(hook.MODEL) == [True, False, True]
    assert hook.ARGV[1:] == ["--epochs", "1"] and hook.ARGV[0] == str(tmp_path / "train.py")  # its own argv
