"""GPU prices per GPU-hour for `fitplan choose`: the bundled example table (solver/hardware/data/prices.json) and the
user's own file (a `{GPU: price}` map, or a SkyPilot-style catalog with one row per instance offer).

Prices are keyed by catalog GPU id; every price says where it came from. No network is used.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, PositiveFloat, PositiveInt, TypeAdapter, ValidationError

from costmodels import find_gpu
from graphs import FitplanError
from graphs.files import UnreadableFile, parse_json, parse_yaml, read_text

_FILE_HINT = ("A prices file is YAML/JSON mapping GPU names to USD per GPU-hour (e.g. 'H100: 2.99', or "
              "'H100: {on_demand: 2.99, spot: 1.2}'), or a SkyPilot-style catalog (CSV, or a YAML/JSON list of "
              "rows) with columns AcceleratorName, AcceleratorCount, Price and optional SpotPrice, InstanceType.")
_SKYPILOT_REQUIRED = ("AcceleratorName", "AcceleratorCount", "Price")


class InvalidPrices(FitplanError):
    """A prices file that cannot be read."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPrice:
    """What one GPU costs per hour, and where that number comes from."""

    gpu: str
    """Catalog GPU id."""
    usd_per_gpu_hour: float
    """On-demand price of one GPU for one hour, USD."""
    spot_usd_per_gpu_hour: float | None = None
    """Spot (interruptible) price, USD per GPU-hour, when known."""
    source: str
    """Provider, page or file, instance and date behind the price."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _BundledRecord:
    """One row of solver/hardware/data/prices.json."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")
    gpu: str
    instance: str
    gpus_per_instance: PositiveInt
    instance_usd_per_hour: PositiveFloat
    provider: str
    page: str
    date: str


@dataclass(frozen=True, slots=True, kw_only=True)
class _MapEntry:
    """A GPU's value in a user's `{GPU: price}` map, when given as a mapping."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")
    on_demand: PositiveFloat
    spot: PositiveFloat | None = None


def _bundled_data() -> dict[str, Any]:
    return json.loads(resources.files("solver.hardware").joinpath("data/prices.json").read_text(encoding="utf-8"))


def bundled_note() -> str:
    """The bundled table's caveat, for display: the prices are dated examples."""
    return str(_bundled_data()["_note"])


def bundled_prices() -> dict[str, GpuPrice]:
    """The bundled example prices keyed by catalog GPU id: instance price / GPUs per instance."""
    records = TypeAdapter(list[_BundledRecord]).validate_python(_bundled_data()["prices"])
    table = {}
    for r in records:
        gpu = find_gpu(r.gpu).id
        table[gpu] = GpuPrice(gpu=gpu, usd_per_gpu_hour=r.instance_usd_per_hour / r.gpus_per_instance,
                              source=f"example: {r.provider}, {r.page}, {r.instance} "
                                     f"${r.instance_usd_per_hour:g}/h for {r.gpus_per_instance} GPU"
                                     f"{'s' * (r.gpus_per_instance > 1)}, {r.date}")
    return table


def load_prices(path: str | Path) -> dict[str, GpuPrice]:
    """The prices in a user's file keyed by catalog GPU id; every error names the file (exit 2)."""
    path = Path(path)
    rows = _read(path)
    if isinstance(rows, list):  # CSV rows are numbered by line (the header is line 1), list entries from 1
        return skypilot_prices(rows, origin=path.name, first=2 if path.suffix.lower() == ".csv" else 1)
    if isinstance(rows, dict) and rows:
        return map_prices(rows, origin=path.name)
    raise InvalidPrices(f"Prices file {path} is empty or not a mapping or list of rows.", _FILE_HINT)


