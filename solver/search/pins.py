"""Pins: the knobs a user fixed, by the knob record's names (`costmodels.knobs`), validated against it.

A pin is the tuple of values a knob may take: one for a "value" knob (`--tp 2`), any number for a "set" knob
(`--precision bf16-mixed,fp8`). An absent knob is the solver's to decide; "auto" or None means absent. A
per-layer knob (checkpoint) is pinned to one mode for every layer.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from costmodels import Cluster, Config
from costmodels.knobs import Declared, declared
from costmodels.overhead import expandable_segments_default
from solver.plan.capability import LAUNCHERS

KNOBS: dict[str, Declared] = declared(Config)
# Knobs whose default depends on the GPUs (what their PyTorch build runs): `solve` and `estimate` both take it
# from here when the user does not set the knob.
GPU_DEFAULTS: dict[str, Callable[[Cluster], Any]] = {"expandable_segments": expandable_segments_default}


def gpu_defaults(cluster: Cluster, given: Mapping[str, Any]) -> dict[str, Any]:
    """The GPU-dependent defaults of the knobs `given` leaves unset (absent or None)."""
    return {name: default(cluster) for name, default in GPU_DEFAULTS.items() if given.get(name) is None}


def pinned_kind(knob: Declared) -> Any:
    """The type of one pinned value: the element type of a per-layer knob, else the knob's own type."""
    if typing.get_origin(knob.kind) is tuple:
        return typing.get_args(knob.kind)[0]
    return knob.kind


def knob_named(name: str) -> Declared:
    """The knob called `name` (its field name, or its CLI option without dashes); an error lists the knobs."""
    for knob in KNOBS.values():
        if name in (knob.name, knob.option[2:], knob.option[2:].replace("-", "_")):
            return knob
    raise ValueError(f"unknown knob {name!r}; knobs are: {', '.join(KNOBS)}")


@dataclass(frozen=True, slots=True)
class Pins:
    """What the user fixed: allowed values per knob name, and the launcher the plan must run on."""

    fixed: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    """(knob, allowed values) pairs in the record's order; build with `Pins.of`."""
    launcher: str | None = None
    """Restrict to what one launcher can express."""

    @classmethod
    def of(cls, launcher: str | None = None, **values: Any) -> Pins:
        """Pins from knob names (or their CLI names) to a value, or an iterable of values for a "set" knob; None
        and "auto" leave a knob to the solver. ValueError names the knob and the rule."""
        if launcher is not None and launcher not in LAUNCHERS:
            raise ValueError(f"launcher={launcher!r} must be one of {', '.join(LAUNCHERS)}")
        fixed: dict[str, tuple[Any, ...]] = {}
        for name, value in values.items():
            knob = knob_named(name)
            if value is None or value == "auto" or value == ():
                continue
            if knob.knob.pin == "derived":
                raise ValueError(f"{knob.name} is derived from the other knobs and cannot be pinned")
            many = knob.knob.pin == "set" and isinstance(value, Iterable) and not isinstance(value, str)
            chosen = tuple(dict.fromkeys(_parse(knob, v) for v in (value if many else (value,))))
            fixed[knob.name] = chosen
        ordered = tuple((name, fixed[name]) for name in KNOBS if name in fixed)
        return cls(ordered, launcher)

    @property
    def as_dict(self) -> Mapping[str, tuple[Any, ...]]:
        return dict(self.fixed)

    def allowed(self, name: str) -> tuple[Any, ...] | None:
        """The values knob `name` may take, or None when the solver decides it."""
        return self.as_dict.get(name)

    def value(self, name: str) -> Any:
        """The one value knob `name` is pinned to, or None (unpinned, or a set of several)."""
        allowed = self.allowed(name)
        return allowed[0] if allowed is not None and len(allowed) == 1 else None

    def allows(self, name: str, value: Any) -> bool:
        allowed = self.allowed(name)
        return allowed is None or value in allowed

    def keep(self, name: str, candidates: Iterable[Any]) -> list[Any]:
        """The `candidates` of knob `name` the pins allow, in their order."""
        return [c for c in candidates if self.allows(name, c)]

    def without(self, name: str) -> Pins:
        """These pins with knob `name` (or "launcher") left to the solver."""
        if name == "launcher":
            return Pins(self.fixed, None)
        return Pins(tuple((n, v) for n, v in self.fixed if n != name), self.launcher)

    def shown(self) -> dict[str, Any]:
        """The pins as JSON values (one value, or a list for several), with the launcher."""
        shown: dict[str, Any] = {n: (_json(v[0]) if len(v) == 1 and KNOBS[n].knob.pin != "set" else
                                     [_json(x) for x in v]) for n, v in self.fixed}
        return {**shown, "launcher": self.launcher} if self.launcher else shown

    def flags(self) -> str:
        """The pins as the CLI flags that set them, e.g. "--engine fsdp2 --zero 3"."""
        return " ".join(f"{KNOBS[n].option} {','.join(str(_json(x)) for x in v)}" for n, v in self.fixed)


def _parse(knob: Declared, value: Any) -> Any:
    kind = pinned_kind(knob)
    if kind is bool and isinstance(value, str) and value in ("on", "off"):
        return value == "on"
    parsed = Declared(knob.name, kind, None, knob.knob).parse(value)
    if isinstance(parsed, int) and not isinstance(parsed, bool) and knob.knob.high is not None and \
            not knob.knob.low <= parsed <= knob.knob.high:
        raise ValueError(f"{knob.name}={value!r} must be {knob.knob.low} to {knob.knob.high}")
    return parsed


def _json(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value
