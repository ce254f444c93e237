"""The README's quick start: two commands (plan a bundled model, run the tests), and CI runs the second verbatim.

The README and docs/ stay true to the code: every fitplan command they quote parses with the CLI as it is, every
repository path and relative link they name exists, every anchor a link names is a heading there, and the module
map in docs/how-it-works.md names every module of the three packages.

Also checks the install check behind `./fitplan`'s fast path (`.ci/installed.py`): its digest follows the inputs
that decide the install, and the environment running the tests satisfies every declared requirement floor.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

import pytest
import typer
from typer.testing import CliRunner

from costmodels.cluster import parse_cluster
from graphs.catalog import load_entry
from solver.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MODULE_MAP = ROOT / "docs" / "how-it-works.md"
CI_RUN = ROOT / ".ci" / "run"
WRAPPER = "./fitplan"
# The first word of a fitplan command as the docs quote it: the clone's wrapper, the console scripts.
FITPLAN_COMMANDS = (WRAPPER, "fitplan", "solve")
# Top-level folders and files of the repository: a quoted path starting with one of them must exist.
REPOSITORY_ROOTS = ("graphs", "costmodels", "solver", "benchmarks", "tests", "examples", "docs", ".ci")
PACKAGES = ("graphs", "costmodels", "solver")


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


def test_install_check_finds_this_clone_without_importing_torch():
    """`./fitplan` runs the check before every command, `--help` included: it must not pay torch's import."""
    script = (f"import runpy, sys; sys.argv = ['installed.py']\n"
              f"try:\n    runpy.run_path({str(ROOT / '.ci' / 'installed.py')!r}, run_name='__main__')\n"
              f"except SystemExit as done:\n    print(done.code, 'torch' in sys.modules, 'ortools' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "False", "False"], done.stderr


FENCE = re.compile(r"^ *```([^\n]*)\n(.*?)^ *```", flags=re.MULTILINE | re.DOTALL)


def documents() -> list[Path]:
    return [README, *DOCS]


def joined_lines(lines: list[str]) -> list[str]:
    """Shell lines with backslash continuations joined into one."""
    joined, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            joined.append(pending + line)
            pending = ""
    return [*joined, pending] if pending else joined


def quoted_commands(markdown: str) -> list[str]:
    """The commands a document quotes: each command of a `bash` block, and each `$ ` line of a transcript block."""
    commands = []
    for match in FENCE.finditer(markdown):
        info, lines = match.group(1).strip(), match.group(2).splitlines()
        if info == "bash":
            commands += command_lines(joined_lines(lines))
        else:
            commands += command_lines([line[2:] for line in lines if line.startswith("$ ")])
    return commands


def fitplan_invocation(command: str) -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) of a fitplan command line; None for other programs and for `./fitplan test`."""
    words = shlex.split(command)
    if not words or words[0] not in FITPLAN_COMMANDS:
        return None
    if words[0] == "solve":  # the console script that is `fitplan solve`
        return "solve", words[1:]
    if len(words) < 2 or (words[0] == WRAPPER and words[1] == "test"):
        return None
    return words[1], words[2:]


def parse_fitplan(name: str, args: list[str]) -> None:
    """Parse a command line as the CLI would (option names, types, choices, ranges, required options), running
    nothing: click's own parser, on the command typer builds."""
    group = typer.main.get_command(app)
    assert name in group.commands, f"fitplan has no command {name!r}"
    group.commands[name].make_context(name, list(args))


def test_quoted_commands_join_continuations_and_read_transcripts():
    markdown = ("text\n```bash\nfitplan solve --model m \\\n    --gpus 8xA100  # why\n./fitplan test -x\n```\n"
                "```\n$ fitplan models llama\noutput\n```\n```python\nsolve('m', '8xA100')\n```\n")
    commands = quoted_commands(markdown)
    assert [shlex.split(c) for c in commands] == [["fitplan", "solve", "--model", "m", "--gpus", "8xA100"],
                                                  ["./fitplan", "test", "-x"], ["fitplan", "models", "llama"]]
    assert [fitplan_invocation(c) for c in commands] == [("solve", ["--model", "m", "--gpus", "8xA100"]), None,
                                                         ("models", ["llama"])]


