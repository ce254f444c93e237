"""The suite's lowering store (tests/lowerings.json.gz): every lowering a cold run of the suite makes, kept with the
tests so that a run seeds its cache once, before the xdist workers start, instead of tracing ~280 model variants on
fake tensors again (about 40% of a cold suite's CPU on the 2-core CI machine).

The store is read only while the lowering code is byte for byte the code that wrote it and the libraries a lowering
imports are the same releases (`lowering_code_stamp`): any edit under graphs/ makes it stale, and a stale store seeds
nothing, so no test ever reads a lowering the current code would not make; the run then lowers afresh, as before.
Refresh it from a cold run's cache (the run prints the command when the store is stale):

    FITPLAN_CACHE_DIR=/tmp/cold ./fitplan test && .venv/bin/python -m tests.lowering_store /tmp/cold
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from graphs.cache import _digest  # the cache's own entry check (importing it reads no lowering code)

STORE = Path(__file__).with_name("lowerings.json.gz")
GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
# The libraries a lowering imports (graphs/: HF, PEFT, torchtitan, megatron-core, bitsandbytes, Liger, triton).
LOWERING_LIBRARIES = ("torch", "transformers", "peft", "accelerate", "torchtitan", "megatron-core", "bitsandbytes",
                      "liger-kernel", "triton")
REFRESH = ("FITPLAN_CACHE_DIR=/tmp/cold ./fitplan test && "
           ".venv/bin/python -m tests.lowering_store /tmp/cold")


def _installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def _lowering_sources() -> list[Path]:
    """Every file of graphs/ but the shipped lowerings (an output, not code) and bytecode."""
    return sorted(path for path in GRAPHS.rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts and "shipped" not in path.parts
                  and path.suffix not in (".pyc", ".lock"))


def lowering_code_stamp() -> str:
    """What a lowering depends on: the bytes of graphs/ (code, architecture tables, catalog) and the releases of the
    libraries it imports (their full version, local build tag included)."""
    digest = hashlib.sha256()
    for path in _lowering_sources():
        digest.update(path.relative_to(GRAPHS).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for package in LOWERING_LIBRARIES:
        digest.update(f"{package}=={_installed(package)}\n".encode())
    return digest.hexdigest()


def _intact(entry: Any) -> bool:
    """A cache entry as graphs/cache.store_cached writes it: its graph's digest is its sha256."""
    return isinstance(entry, dict) and set(entry) == {"sha256", "graph"} and _digest(entry["graph"]) == entry["sha256"]


def read_store(path: Path = STORE) -> dict[str, Any] | None:
    """The store's {"stamp", "entries"}, or None where there is none or it cannot be read."""
    try:
        store = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, ValueError, EOFError):
        return None
    return store if isinstance(store, dict) and {"stamp", "entries"} <= set(store) else None


def seed(cache: Path, path: Path = STORE) -> int | None:
    """Write the store's entries missing from `cache`/lower (atomically, as the cache writes them); the count written,
    or None where the store is stale or absent (nothing is written)."""
    store = read_store(path)
    if store is None or store["stamp"] != lowering_code_stamp():
        return None
    folder = cache / "lower"
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for key, entry in store["entries"].items():
        target = folder / f"{key}.json"
        if target.exists() or not _intact(entry):
            continue
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
            json.dump(entry, handle)
        os.replace(handle.name, target)
        written += 1
    return written


def refresh(cache: Path, path: Path = STORE) -> int:
    """Replace the store with the intact entries of `cache`/lower (a cold run's cache: exactly what the suite
    lowers), stamped with today's lowering code. Returns the number of entries."""
    entries: dict[str, Any] = {}
    for entry_path in sorted((cache / "lower").glob("*.json")):
        try:
            entry = json.loads(entry_path.read_text())
        except (OSError, ValueError):
            continue
        if _intact(entry):
            entries[entry_path.stem] = entry
    text = json.dumps({"stamp": lowering_code_stamp(), "entries": entries})
    path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    return len(entries)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1], "lower").is_dir():
        sys.exit("usage: python -m tests.lowering_store CACHE_DIR   (a cache a cold `./fitplan test` filled)")
    print(f"{STORE}: {refresh(Path(sys.argv[1]))} lowerings")
