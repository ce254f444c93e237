"""Emitted Python files from template modules (solver/plan/launchers/templates/): the template's text less its
template-only lines, and its `__NAME__` placeholders filled in one checked pass, so that an emitter bug raises
instead of writing a half-filled file."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from functools import cache
from importlib import resources

TEMPLATE_ONLY = "# fitplan: template only"
END_TEMPLATE_ONLY = "# fitplan: end template only"
PLACEHOLDER = re.compile(r"__([A-Z][A-Z0-9_]*)__")


class TemplateError(RuntimeError):
    """A template and its emitter disagree (a placeholder without a value, a value without a placeholder, unpaired
    template-only markers): a bug in fitplan, never in the user's input."""


@cache
def template_text(name: str) -> str:
    """The emitted part of templates/<name>: its text without the template-only lines."""
    text = resources.files("solver.plan.launchers.templates").joinpath(name).read_text(encoding="utf-8")
    return emitted_lines(text, name=name)


def emitted_lines(text: str, *, name: str) -> str:
    """`text` without the lines from each TEMPLATE_ONLY marker through the next END_TEMPLATE_ONLY (markers
    included); markers must pair up, unnested."""
    kept, inside = [], False
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        marker = line.rstrip("\n")
        if marker in (TEMPLATE_ONLY, END_TEMPLATE_ONLY):
            if inside == (marker == TEMPLATE_ONLY):
                raise TemplateError(f"{name}:{number}: {marker!r} without its pair")
            inside = marker == TEMPLATE_ONLY
        elif not inside:
            kept.append(line)
    if inside:
        raise TemplateError(f"{name}: {TEMPLATE_ONLY!r} is never ended")
    return "".join(kept)


def fill(text: str, values: Mapping[str, str], *, name: str) -> str:
    """`text` with every `__NAME__` replaced by values[NAME], in one pass: a value is never scanned again, so user
    text holding a placeholder's spelling stays as written. The placeholders and the values must be the same names."""
    found = set(PLACEHOLDER.findall(text))
    if found != set(values):
        raise TemplateError(f"{name}: placeholders without a value: {sorted(found - set(values))}; values without a "
                            f"placeholder: {sorted(set(values) - found)}")
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


def python_file(parts: tuple[str, ...], values: Mapping[str, str], *, name: str) -> str:
    """The emitted Python file `name`: the template `parts` joined in order and filled with `values`; it must parse
    as Python (a value that is no literal where code needs one fails here, not on the user's machine)."""
    text = fill("".join(template_text(part) for part in parts), values, name=name)
    try:
        ast.parse(text, filename=name)
    except SyntaxError as err:
        raise TemplateError(f"{name} as filled is not valid Python (line {err.lineno}): {err.msg}") from err
    return text
