"""Emitted files are safe to run whatever the model is called (issue 17 item 2): a tiny Llama saved under a folder
named with shell metacharacters is planned for every launcher, and each emitted shell script is run by bash with
fake `deepspeed`/`torchrun`/`accelerate` first on PATH that only record their argv. No injected command may run,
and each command must receive exactly the words fitplan meant, the model path intact as one argument. Emitted
Python must parse, and hold the model as a string literal equal to the input.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from solver.cli.app import app
from solver.plan.capability import REGISTRY
from solver.plan.launchers import emit
from solver.plan.launchers.megatron import RUN_SETTINGS
from solver.plan.record import Plan
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

# Every payload would create a PWNED* file in the working directory if the shell ran it. Also: quotes, a space,
# $VAR and a glob (which would change the argv if expanded). The CLI refuses non-printable model names, so the
# newline (which would start a new command) is tried on plans handed to the emitters directly.
HOSTILE = ("x;touch PWNED1 && touch PWNED2 | touch PWNED3 $(touch PWNED4) `touch PWNED5` 'single' \"double\" "
           "$HOME * \\ #")
NEWLINE = "\ntouch PWNED6 # \r\n$(touch PWNED7)"
LAUNCHERS = [name for name in REGISTRY if name != "torchtitan"]  # torchtitan: test_torchtitan_launcher.py
# HF Trainer's own files are YAML/JSON; under DeepSpeed it also gets the DeepSpeed launch script, tested here too.
PINS = {"hf": ["--engine", "deepspeed"]}
PROGRAMS = ["deepspeed", "torchrun", "accelerate", "python", "python3"]
ENVIRONMENT_FILE = "fitplan_env.sh"  # the HF launcher's variables, sourced before the user's own command
# One node: NODE_RANK, MASTER_ADDR and MASTER_PORT unset take their one-node defaults.
TORCHRUN_ONE_NODE = ["--nnodes", "1", "--nproc_per_node", "8", "--node_rank", "0", "--master_addr", "127.0.0.1",
                     "--master_port", "29500"]
# What the user sets for a Megatron run (`megatron.RUN_SETTINGS`): the launch script stops without them.
MEGATRON_RUN = {"DATA_PATH": "/data/my-corpus_text_document", "LR": "2e-05", "TRAIN_ITERS": "100", "SAVE_DIR": "/ckpt",
                "SAVE_INTERVAL": "50"}
# The argv fitplan means each launch script to run, word for word; {model} is the plan's model path.
EXPECTED_ARGV = {
    "deepspeed_launch.sh": ["deepspeed", "--num_nodes", "1", "--num_gpus", "8", "train.py", "--deepspeed",
                            "ds_config.json"],
    "accelerate_launch.sh": ["accelerate", "launch", "--config_file", "accelerate_config.yaml", "--num_machines", "1",
                             "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port", "29500",
                             "train.py"],
    "torchrun_launch.sh": ["torchrun", *TORCHRUN_ONE_NODE, "train_fitplan.py", "--model", "{model}"],
    "axolotl_launch.sh": ["accelerate", "launch", "--num_processes", "8", "--num_machines", "1", "--machine_rank", "0",
                          "--main_process_ip", "127.0.0.1", "--main_process_port", "29500", "--multi_gpu", "-m",
                          "axolotl.cli.train", "axolotl_config.yaml"],
}


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory) -> Path:
    """A tiny Llama config.json, and a cluster file, in a folder whose name is the hostile string."""
    folder = write_config(tmp_path_factory.mktemp("models") / HOSTILE, tiny_values("llama"))
    (folder / "cluster.json").write_text(json.dumps({"gpus": "8xA100"}))
    return folder


@pytest.fixture(scope="module")
def emitted(hostile_dir, tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """launcher -> (plan JSON, folder of its emitted files), planned with `--launcher L --emit L` through the CLI."""
    result = {}
    for launcher in LAUNCHERS:
        folder = tmp_path_factory.mktemp(f"emit-{launcher}")
        args = ["solve", "--model", str(hostile_dir), "--gpus", str(hostile_dir / "cluster.json"), "--seq-len", "256",
                "--global-batch", "16", "--time-limit", "5", "--launcher", launcher, "--emit", launcher,
                "--emit-dir", str(folder / "out"), "--json", *PINS.get(launcher, [])]
        run = CliRunner().invoke(app, args)
        assert run.exit_code == 0, run.output
        result[launcher] = json.loads(run.stdout), folder / "out"
    return result


def fake_programs(folder: Path) -> Path:
    """Executables that write their name and argv, NUL-terminated, to a new file in $ARGV_DIR and do nothing else."""
    folder.mkdir()
    for name in PROGRAMS:
        path = folder / name
        path.write_text(f"#!/bin/sh\nprintf '%s\\0' {name} \"$@\" > \"$(mktemp \"$ARGV_DIR/call.XXXXXX\")\"\n")
        path.chmod(0o755)
    return folder


def run_script(script: Path, tmp_path: Path, *, settings: dict[str, str] = MEGATRON_RUN,
               returncode: int = 0) -> tuple[list[list[str]], Path, str]:
    """Run `script` with bash in a scratch folder holding the emitted files, with the user's `settings` in the
    environment; the argv of each fake program call, the folder and what bash printed on stderr."""
    work, calls = tmp_path / "work", tmp_path / "calls"
    work.mkdir(parents=True)
    calls.mkdir()
    for file in script.parent.iterdir():
        (work / file.name).write_bytes(file.read_bytes())
    env = {"PATH": f"{fake_programs(tmp_path / 'bin')}:/usr/bin:/bin", "ARGV_DIR": str(calls), "HOME": str(tmp_path),
           **settings}
    done = subprocess.run(["bash", script.name], cwd=work, env=env, capture_output=True, text=True, timeout=30,
                          check=False)
    assert (done.returncode == 0) is (returncode == 0), done.stderr
    return [call.read_bytes().decode().split("\0")[:-1] for call in sorted(calls.iterdir())], work, done.stderr


def shell_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.sh"))


def check_scripts(folder: Path, model: str, tmp_path: Path) -> None:
    """Run every shell script in `folder`: no payload runs, and the one command gets exactly the intended argv."""
    scripts = shell_files(folder)
    assert scripts, f"no launch script in {sorted(p.name for p in folder.iterdir())}"
    for index, script in enumerate(scripts):
        calls, work, _ = run_script(script, tmp_path / str(index))
        assert not list(work.glob("PWNED*")) and not list(tmp_path.rglob("PWNED*")), script.read_text()
        if script.name == ENVIRONMENT_FILE:  # variables to source before the user's own command: it runs none
            assert calls == []
            continue
        assert len(calls) == 1, calls  # one command: nothing in the model started a second
        expected = [word.replace("{model}", model) for word in EXPECTED_ARGV.get(script.name, [])]
        if script.name == "megatron_launch.sh":  # the launch line passes the args file's words unchanged
            # newline="": a "\r\n" in the file (a model name may hold one) stays as bash reads it
            flags = shlex.split((folder / "megatron_args.txt").open(newline="").read())
            settings = [word for flag, name, _ in RUN_SETTINGS for word in (flag, MEGATRON_RUN[name])]
            expected = ["torchrun", *TORCHRUN_ONE_NODE, "pretrain_gpt.py", *flags, *settings]
        if script.name == "deepspeed_launch.sh" and (folder / "fitplan_deepspeed.py").exists():
            # what ds_config.json cannot say (torch.compile, MoE leaves) runs the user's train.py through it
            expected.insert(expected.index("train.py"), "fitplan_deepspeed.py")
        if script.name == "accelerate_launch.sh" and (folder / "fitplan_checkpointing.py").exists():
            expected.insert(expected.index("train.py"), "fitplan_checkpointing.py")  # the planned layers, applied
        assert calls[0] == expected
        if "{model}" in EXPECTED_ARGV.get(script.name, []):
            assert calls[0].count(model) == 1


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_emitted_shell_scripts_run_no_injected_command_and_pass_exact_argv(launcher, emitted, tmp_path):
    plan, folder = emitted[launcher]
    assert plan["inputs"]["model"].endswith(HOSTILE)
    check_scripts(folder, plan["inputs"]["model"], tmp_path)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_newline_in_model_or_cluster_starts_no_command(launcher, emitted, tmp_path):
    """Library callers can build plans the CLI would refuse: a newline must not end a comment or a word."""
    plan = Plan.from_json(emitted[launcher][0])
    model, spec = plan.inputs.model + NEWLINE, plan.inputs.cluster.spec + NEWLINE
    cluster = dataclasses.replace(plan.inputs.cluster, spec=spec)
    plan = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, model=model, cluster=cluster))
    folder = tmp_path / "out"
    folder.mkdir()
    for name, text in emit(plan, launcher).items():
        (folder / name).write_text(text)
    check_scripts(folder, model, tmp_path / "run")


@pytest.mark.parametrize("missing", sorted(MEGATRON_RUN))
def test_megatron_launch_stops_before_starting_when_a_run_setting_is_unset(missing, emitted, tmp_path):
    """Data path, learning rate, length and checkpoint folder are the user's (issue 35 item 5): unset, the script
    names the variable and starts nothing; set, each reaches pretrain_gpt.py as its flag's value."""
    _, folder = emitted["megatron"]
    settings = {name: value for name, value in MEGATRON_RUN.items() if name != missing}
    calls, _, stderr = run_script(folder / "megatron_launch.sh", tmp_path / "unset", settings=settings, returncode=1)
    assert calls == [] and f"set {missing}:" in stderr
    (call,), _, _ = run_script(folder / "megatron_launch.sh", tmp_path / "set")
    flags = {"--data-path": "DATA_PATH", "--lr": "LR", "--train-iters": "TRAIN_ITERS", "--save": "SAVE_DIR",
             "--save-interval": "SAVE_INTERVAL"}
    assert {flag: call[call.index(flag) + 1] for flag in flags} == {f: MEGATRON_RUN[n] for f, n in flags.items()}
    assert {name for _, name, _ in RUN_SETTINGS} == set(MEGATRON_RUN)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_emitted_text_files_parse_and_comments_stay_comments(launcher, emitted):
    plan, folder = emitted[launcher]
    for path in sorted(folder.iterdir()):
        text = path.read_text()
        if path.suffix == ".json":
            json.loads(text)
        elif path.suffix == ".yaml":
            yaml.safe_load(text)
        elif path.suffix == ".py":
            ast.parse(text, filename=path.name)
        elif path.name == "megatron_note.txt":
            assert all(line.startswith("#") for line in text.splitlines())
        elif path.suffix == ".sh":
            subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
            words = shlex.split(text, comments=True)  # a second parser: the payload's `touch` is never a word
            while words[:1] == ["export"]:  # the launch environment (`export NAME=value` lines) comes first
                assert "=" in words[1]
                words = words[2:]
            while words[:1] == [":"]:  # then the checks of what the user must set (`: "${NAME:?...}"`)
                assert words[1].startswith("${") and ":?" in words[1]
                words = words[2:]
            assert (words[0] in PROGRAMS if path.name != ENVIRONMENT_FILE else words == []) and "touch" not in words
    assert json.loads((folder / "plan.json").read_text())["inputs"]["model"] == plan["inputs"]["model"]