def map_prices(mapping: dict[str, Any], *, origin: str) -> dict[str, GpuPrice]:
    """Prices from `{GPU: usd_per_gpu_hour}` or `{GPU: {on_demand: .., spot: ..}}`; unknown GPUs are errors."""
    table = {}
    for name, value in mapping.items():
        try:
            gpu = find_gpu(str(name)).id
        except FitplanError as err:
            raise InvalidPrices(f"In prices file {origin}: {err.message}", err.hint) from err
        try:
            given = value.values() if isinstance(value, dict) else [value]
            if any(isinstance(v, bool) for v in given):  # YAML reads yes/no as booleans, which pydantic takes as 1/0
                raise ValueError("a yes/no value is not a price")
            entry = TypeAdapter(_MapEntry).validate_python(value if isinstance(value, dict) else {"on_demand": value})
        except (ValidationError, ValueError) as err:
            raise InvalidPrices(f"In prices file {origin}: price of {name!r} must be a positive number of USD per "
                                f"GPU-hour, got {value!r}.", _FILE_HINT) from err
        table[gpu] = GpuPrice(gpu=gpu, usd_per_gpu_hour=entry.on_demand, spot_usd_per_gpu_hour=entry.spot,
                              source=f"{origin}: {name}")
    return table


def skypilot_prices(rows: list[Any], *, origin: str, first: int = 1) -> dict[str, GpuPrice]:
    """The cheapest offer per GPU-hour of each catalog GPU in SkyPilot-style rows (Price / AcceleratorCount).

    SkyPilot's own names are read its way ("A100" is the 40 GB part); rows without an accelerator, or with one
    fitplan does not know (TPUs, Inferentia), are skipped.
    """
    aliases = {k: v for k, v in _bundled_data()["skypilot_names"].items() if not k.startswith("_")}
    offers: dict[str, list[tuple[float, float | None, str]]] = {}
    for number, row in enumerate(rows, start=first):
        if not isinstance(row, dict) or any(column not in row for column in _SKYPILOT_REQUIRED):
            raise InvalidPrices(f"Prices file {origin} row {number} lacks {', '.join(_SKYPILOT_REQUIRED)}.",
                                _FILE_HINT)
        name = str(row["AcceleratorName"] or "").strip()
        if not name:
            continue
        try:
            gpu = find_gpu(aliases.get(name, name)).id
        except FitplanError:
            continue
        count, price = _number(row, "AcceleratorCount", origin, number), _number(row, "Price", origin, number)
        spot = _number(row, "SpotPrice", origin, number) if str(row.get("SpotPrice") or "").strip() else None
        where = " ".join(str(row.get(k) or "").strip() for k in ("InstanceType", "Region") if row.get(k))
        offers.setdefault(gpu, []).append((price / count, None if spot is None else spot / count, where))
    if not offers:
        raise InvalidPrices(f"Prices file {origin} has no row with a GPU fitplan knows.", _FILE_HINT)
    return {gpu: _cheapest(gpu, found, origin) for gpu, found in offers.items()}


def _cheapest(gpu: str, offers: list[tuple[float, float | None, str]], origin: str) -> GpuPrice:
    price, _, where = min(offers, key=lambda offer: offer[0])
    spots = [(spot, place) for _, spot, place in offers if spot is not None]
    source = f"{origin}: cheapest on-demand {where}".rstrip()
    if spots:
        source += f"; cheapest spot {min(spots)[1]}".rstrip()
    return GpuPrice(gpu=gpu, usd_per_gpu_hour=price, spot_usd_per_gpu_hour=min(spots)[0] if spots else None,
                    source=source)


def _number(row: dict[str, Any], column: str, origin: str, number: int) -> float:
    try:
        value = float(row[column])
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise InvalidPrices(f"Prices file {origin} row {number}: {column}={row[column]!r} must be a positive "
                            "number.", _FILE_HINT)
    return value


def _read(path: Path) -> object:
    try:  # a regular file of at most 16 MiB (graphs.files): /dev/zero or a FIFO is refused unread
        text = read_text(path, what="prices file")
    except UnreadableFile as err:
        raise InvalidPrices(err.message, _FILE_HINT) from err
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        missing = [c for c in _SKYPILOT_REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise InvalidPrices(f"Prices file {path} (CSV) lacks the column(s) {', '.join(missing)}.", _FILE_HINT)
        return list(reader)
    where = f"Prices file {path}"
    try:
        return parse_json(text, where=where) if path.suffix.lower() == ".json" else parse_yaml(text, where=where)
    except UnreadableFile as err:
        raise InvalidPrices(err.message, _FILE_HINT) from err
