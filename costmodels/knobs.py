"""The knob record: every decision is declared once, as `Annotated[type, Knob(...)]` on its field of `Config`
(or of the plan's `Decisions` for what only the plan records), and everything else derives from it.

`Config` validates values, `solver.search.space.Pins` takes pins by knob name and checks them against the declared type,
the plan's decisions extend `Config`, the CLI options of `solve` and `estimate` are generated from the record, and
the JSON schema's field descriptions are the knobs' help, and which cost modules read a knob is derived from the code
(`readers`). Adding a knob is one annotated field, the cost module(s) that read it and the emitters that express it
(docs/extending.md, "Adding a knob").
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

Pin = Literal["value", "set", "derived"]


@dataclass(frozen=True, slots=True)
class Knob:
    """What the planner, the user and the tools need to know about one decision."""

    help: str
    """One line for --help and the JSON schema's description."""
    pin: Pin = "value"
    """How `solve` lets a user fix it: one value (`--tp 2`), a set of allowed values (`--precision a,b`; the
    search never goes outside it), or not at all (derived from other knobs, e.g. dp from the GPUs and tp)."""
    flag: str = ""
    """The CLI option when it is not the field's name with dashes (e.g. `--offload` for optimizer_offload)."""
    high: int | None = None
    """Largest value a CLI integer option accepts (the smallest is the field's lowest legal value)."""
    low: int = 1
    strategy: bool = False
    """Part of the parallel, sharding and offload strategy: two configurations that differ in it are distinct
    alternatives (`solver.search.outer.Outer.family`)."""
    shown: bool = False
    """Shown as `name=value` in the plan's layout line where it is not its default (`Decisions.layout`)."""
    outside_compute: bool = False
    """Changes only what a step does around one rank's micro-batch compute (data-parallel collectives and states,
    the optimizer, the pipeline schedule): the pipeline search times a rank's compute once for all its values,
    at its default (`solver.search.pipeline_search.compute_key`)."""
    searched: Callable[[Mapping[str, Any], int], tuple[Any, ...]] | None = None
    """Where the search opens it when unpinned: the values worth trying given an outer configuration's layout,
    engine, ZeRO stage and optimizer offload (`tp`, `cp`, `pp`, `dp`, `ep`, `engine`, `zero`, `optimizer_offload`)
    and the GPUs per node. None: the search keeps its pin, else its default (`solver.search.space.outer_space`)."""

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        """The JSON schema of a knob's field carries its help as the description."""
        return {**handler(schema), "description": self.help}


@dataclass(frozen=True, slots=True)
class Declared:
    """One knob as declared on a class: its name, value type, default and record."""

    name: str
    kind: Any
    """The field's type without the `Annotated` wrapper, e.g. `int`, `Engine`, `tuple[Checkpoint, ...]`."""
    default: Any
    knob: Knob

    @property
    def option(self) -> str:
        """The CLI option name, e.g. "--offload-params"."""
        return "--" + (self.knob.flag or self.name.replace("_", "-"))

    def parse(self, value: Any) -> Any:
        """`value` as the field's type (enum values from strings, ints from "2"); ValueError naming the knob."""
        try:
            return _adapter(self.kind).validate_python(value, strict=False)
        except ValidationError as error:
            reason = error.errors()[0]["msg"]
            raise ValueError(f"{self.name}={value!r}: {reason}") from None


def declared(cls: type) -> dict[str, Declared]:
    """The knobs declared on dataclass `cls` (and its bases), in field order (a fresh dict: the caller's own)."""
    return dict(_declared(cls))


@functools.cache
def _declared(cls: type) -> dict[str, Declared]:
    """`declared`, read once per class: `typing.get_type_hints` evaluates every annotation (about 1 ms for
    `Config`), and the pipeline search asks once per launcher check."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = {}
    for spec in fields(cls):
        hint = hints[spec.name]
        records = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Knob)]
        if records:
            default = spec.default if spec.default is not MISSING else \
                spec.default_factory() if spec.default_factory is not MISSING else None  # type: ignore[misc]
            found[spec.name] = Declared(spec.name, typing.get_args(hint)[0], default, records[0])
    return found


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(kind: Any) -> TypeAdapter[Any]:
    if kind not in _ADAPTERS:
        _ADAPTERS[kind] = TypeAdapter(kind)
    return _ADAPTERS[kind]


@functools.cache
def readers() -> dict[str, tuple[str, ...]]:
    """Knob name -> the `costmodels` modules whose functions read it from a parameter annotated `Config`
    (`layer_modes` reads `checkpoint`), from their source: what a knob changes is derived, not listed."""
    import ast
    from pathlib import Path

    found: dict[str, set[str]] = {}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            configs = {a.arg for a in [*function.args.args, *function.args.kwonlyargs]
                       if isinstance(a.annotation, ast.Name) and a.annotation.id == "Config"}
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in configs:
                    found.setdefault("checkpoint" if node.attr == "layer_modes" else node.attr, set()).add(path.stem)
    return {name: tuple(sorted(modules)) for name, modules in found.items()}
