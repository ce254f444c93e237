"""The CLI options of the knobs, generated from the knob record (`costmodels.knobs`): `solve` takes pins, `estimate`
one value per knob. A command declares `**knobs` and `with_knob_options` gives typer the generated parameters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Annotated, Any, Literal

import typer

from costmodels.knobs import Declared
from graphs.errors import FitplanError
from solver.cli.options import Bounded, Text
from solver.search.pins import GPU_DEFAULTS, KNOBS, Pins, pinned_kind

PANEL = "Knobs (each one the solver decides unless pinned)"


def solve_parameters() -> list[inspect.Parameter]:
    """One option per pinnable knob: a value, a comma-separated set, or auto/on/off for a switch."""
    return [inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=_solve_default(k),
                              annotation=_solve_annotation(k)) for k in KNOBS.values() if k.knob.pin != "derived"]


def estimate_parameters() -> list[inspect.Parameter]:
    """One option per knob, defaulting to the knob's default (a derived one, e.g. dp, to "the rest")."""
    return [inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=_estimate_default(k),
                              annotation=_estimate_annotation(k)) for k in KNOBS.values()]


def pins_from_options(values: dict[str, Any], *, launcher: str | None) -> Pins:
    """`Pins` from `solve`'s knob options (a set knob's comma-separated values split; an empty list is refused:
    it would allow nothing)."""
    given = {name: _split(value) if KNOBS[name].knob.pin == "set" and isinstance(value, str) and value != "auto"
             else value
             for name, value in values.items()}
    for name, value in given.items():
        if value == ():
            raise FitplanError(f"{KNOBS[name].option} lists no value: it would allow none.",
                               f"Give at least one value, or leave {KNOBS[name].option} out to let the solver "
                               "choose.")
    return Pins.of(launcher=launcher, **given)


def with_knob_options(parameters: Iterable[inspect.Parameter]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give `command(..., **knobs)` the knob `parameters` in place of `**knobs`, so typer parses them."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command, eval_str=True).parameters.values()
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own
                  if p.kind is not inspect.Parameter.VAR_KEYWORD] + list(parameters)

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            return command(**kwargs)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        del run.__wrapped__  # typer must read the generated signature, not the command's
        return run
    return decorate


def knob_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The knob options among a command's arguments."""
    return {name: kwargs[name] for name in KNOBS if name in kwargs}


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip().replace("_", "-") for v in value.split(",") if v.strip())


def _choices(kind: type[Enum]) -> str:
    return ", ".join(member.value for member in kind)


def _solve_default(knob: Declared) -> Any:
    kind = pinned_kind(knob)
    return "auto" if kind is bool or knob.kind is not kind else None


def _solve_annotation(knob: Declared) -> Any:
    kind, help, option = pinned_kind(knob), knob.knob.help, knob.option
    if knob.knob.pin == "set":
        listed = f" ({_choices(kind)})" if isinstance(kind, type) and issubclass(kind, Enum) else ""
        return Annotated[str | None, typer.Option(option, parser=Text(200), help=f"{help} Comma-separated{listed}.",
                                                  rich_help_panel=PANEL)]
    if kind is bool:
        return Annotated[Literal["auto", "on", "off"], typer.Option(option, help=f"{help} auto, on or off.",
                                                                    rich_help_panel=PANEL)]
    if knob.kind is not kind:  # per-layer: one mode pins every layer
        modes = Literal.__getitem__(("auto", *(m.value for m in kind)))
        return Annotated[modes, typer.Option(option, help=help, rich_help_panel=PANEL)]
    return Annotated[kind | None, _option(knob, kind, help)]


def _estimate_default(knob: Declared) -> Any:
    if knob.knob.pin == "derived" or knob.name in GPU_DEFAULTS:  # the rest of the GPUs; the GPUs' default
        return None
    kind = pinned_kind(knob)
    return kind(next(iter(kind))) if knob.kind is not kind else knob.default  # per-layer: the first mode, none


def _estimate_annotation(knob: Declared) -> Any:
    kind = pinned_kind(knob)
    option = knob.option if knob.knob.pin == "value" else "--" + knob.name.replace("_", "-")
    help = knob.knob.help.split(";")[0].rstrip(".") + "." if knob.knob.pin == "set" else knob.knob.help
    if knob.knob.pin == "derived" and knob.kind is not kind:  # a derived list, e.g. pp_split
        return Annotated[str | None, typer.Option(option, parser=Text(400), help=f"{help} Comma-separated.",
                                                  rich_help_panel=PANEL)]
    if knob.knob.pin == "derived":
        help += " Default: the rest of the GPUs."
    if kind is bool:
        shown = bool | None if knob.name in GPU_DEFAULTS else bool
        return Annotated[shown, typer.Option(f"{option}/--no-{option[2:]}", help=help, rich_help_panel=PANEL)]
    if knob.kind is not kind:
        help = "Checkpoint mode of every layer."
    shown = kind | None if knob.knob.pin == "derived" else kind
    return Annotated[shown, _option(knob, kind, help, option)]


def _option(knob: Declared, kind: Any, help: str, option: str = "") -> Any:
    option = option or knob.option
    if kind is int:
        parser = Bounded(int, knob.knob.low, knob.knob.high or 2**31)
        return typer.Option(option, parser=parser, help=f"{help} \\[{parser.allowed}]", rich_help_panel=PANEL)
    if kind is float:  # a share (optimizer_offload_fraction)
        parser = Bounded(float, 0, 1, lo_open=True)
        return typer.Option(option, parser=parser, help=f"{help} \\[{parser.allowed}]", rich_help_panel=PANEL)
    return typer.Option(option, help=help, rich_help_panel=PANEL)