def literal_assignments(source: str) -> dict[str, object]:
    """Module-level `NAME = <literal>` and `NAME = json.loads(<literal>)` assignments of a Python file."""
    values = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "json.loads" and len(value.args) == 1:
                values[node.targets[0].id] = json.loads(ast.literal_eval(value.args[0]))
            elif isinstance(value, ast.Constant):
                values[node.targets[0].id] = value.value
    return values


def test_training_script_holds_model_and_plan_as_literals(emitted):
    plan, folder = emitted["torchrun"]
    values = literal_assignments((folder / "train_fitplan.py").read_text())
    assert values["MODEL"] == plan["inputs"]["model"]
    assert values["PLAN"] == {"decisions": plan["decisions"], "seq_len": plan["inputs"]["seq_len"],
                              "pipeline": None}  # a pipeline plan's stages and schedule (torchrun_pipeline.py)


def parsed_model(script: Path, argv: list[str]) -> str:
    """The --model value the emitted script's own argparse reads from `argv` (the module runs, main() does not)."""
    namespace = runpy.run_path(str(script), run_name="fitplan_emitted")
    saved = sys.argv
    try:
        sys.argv = argv
        return namespace["parse"]().model
    finally:
        sys.argv = saved


def test_training_script_argparse_reads_the_launch_lines_model(emitted, tmp_path):
    plan, folder = emitted["torchrun"]
    calls, _, _ = run_script(folder / "torchrun_launch.sh", tmp_path)
    script_argv = calls[0][calls[0].index("train_fitplan.py"):]
    assert parsed_model(folder / "train_fitplan.py", script_argv) == plan["inputs"]["model"]
    assert parsed_model(folder / "train_fitplan.py", ["train_fitplan.py"]) == plan["inputs"]["model"]  # default


