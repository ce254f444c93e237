"""On-disk cache of lowered graphs, keyed by config values, lowering options and library versions.

A cache hit reads one JSON file and never imports torch or transformers. Entries are looked up in the user's cache,
then among the lowerings fitplan ships (`graphs/shipped/`, gzip-compressed entries of the catalog's most used models,
written by `benchmarks/ship_lowerings.py`): their keys hold the library versions that produced them, so under other
versions they are not found and the model is lowered afresh.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
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
    """The package's public version: a local build tag (torch's "+cpu", "+cu128") does not change what the
    fake-tensor lowering records, so a CPU and a CUDA build of one release share entries."""
    try:
        return version(package).split("+", 1)[0]
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


# Graphs this process has read, by key and the user entry's file identity: a session or a sweep asks for the same
# lowerings again (`lower_all` checks them, then the search reads them), and the same graph object lets the cost
# models' identity memos hit across solves. Bounded: a sweep holds a few models' variants.
_LOADED: dict[tuple[str, tuple[int, ...] | None], LayerGraph] = {}
_LOADED_LIMIT = 32


def load_cached(key: str) -> LayerGraph | None:
    """The entry `store_cached` wrote under `key`, else None. The entry carries the SHA-256 of its graph's JSON, so
    an edited, truncated or foreign file (even one that parses, with a wrong inner type or a changed number) is a
    miss, for the price of one C-speed `json.dumps` rather than a graph serialisation compared field by field. A
    graph read before is returned again while the user's entry is the same file (or still absent)."""
    remembered = (key, _file_identity(cache_dir() / "lower" / f"{key}.json"))
    if remembered in _LOADED:
        return _LOADED[remembered]
    graph = _read_entry(key)
    if graph is not None:
        if len(_LOADED) >= _LOADED_LIMIT:
            _LOADED.clear()
        _LOADED[remembered] = graph
    return graph


def _file_identity(path: Path) -> tuple[int, ...] | None:
    """What changes when the file at `path` is replaced or rewritten (None: no such file)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def _read_entry(key: str) -> LayerGraph | None:
    """`load_cached` from the files: the user's entry, then the shipped one."""
    from .graph import LayerGraph

    for text in (_user_entry(key), _shipped_entry(key)):
        try:
            entry = json.loads(text) if text is not None else None
            if entry is None or _digest(entry["graph"]) != entry["sha256"]:
                continue
            return LayerGraph.from_json(entry["graph"])
        except Exception:  # unreadable, of another shape, or from another LayerGraph: a miss, never a crash
            continue
    return None


# The largest entry read (a lowering of a 400B-parameter MoE model is ~1 MiB): anything bigger is not an entry.
MAX_ENTRY_BYTES = 64 * 2**20


def _user_entry(key: str) -> str | None:
    """The text of the user's cache entry, if it is a regular file of at most `MAX_ENTRY_BYTES`; anything else
    (a FIFO, a device, a folder, a huge file) is a miss, never a hang."""
    folder = cache_dir() / "lower"
    _sweep_once(folder)
    return read_regular(folder / f"{key}.json", limit=MAX_ENTRY_BYTES)


def read_regular(path: Path, *, limit: int) -> str | None:
    """The UTF-8 text of `path` if what is opened is a regular file of at most `limit` bytes, else None. The file
    is opened without blocking and checked on the open descriptor, so a FIFO swapped in after a check of the
    path cannot block the read, and at most `limit` + 1 bytes are read even if the file grows."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
        return data.decode() if len(data) <= limit else None
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(descriptor)


def _shipped_entry(key: str) -> str | None:
    """The text of the shipped entry for `key`, if fitplan ships one."""
    try:
        packed = resources.files("graphs").joinpath("shipped", f"{key}.json.gz")
        return gzip.decompress(packed.read_bytes()).decode() if packed.is_file() else None
    except (OSError, ValueError):
        return None


def shipped_dir() -> Path:
    """Where the shipped entries live in this checkout (written by `benchmarks/ship_lowerings.py`)."""
    return Path(__file__).resolve().parent / "shipped"


def ship(key: str, graph: LayerGraph) -> Path:
    """Write `graph` as the shipped entry for `key` (compressed; deterministic bytes: no timestamp)."""
    data = graph.to_json()
    text = json.dumps({"sha256": _digest(data), "graph": data})
    path = shipped_dir() / f"{key}.json.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    return path


def cached_or_lowered(key: str, lower: Callable[[], LayerGraph], *, use_cache: bool = True) -> LayerGraph:
    """The entry under `key`, else `lower()`'s graph, stored. Processes that miss the same entry at once (a sweep's
    workers, parallel test workers, two terminals) lower it once: the first holds the entry's lock while it
    lowers, the others wait on it and then read what it stored."""
    if not use_cache:
        return lower()
    if (cached := load_cached(key)) is not None:
        return cached
    with _entry_lock(key):
        if (cached := load_cached(key)) is not None:
            return cached
        graph = lower()
        store_cached(key, graph)
        return graph


@contextmanager
def _entry_lock(key: str) -> Iterator[None]:
    """An exclusive advisory lock on the entry (`lower/<key>.lock`), held while it is lowered. Where the folder
    cannot be written or the platform has no `fcntl` (Windows), no lock: each process lowers for itself."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    folder = cache_dir() / "lower"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(folder / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def store_cached(key: str, graph: LayerGraph) -> None:
    """Write atomically; a cache that cannot be written (a full disk, no permission) is skipped, not an error, and
    its temporary file is removed whatever interrupted the write."""
    folder = cache_dir() / "lower"
    temporary: Path | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _sweep_once(folder)
        data = graph.to_json()
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
            temporary = Path(handle.name)
            json.dump({"sha256": _digest(data), "graph": data}, handle)
        os.replace(temporary, folder / f"{key}.json")
        temporary = None
    except OSError:
        pass
    finally:  # also on KeyboardInterrupt or an unexpected error: never leave the temporary behind
        if temporary is not None:
            temporary.unlink(missing_ok=True)


# A temporary entry older than this was left by a process that died while writing it; a younger one may be a
# concurrent writer's, which must not be removed under it.
STALE_TEMPORARY_SECONDS = 600
_swept: set[Path] = set()


def _sweep_once(folder: Path) -> None:
    """At a process's first use of the cache folder, remove the temporary files dead writers left in it."""
    if folder not in _swept:
        _swept.add(folder)
        remove_stale_temporaries(folder)


def remove_stale_temporaries(folder: Path) -> None:
    """Remove the temporary files that interrupted writers left in the cache folder."""
    import time

    for path in folder.glob("*.tmp"):
        try:
            info = path.lstat()
            if stat.S_ISREG(info.st_mode) and time.time() - info.st_mtime > STALE_TEMPORARY_SECONDS:
                path.unlink()
        except OSError:
            continue
