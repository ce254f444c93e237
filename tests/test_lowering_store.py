"""The suite's lowering store (tests/lowering_store.py): it seeds a cache with entries the cache itself reads as the
graphs they were, only while the lowering code is the code that wrote them, and never over an entry already there."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tests.lowering_store as store
from graphs.cache import load_cached, shipped_dir, store_cached
from graphs.graph import LayerGraph


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, dict[str, LayerGraph]]:
    """A store refreshed from a cache holding two real lowerings (two that fitplan ships)."""
    cache = tmp_path / "cold"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FITPLAN_CACHE_DIR", str(tmp_path / "empty"))  # an empty user cache: the shipped entries load
        shipped = sorted(path.name.removesuffix(".json.gz") for path in shipped_dir().glob("*.json.gz"))[:2]
        graphs = {"first": load_cached(shipped[0]), "second": load_cached(shipped[1])}
        patch.setenv("FITPLAN_CACHE_DIR", str(cache))
        for key, graph in graphs.items():
            store_cached(key, graph)
    path = tmp_path / "lowerings.json.gz"
    assert store.refresh(cache, path) == 2
    return path, graphs


def test_seeded_entries_read_back_as_the_graphs_that_were_stored(written, tmp_path, monkeypatch):
    path, graphs = written
    cache = tmp_path / "run"
    assert store.seed(cache, path) == 2
    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(cache))
    for key, graph in graphs.items():
        assert load_cached(key).to_json() == graph.to_json()
    assert store.seed(cache, path) == 0  # what is there already is never written again


def test_an_entry_already_in_the_cache_is_kept(written, tmp_path, monkeypatch):
    path, graphs = written
    cache = tmp_path / "run"
    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(cache))
    store_cached("first", graphs["second"])
    assert store.seed(cache, path) == 1
    assert load_cached("first").to_json() == graphs["second"].to_json()


def test_any_edit_of_the_lowering_code_makes_the_store_stale(written, tmp_path, monkeypatch):
    path, _ = written
    code = tmp_path / "graphs"
    shutil.copytree(store.GRAPHS, code, ignore=shutil.ignore_patterns("__pycache__", "shipped"))
    monkeypatch.setattr(store, "GRAPHS", code)
    assert store.seed(tmp_path / "same", path) == 2  # a copy of the same code: the same stamp
    lowering = code / "lowering.py"
    lowering.write_text(lowering.read_text() + "\n# an edit\n")
    assert store.seed(tmp_path / "edited", path) is None
    assert not (tmp_path / "edited").exists()


def test_another_release_of_a_lowering_library_makes_the_store_stale(written, tmp_path, monkeypatch):
    path, _ = written
    real = store._installed
    monkeypatch.setattr(store, "_installed", lambda package: "0.0" if package == "transformers" else real(package))
    assert store.seed(tmp_path / "run", path) is None


def test_a_damaged_store_seeds_nothing(tmp_path):
    path = tmp_path / "lowerings.json.gz"
    path.write_bytes(b"not gzip")
    assert store.seed(tmp_path / "run", path) is None
    assert store.seed(tmp_path / "run", tmp_path / "absent.json.gz") is None
