"""The bundled model catalog: published `config.json` values of popular LLMs, one JSON file per model.

First stop of name resolution in graphs/: a name becomes a config dict plus its provenance. Local directories
and the HF cache are resolved elsewhere; nothing here imports transformers.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Any, ClassVar

from pydantic import ConfigDict, PositiveInt, TypeAdapter, ValidationError

from .errors import UnknownModel

# Catalog metadata keys start with "_" (`_id`, `_source`, `_uncertain`, `_published_params`, ...). The two
# published config.json keys that do too, `_name_or_path` and OPT's `_remove_final_layer_norm` (false, the
# default), are dropped with them.


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishedParams:
    """The `_published_params` record of a catalog file."""
    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    value: PositiveInt
    """The published parameter count (a rounded figure such as 6.74B is stored as 6740000000)."""
    exact: bool
    """True for an exact count; False for a rounded one."""
    digits: PositiveInt | None = None
    """Significant digits published, for a rounded figure."""
    source: str
    """Where the figure is published."""

    def __post_init__(self) -> None:
        if not self.exact and self.digits is None:
            raise ValueError(f"rounded published count {self.value} must state its significant `digits`")


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogEntry:
    """One catalog model: its published config and where the values come from."""
    id: str
    """Hugging Face id, e.g. "meta-llama/Llama-2-7b-hf"."""
    config: Mapping[str, Any] = field(compare=False)
    """Published config.json fields (read-only view); `config_dict()` gives a copy for transformers."""
    source: str
    """Where the config values come from."""
    uncertain: tuple[str, ...]
    """Config fields whose published value was not read directly."""
    published_params: int | None
    """Published parameter count, if one was found."""
    published_params_exact: bool
    """True when `published_params` is an exact count rather than a rounded figure."""
    published_params_digits: int | None
    """Significant digits of a rounded `published_params`; None when exact or absent."""

    def config_dict(self) -> dict[str, Any]:
        """A deep, mutable copy of `config` (transformers mutates configs it is given)."""
        return copy.deepcopy(dict(self.config))


@lru_cache(maxsize=1)
def _records() -> dict[str, dict[str, Any]]:
    """Every catalog file's JSON keyed by its `_id`; raises ValueError on a malformed file."""
    records: dict[str, dict[str, Any]] = {}
    for item in resources.files("graphs").joinpath("catalog").iterdir():
        if not item.name.endswith(".json"):
            continue
        record = json.loads(item.read_text(encoding="utf-8"))
        model_id = record.get("_id")
        if not model_id or model_id.replace("/", "--") + ".json" != item.name or not record.get("_source"):
            raise ValueError(f"catalog file {item.name} needs an `_id` matching its name, and a `_source`")
        records[model_id] = record
    return records


def catalog_ids() -> list[str]:
    """Every catalog model id, sorted."""
    return sorted(_records())


def _bare(model_id: str) -> str:
    return model_id.rsplit("/", 1)[-1]


def _resolve(name: str) -> str | list[str]:
    """The catalog id `name` denotes, or the candidate ids when it denotes none or several."""
    key = name.strip().lower()
    ids = catalog_ids()
    by_id = {i.lower(): i for i in ids}
    if key in by_id:
        return by_id[key]
    bare = [i for i in ids if _bare(i).lower() == key]
    return bare[0] if len(bare) == 1 else bare or closest_ids(name)


def closest_ids(name: str, n: int = 5) -> list[str]:
    """Up to `n` catalog ids whose id or bare name (after the org) is closest to `name`, ignoring case."""
    keys: dict[str, str] = {}
    for model_id in catalog_ids():
        keys.setdefault(model_id.lower(), model_id)
        keys.setdefault(_bare(model_id).lower(), model_id)
    matches = difflib.get_close_matches(name.strip().lower(), list(keys), n=3 * n, cutoff=0.5)
    return list(dict.fromkeys(keys[m] for m in matches))[:n]


@lru_cache(maxsize=256)
def load_entry(model_id: str) -> CatalogEntry:
    """The catalog entry for a HF id or, when unambiguous, its bare name ("Llama-2-7b-hf"), ignoring case."""
    resolved = _resolve(model_id)
    if isinstance(resolved, list):
        hint = f"Did you mean: {', '.join(resolved)}?" if resolved else "No catalog id is close."
        raise UnknownModel(f"Model {model_id!r} is not in the model catalog.",
                           f"{hint} `fitplan models` lists the catalog.")
    record = _records()[resolved]
    try:
        published = TypeAdapter(PublishedParams | None).validate_python(record.get("_published_params"))
    except ValidationError as err:
        raise ValueError(f"model catalog entry {resolved!r}: malformed `_published_params`: {err}") from err
    config = {k: v for k, v in record.items() if not k.startswith("_")}
    return CatalogEntry(
        id=resolved,
        config=MappingProxyType(copy.deepcopy(config)),
        source=record["_source"],
        uncertain=tuple(record.get("_uncertain", ())),
        published_params=None if published is None else published.value,
        published_params_exact=published is not None and published.exact,
        published_params_digits=None if published is None or published.exact else published.digits,
    )
