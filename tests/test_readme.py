"""The README's quick start: two commands (plan a bundled model, run the tests), and CI runs the second verbatim.

Also checks the install check behind `./fitplan`'s fast path (`.ci/installed.py`): its digest follows the inputs
that decide the install, and the environment running the tests satisfies every declared requirement floor.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from costmodels.cluster import parse_cluster
from graphs.catalog import load_entry
from solver.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
WRAPPER = "./fitplan"


def first_code_block(markdown: str) -> list[str]:
    """The lines of the first fenced code block."""
    match = re.search(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)
    assert match, "README.md has no fenced code block"
    return match.group(1).splitlines()


def without_comment(line: str) -> str:
    """The line up to a shell comment: a `#` that starts a word outside quotes."""
    quote, escaped = "", False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def command_lines(lines: list[str]) -> list[str]:
    """Each shell command as typed: blank and comment-only lines dropped, a trailing `# comment` cut off."""
    return [command for command in map(without_comment, lines) if command]


def readme_commands() -> list[str]:
    return command_lines(first_code_block(README.read_text()))


def option(words: list[str], name: str) -> str:
    assert name in words, f"{' '.join(words)!r} has no {name}"
    return words[words.index(name) + 1]


def load_installed() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_installed", ROOT / ".ci" / "installed.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_command_lines_skip_comments_and_cut_trailing_ones():
    lines = ["# set up", "", "./fitplan models   # the catalog", "  ./fitplan test -k 'a # b' # why",
             'echo "x \\" # y" a#b \\# c']
    assert command_lines(lines) == ["./fitplan models", "./fitplan test -k 'a # b'", 'echo "x \\" # y" a#b \\# c']
    # shlex, unlike bash, also reads `#` inside a word as a comment; the first two lines mean the same to both.
    assert [shlex.split(c) for c in command_lines(lines)[:2]] == [shlex.split(x, comments=True) for x in lines[2:4]]


def test_readme_first_code_block_has_exactly_two_commands_through_the_wrapper():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert all(shlex.split(c)[0] == WRAPPER for c in commands), commands
    wrapper = ROOT / WRAPPER
    assert wrapper.is_file() and os.access(wrapper, os.X_OK), f"{WRAPPER} must be an executable file"


def test_first_readme_command_plans_a_bundled_model_on_a_known_cluster():
    words = shlex.split(readme_commands()[0])
    assert words[1] == "solve"
    entry = load_entry(option(words, "--model"))  # raises UnknownModel unless it is in the bundled catalog
    assert entry.id == option(words, "--model")
    assert parse_cluster(option(words, "--gpus")).world_size >= 1


@pytest.mark.slow
def test_first_readme_command_finds_a_plan():
    result = CliRunner().invoke(app, shlex.split(readme_commands()[0])[1:])
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = readme_commands()[1]
    assert shlex.split(test_command)[:2] == [WRAPPER, "test"]
    ci_commands = command_lines(CI_RUN.read_text().splitlines())
    assert test_command in ci_commands, f"{CI_RUN} must run {test_command!r} as written in the README"


def test_install_digest_follows_pyproject_and_setup_script(tmp_path):
    installed = load_installed()
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(ROOT / ".ci" / "setup", tmp_path / ".ci" / "setup")
    assert installed.digest(tmp_path) == installed.digest(ROOT)
    with (tmp_path / "pyproject.toml").open("a") as f:
        f.write("\n# a changed requirement\n")
    changed = installed.digest(tmp_path)
    assert changed != installed.digest(ROOT)
    (tmp_path / ".ci" / "setup").write_text("echo other recipe\n")
    assert installed.digest(tmp_path) != changed


def test_installed_versions_satisfy_every_declared_floor():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["dev"]
    assert load_installed().missing_requirements(requirements) == []
    too_high = [*requirements, "torch>=99"]
    assert load_installed().missing_requirements(too_high) == ["torch>=99 (found " + version("torch") + ")"]
