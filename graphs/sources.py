"""Resolve a model name to its published config.json values without touching the network.

Three sources, in order: a local directory or config.json path, the bundled catalog, the local Hugging Face
cache. Remote code is never run: an architecture transformers does not know is an error naming its model_type.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .catalog import closest_ids, load_entry
from .dimensions import HEADS_ALIASES, HIDDEN_ALIASES, check_dimensions
from .errors import MalformedConfig, UnknownModel, UnsupportedModel
from .files import parse_json, read_text

# Fields every decoder-only config needs (under any of their transformers names), with their meaning.
_REQUIRED = {
    "hidden_size": HIDDEN_ALIASES,
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": HEADS_ALIASES,
    "vocab_size": ("vocab_size",),
}
# Upper bounds on the dimensions that set lowering and planning work, far above every published model (the
# largest catalog values: 126 layers, hidden 18432, 128 heads, vocab 256000); beyond them a config is a mistake.
_LIMITS = {"hidden_size": 2**18, "num_hidden_layers": 2**10, "num_attention_heads": 2**12, "vocab_size": 2**24}
# Any other integer field (token ids, widths, expert counts, positions) stays within int32 as transformers expects.
_MAX_INT_FIELD = 2**31 - 1
_MAX_NAME_CHARS = 4096  # PATH_MAX on Linux


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model's config.json values and where they came from."""

    id: str
    values: tuple[tuple[str, Any], ...]
    """The config.json fields (hashable); `as_dict()` gives them back."""
    source: str
    """"catalog", "local" or "hf-cache"."""
    location: str
    """The catalog id or the file path that was read."""

    def as_dict(self) -> dict[str, Any]:
        return {key: json.loads(value) for key, value in self.values}

    @property
    def model_type(self) -> str:
        return str(self.as_dict().get("model_type"))


def resolve(name: str) -> ResolvedModel:
    """Find `name` as a path, a catalog id or a cached Hub id; never downloads."""
    name = _checked_name(name)
    path = Path(name).expanduser()
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        if path.is_dir() and not file.exists():
            raise MalformedConfig(f"{path} is a directory without a config.json",
                                  "Point --model at a folder saved with save_pretrained(), or at a config.json.")
        # recorded absolute: a plan's `check` and its emitted scripts run from other folders than this one
        return _from_values(str(path.resolve()), read_config_file(file), "local", str(file))
    try:
        entry = load_entry(name)
    except UnknownModel:
        cached = _hf_cache_config(name)
        if cached is None:
            closest = closest_ids(name)
            raise UnknownModel(
                f"Unknown model '{name}': not a local path, not in fitplan's catalog, not in the local "
                "Hugging Face cache (fitplan never downloads).",
                (f"Closest catalog ids: {', '.join(closest)}. " if closest else "")
                + "List the catalog with `fitplan models`, or pass a local config.json path.") from None
        return _from_values(name, read_config_file(cached), "hf-cache", str(cached))
    return _from_values(entry.id, dict(entry.config), "catalog", entry.id)


def _checked_name(name: str) -> str:
    """The model name stripped; empty, over-long or control-character names are refused."""
    name = name.strip() if isinstance(name, str) else name
    if not isinstance(name, str) or not name:
        raise UnknownModel("The model name is empty.", "Give a catalog id (`fitplan models`) or a config.json path.")
    if len(name) > _MAX_NAME_CHARS or not name.isprintable():
        shown = name[:60].encode("unicode_escape").decode()
        raise UnknownModel(f"Model name {shown!r}... is not a model name: at most {_MAX_NAME_CHARS} printable "
                           f"characters (got {len(name)}).", "Give a catalog id or a config.json path.")
    return name


def read_config_file(file: Path) -> dict[str, Any]:
    """The JSON object of a config.json: a regular file of at most 16 MiB, nested at most 32 levels."""
    values = parse_json(read_text(file, what="config.json"), where=str(file))
    if not isinstance(values, dict):
        raise MalformedConfig(f"{file} must hold a JSON object, not {type(values).__name__}",
                              "A Hugging Face config.json is one object of fields.")
    return values


def _from_values(model_id: str, values: dict[str, Any], source: str, location: str) -> ResolvedModel:
    validate_values(values, location)
    frozen = tuple(sorted((key, json.dumps(value, sort_keys=True)) for key, value in values.items()
                          if not key.startswith("_")))
    return ResolvedModel(model_id, frozen, source, location)


def validate_values(values: dict[str, Any], location: str) -> None:
    """Check the fields lowering needs, naming the file and field on failure (transformers checks the rest)."""
    model_type = values.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise MalformedConfig(f"{location}: field 'model_type' is missing or not a string",
                              "Every Hugging Face config.json names its architecture in 'model_type'.")
    for field, aliases in _REQUIRED.items():
        present = [alias for alias in aliases if alias in values]
        for alias in present:
            value, limit = values[alias], _LIMITS.get(field, _MAX_INT_FIELD)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
                raise MalformedConfig(f"{location}: field '{alias}' must be an integer from 1 to {limit:,}, got "
                                      f"{_short(value)}", f"Fix '{alias}' ({field}) in the config file.")
    _check_integers(values, location, prefix="")
    check_dimensions(values, location)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _check_integers(values: dict[str, Any], location: str, *, prefix: str) -> None:
    """Every integer field, nested ones included, within int32: torch shapes and ids overflow beyond."""
    for key, value in values.items():
        if isinstance(value, dict):
            _check_integers(value, location, prefix=f"{prefix}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > _MAX_INT_FIELD:
            raise MalformedConfig(f"{location}: field '{prefix}{key}' = {_short(value)} is out of range: integers "
                                  f"are at most {_MAX_INT_FIELD:,} in magnitude.",
                                  f"Fix '{prefix}{key}' in the config file.")


def _hf_cache_config(model_id: str) -> Path | None:
    """The cached config.json of a Hub id, if the local Hugging Face cache holds one."""
    if model_id.count("/") != 1:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model_id, "config.json")
    return Path(found) if isinstance(found, str) else None


def check_architecture(values: dict[str, Any], location: str) -> None:
    """Refuse a model_type that transformers does not know; remote code is never an option."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = values["model_type"]
    if model_type not in CONFIG_MAPPING_NAMES:
        remote = " It declares 'auto_map' (remote code), which fitplan never runs." if "auto_map" in values else ""
        raise UnsupportedModel(
            f"{location}: model_type '{model_type}' is not an architecture transformers knows.{remote}",
            "fitplan lowers architectures built into transformers (trust_remote_code stays off). "
            "Upgrade transformers if the architecture is new, or use a config of a supported model_type.")
