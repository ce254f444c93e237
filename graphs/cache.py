"""On-disk cache of lowered graphs, keyed by config values, lowering options and library versions.

A cache hit reads one JSON file and never imports torch or transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapters import LoraSpec
    from .graph import LayerGraph

# Bump when the lowering's output changes meaning, so stale entries are ignored.
FORMAT_VERSION = 12  # 12: LoRA adapters in the dtype the runtime trains them in (fp32 under autocast)


def cache_dir() -> Path:
    """`$FITPLAN_CACHE_DIR`, else `$XDG_CACHE_HOME/fitplan`, else `~/.cache/fitplan`."""
    explicit = os.environ.get("FITPLAN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fitplan"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def cache_key(values: dict[str, Any], *, dtype: str, autocast: str | None, attention: str | None,
              lora: LoraSpec | None, probes: tuple[int, ...], variants: tuple[str, ...] = ()) -> str:
    """The entry of one lowering; `variants` name traced variants ("compiled", "liger") beside the probes."""
    payload = {
        "format": FORMAT_VERSION, "config": values, "dtype": dtype, "autocast": autocast, "attention": attention,
        "lora": lora.to_json() if lora else None, "probes": list(probes),
        "versions": {p: _version(p) for p in ("fitplan", "torch", "transformers", "peft")
                     + (("bitsandbytes",) if lora and lora.quantization else ())
                     + (("liger-kernel",) if "liger" in variants else ())},
    }
    if variants:
        payload["variants"] = list(variants)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _digest(graph: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(graph).encode()).hexdigest()


def load_cached(key: str) -> LayerGraph | None:
    """The entry `store_cached` wrote under `key`, else None. The entry carries the SHA-256 of its graph's JSON, so
    an edited, truncated or foreign file (even one that parses, with a wrong inner type or a changed number) is a
    miss, for the price of one C-speed `json.dumps` rather than a graph serialisation compared field by field."""
    from .graph import LayerGraph

    path = cache_dir() / "lower" / f"{key}.json"
    try:
        entry = json.loads(path.read_text())
        if _digest(entry["graph"]) != entry["sha256"]:
            return None
        return LayerGraph.from_json(entry["graph"])
    except Exception:  # unreadable, of another shape, or from another LayerGraph: a miss, never a crash
        return None


def store_cached(key: str, graph: LayerGraph) -> None:
    """Write atomically; a cache that cannot be written is skipped, not an error."""
    folder = cache_dir() / "lower"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        data = graph.to_json()
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
            json.dump({"sha256": _digest(data), "graph": data}, handle)
        os.replace(handle.name, folder / f"{key}.json")
    except OSError:
        return