@pytest.mark.parametrize("model", ["-rf x;touch PWNED", "--steps=9", "__SUMMARY__ __PLAN__ ''' \"\"\" \\\n"])
def test_model_names_that_look_like_options_or_placeholders_stay_values(model, emitted, tmp_path):
    """A relative path starting with '-' would be read as an option by argparse; a template placeholder or quote
    run inside the name must not be substituted or end the literal."""
    plan = Plan.from_json(emitted["torchrun"][0])
    plan = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, model=model))
    folder = tmp_path / "out"
    folder.mkdir()
    for name, text in emit(plan, "torchrun").items():
        (folder / name).write_text(text)
    assert literal_assignments((folder / "train_fitplan.py").read_text())["MODEL"] == model
    calls, work, _ = run_script(folder / "torchrun_launch.sh", tmp_path / "run")
    assert not list(work.glob("PWNED*"))
    script_argv = calls[0][calls[0].index("train_fitplan.py"):]
    assert parsed_model(folder / "train_fitplan.py", script_argv) == model


def test_fake_programs_record_what_an_unquoted_line_would_run(tmp_path):
    """The harness itself: an unquoted model in a launch line does run the payload (so the tests above can fail)."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "launch.sh").write_text(f"torchrun train_fitplan.py --model {HOSTILE}\n")
    calls, work, _ = run_script(folder / "launch.sh", tmp_path / "run")
    assert list(work.glob("PWNED*"))
    assert calls and calls[0][-1] != HOSTILE