@pytest.mark.parametrize("args", [["--model", "m", "--gpus", "8xA100", "--no-such-option"],
                                  ["--model", "m", "--gpus", "8xA100", "--tp", "0"], ["--gpus", "8xA100"],
                                  ["--model", "m", "--gpus", "8xA100", "--checkpoint", "everything"]])
def test_a_command_the_cli_would_refuse_does_not_parse(args):
    with pytest.raises(Exception, match=r"option|range|[Mm]issing|not one of"):  # click's errors, typer's copy
        parse_fitplan("solve", args)


def test_every_fitplan_command_the_readme_and_docs_quote_parses_with_the_cli():
    checked = []
    for path in documents():
        for command in quoted_commands(path.read_text()):
            if (invocation := fitplan_invocation(command)) is not None:
                try:
                    parse_fitplan(*invocation)
                except Exception as error:
                    pytest.fail(f"{path.relative_to(ROOT)}: {command!r} does not parse: {error}")
                checked.append(command)
    assert len(checked) >= 5, checked  # the docs' commands were found


def without_fences(markdown: str) -> str:
    return FENCE.sub("", markdown)


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", without_fences(markdown), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def repository_paths(markdown: str) -> set[str]:
    """Repository paths quoted in backticks: one word under a top-level folder (globs kept; placeholders such as
    `<name>` left out; a pytest id's `::test` cut off)."""
    paths = set()
    for span in re.findall(r"`([^`\s]+)`", markdown):
        path = span.split("::")[0]
        if "/" in path and "<" not in path and path.split("/")[0] in REPOSITORY_ROOTS:
            paths.add(path)
    return paths


def test_heading_anchors_and_repository_paths_are_read_as_github_and_the_repository_name_them():
    markdown = "# Top\n## 1. Lowering: graphs/\n```bash\n# not a heading\n```\nSee `graphs/cache.py` and " \
               "`tests/solver/test_cli.py::test_x`, not `<name>/x.py`, `a b/c`, `cache.py` or `--emit-dir out/`.\n"
    assert heading_anchors(markdown) == {"top", "1-lowering-graphs"}
    assert repository_paths(markdown) == {"graphs/cache.py", "tests/solver/test_cli.py"}


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_and_link_the_docs_name_exists(path):
    markdown = path.read_text()
    missing = [p for p in sorted(repository_paths(markdown)) if not list(ROOT.glob(p.rstrip("/")))]
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", without_fences(markdown)):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not the repository's
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists() or (anchor and anchor not in heading_anchors(linked.read_text())):
            missing.append(target)
    assert missing == []


def module_map() -> dict[str, set[str]]:
    """Folder -> the modules its table in the module map names (the first cell's backticked names, relative to
    the folder in the table's heading, e.g. `### solver/plan/launchers/`)."""
    tables: dict[str, set[str]] = {}
    folder = None
    for line in MODULE_MAP.read_text().splitlines():
        if line.startswith("#"):
            heading = re.match(r"^#+ +([\w./]+/)(?: |$)", line)
            folder = heading.group(1) if heading else None
        elif folder is not None and line.startswith("| `"):
            tables.setdefault(folder, set()).update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return tables


def test_the_module_map_names_existing_modules_and_every_module_of_the_packages():
    tables = module_map()
    assert {f"{package}/" for package in PACKAGES} <= set(tables)
    named = {folder + entry for folder, entries in tables.items() for entry in entries}
    assert sorted(p for p in named if not (ROOT / p).exists()) == []
    modules = sorted(str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    unnamed = [m for m in modules if not any(m == n or (n.endswith("/") and m.startswith(n)) for n in named)]
    assert unnamed == []
