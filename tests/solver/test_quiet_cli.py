"""The command line in fresh processes, as a user runs it: `--help` and a solve whose lowerings are cached import no
heavy library (torch, transformers, megatron-core, torchtitan, peft, bitsandbytes, networkx), and no command prints what
libraries print (warnings, logs) unless asked with --verbose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# networkx too: LayerGraph draws its DiGraph only when asked (a few hundred ms of import a cached solve does not need)
HEAVY = ("torch", "transformers", "megatron", "torchtitan", "peft", "bitsandbytes", "torchao", "networkx")
# Run a command as `fitplan` runs it (`main`), reporting which heavy modules it imported before the process ends.
PROBE = """
import json, sys
from solver.cli.app import app, finish, run
sys.argv = ["fitplan", *json.loads(sys.argv[1])]
code = run(app)
print(json.dumps(sorted(m for m in {heavy} if m in sys.modules)), file=sys.__stderr__)
finish(code)
"""
# What third-party output looks like: Python warnings, torch's and torchao's log lines.
NOISE = ("Warning:", "warnings.warn", "W1204", "Failed to load", "FutureWarning", "DeprecationWarning", "WARNING ")


def run(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FITPLAN_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)


def imported(result: subprocess.CompletedProcess[str]) -> list[str]:
    return json.loads(result.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first_solve(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A solve on an empty cache (it lowers gpt2 for one A100, importing torch and transformers, whose warnings and
    logs are captured), and the cache it leaves."""
    folder = tmp_path_factory.mktemp("cache")
    return folder, run(["solve", "--model", "gpt2", "--gpus", "1xA100", "--json"], folder)


@pytest.fixture(scope="module")
def cache(first_solve) -> Path:
    """A cache holding gpt2's lowerings for one A100."""
    folder, result = first_solve
    assert result.returncode == 0, result.stderr
    return folder


@pytest.mark.parametrize("args", [["--help"], ["solve", "--help"], ["models"], ["gpus"]])
def test_help_and_listings_import_no_heavy_library(args, tmp_path):
    result = run(args, tmp_path)
    assert result.returncode == 0, result.stderr
    assert imported(result) == []


def test_a_solve_whose_lowerings_are_cached_imports_no_heavy_library(cache):
    result = run(["solve", "--model", "gpt2", "--gpus", "1xA100", "--json"], cache)
    assert result.returncode == 0, result.stderr
    assert imported(result) == []


def test_a_solve_that_lowers_prints_library_output_only_when_verbose(first_solve, tmp_path):
    # The first solve lowered quietly (its stderr is checked below, its --json log here); a verbose one on another
    # fresh cache prints what the libraries printed.
    _, quiet = first_solve
    assert quiet.returncode == 0, quiet.stderr
    assert not [line for line in quiet.stderr.splitlines()[:-1] if any(mark in line for mark in NOISE)]
    args = ["solve", "--model", "gpt2", "--gpus", "1xA100", "--time-limit", "5", "--verbose"]
    verbose = run(args, tmp_path)
    assert verbose.returncode == 0, verbose.stderr
    assert [line for line in verbose.stderr.splitlines()[:-1] if any(mark in line for mark in NOISE)]


def test_json_output_lists_what_libraries_printed(first_solve):
    _, result = first_solve
    assert result.returncode == 0, result.stderr
    log = json.loads(result.stdout)["log"]
    assert any(any(mark in line for mark in NOISE) for line in log)  # the lowering's imports printed some
    assert not any(any(mark in line for mark in NOISE) for line in result.stderr.splitlines()[:-1])


@pytest.mark.parametrize("args", [
    ["estimate", "--model", "gpt2", "--gpus", "1xA100", "--micro-batch", "2"],
    ["choose", "--model", "gpt2", "--tokens", "1e6", "--gpu-types", "A10G", "--max-gpus", "1"],
])
def test_other_commands_print_no_library_output(args, cache):
    result = run(args, cache)
    assert result.returncode in (0, 3), result.stderr
    assert not [line for line in result.stderr.splitlines()[:-1] if any(mark in line for mark in NOISE)]


@pytest.mark.parametrize(("args", "code"), [
    (["gpus"], 0),
    (["solve", "--model", "no/such-model", "--gpus", "1xA100"], 2),
])
def test_the_command_exits_with_its_code_and_its_whole_output(args, code, tmp_path):
    """`fitplan` ends its process without the interpreter's teardown (`app.finish`): the exit code and every line
    written, also through a pipe, still reach the caller."""
    env = {**os.environ, "FITPLAN_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "solver", *args], env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == code, result.stderr
    if code == 0:
        assert "H100" in result.stdout and result.stdout.endswith("\n")
    else:
        assert "no/such-model" in result.stderr
