"""The emitted Python files as template modules (solver/plan/launchers/templates/): each imports as a module, is
shipped as package data, and fills to byte for byte what the emitters wrote before the scripts became templates
(digests of frozen plans covering the script's branches, tests/solver/template_golden.py); a template and its values
that disagree raise instead of emitting a half-filled file."""

from __future__ import annotations

import ast
import fnmatch
import importlib
from pathlib import Path

import pytest
import tomllib

from costmodels.choices import RUNTIME_ONLY_LOSSES
from solver.plan.launchers import templating, torchrun
from solver.plan.launchers.templating import TemplateError, emitted_lines, fill, python_file
from tests.solver import template_golden

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "solver" / "plan" / "launchers" / "templates"
NAMES = sorted(path.name for path in TEMPLATES.glob("*.py") if path.name != "__init__.py")


@pytest.mark.parametrize("case", sorted(template_golden.CASES))
def test_emitted_python_files_match_the_golden_digests(case: str):
    assert template_golden.digests(case) == template_golden.stored()["digests"][case], (
        "an emitted Python file changed; if that is meant (a template, a priced constant or the plan's JSON), "
        "rewrite the digests with `python -m tests.solver.template_golden` and say why in the commit")


def test_golden_cases_cover_every_pipeline_schedule_and_launcher_python_file():
    """The cases reach each branch the digests are meant to guard (a case list that lost one would pass quietly)."""
    decisions = [template_golden.plan(case).decisions for case in template_golden.CASES]
    files = {file for digests in template_golden.stored()["digests"].values() for file in digests}
    assert {str(d.pp_schedule) for d in decisions if d.pp > 1} == {str(s) for s in template_golden.Schedule}
    # every loss a launcher emits (the runtime-only ones, priced for runtimes fitplan emits nothing for, are refused)
    assert {str(d.loss) for d in decisions} == {str(loss) for loss in template_golden.Loss
                                                if loss not in RUNTIME_ONLY_LOSSES}
    assert {str(d.engine) for d in decisions} >= {"fsdp2", "ddp"}
    assert any(d.lora and d.lora.quantization for d in decisions) and any(d.tp > 1 for d in decisions)
    assert any(d.activation_offload for d in decisions) and any(d.compile for d in decisions)
    assert files == {"train_fitplan.py", "fitplan_torchtitan.py", "fitplan_checkpointing.py"}


@pytest.mark.parametrize("name", NAMES)
def test_each_template_imports_as_a_module(name: str):
    """A syntax error, or a module-level name or import that does not resolve, fails here (torch, transformers and
    torchtitan are the test environment's own)."""
    module = importlib.import_module(f"solver.plan.launchers.templates.{name.removesuffix('.py')}")
    assert Path(module.__file__).name == name


def test_every_template_is_package_data():
    """pyproject.toml's package-data globs for `solver` ship every template (read with importlib.resources)."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["solver"]
    shipped = [name for name in NAMES if any(fnmatch.fnmatch(f"plan/launchers/templates/{name}", g) for g in globs)]
    assert NAMES and shipped == NAMES


def test_the_script_parts_are_every_torchrun_template():
    assert set(torchrun.SCRIPT_PARTS) == set(NAMES) - {"fitplan_torchtitan.py", "fitplan_checkpointing.py",
                                                      "fitplan_deepspeed.py"}


@pytest.mark.parametrize("name", NAMES)
def test_emitted_lines_keep_no_template_only_line(name: str):
    """What an emitter writes has no marker, lint setting or relative import (the script imports nothing from
    fitplan), and every line it keeps is the template's own, in order."""
    text = (TEMPLATES / name).read_text()
    kept = templating.template_text(name)
    assert templating.TEMPLATE_ONLY not in kept and templating.END_TEMPLATE_ONLY not in kept
    assert "ruff:" not in kept and "from ." not in kept
    lines = iter(text.splitlines())
    assert all(line in lines for line in kept.splitlines())  # a subsequence of the template's lines


def test_fill_refuses_a_placeholder_without_a_value_and_a_value_without_a_placeholder():
    with pytest.raises(TemplateError, match=r"without a value: \['B'\]"):
        fill("x = __A__ + __B__\n", {"A": "1"}, name="t.py")
    with pytest.raises(TemplateError, match=r"without a placeholder: \['C'\]"):
        fill("x = __A__\n", {"A": "1", "C": "2"}, name="t.py")


def test_fill_never_substitutes_inside_a_value():
    """One pass: a value holding a placeholder's spelling (user text: a model name) stays as written."""
    assert fill("a = __A__\nb = __B__\n", {"A": repr("__B__"), "B": "2"}, name="t.py") == "a = '__B__'\nb = 2\n"


@pytest.mark.parametrize("text", [
    "# fitplan: template only\nx = 1\n",
    "# fitplan: end template only\nx = 1\n",
    "# fitplan: template only\n# fitplan: template only\n# fitplan: end template only\n",
])
def test_unpaired_template_only_markers_raise(text: str):
    with pytest.raises(TemplateError, match=r"t\.py"):
        emitted_lines(text, name="t.py")


def test_emitted_lines_drop_each_marked_block_with_its_markers():
    text = "a\n# fitplan: template only\nb\n# fitplan: end template only\nc\n# fitplan: template only\nd\n" \
           "# fitplan: end template only\n"
    assert emitted_lines(text, name="t.py") == "a\nc\n"


def test_a_filled_file_that_is_not_python_raises_instead_of_being_emitted():
    with pytest.raises(TemplateError, match="not valid Python"):
        python_file(("fitplan_checkpointing.py",), {"LAYERS": "(", "CHECKPOINTED": "set()"},
                    name="fitplan_checkpointing.py")
    filled = python_file(("fitplan_checkpointing.py",), {"LAYERS": "4", "CHECKPOINTED": "{0, 1}"},
                         name="fitplan_checkpointing.py")
    assert "keep = set(range(4)) - {0, 1}" in ast.unparse(ast.parse(filled))
