"""The lowerings fitplan ships (graphs/shipped/, written by benchmarks/ship_lowerings.py): found under the library
versions installed here, equal to a fresh lowering, and read when the user's cache is empty."""

from __future__ import annotations

import gzip
import json

import pytest

from graphs import resolve
from graphs.cache import load_cached, shipped_dir, store_cached
from graphs.graph import LayerGraph
from graphs.lowering import lower_resolved
from graphs.lowering_keys import hf_key

MODEL = "meta-llama/Llama-3.2-1B"


def shipped_keys() -> set[str]:
    return {path.name.removesuffix(".json.gz") for path in shipped_dir().glob("*.json.gz")}


def test_the_shipped_lowerings_match_the_installed_versions():
    # The keys hold the versions that produced them (torch, transformers, peft, fitplan's format): a stale set is
    # never read, so it must be rewritten with `python benchmarks/ship_lowerings.py` when any of them changes.
    key = hf_key(resolve(MODEL), dtype="bfloat16", autocast=None, attention=None, lora=None, op_selective=True,
                 compiled=False, liger=False)
    assert key in shipped_keys(), "graphs/shipped/ is stale: run python benchmarks/ship_lowerings.py"


def test_every_shipped_entry_is_intact():
    for path in shipped_dir().glob("*.json.gz"):
        entry = json.loads(gzip.decompress(path.read_bytes()))
        assert set(entry) == {"sha256", "graph"}, path.name


@pytest.mark.slow
def test_a_shipped_lowering_equals_a_fresh_one(tmp_path, monkeypatch):
    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp_path))  # an empty user cache: the shipped entry is what loads
    resolved = resolve(MODEL)
    options = {"dtype": "bfloat16", "autocast": None, "attention": None, "lora": None, "op_selective": True,
               "compiled": False, "liger": False}
    shipped = load_cached(hf_key(resolved, **options))
    assert shipped is not None
    lower_resolved.cache_clear()
    fresh = lower_resolved(resolved, use_cache=False, **options)
    assert fresh.to_json() == shipped.to_json()


def test_a_lowering_read_again_is_the_same_graph_until_its_entry_changes(tmp_path, monkeypatch):
    """The process keeps what it read (a sweep asks again, and identity memos key on the graph), but a rewritten
    or removed user entry is read afresh, and a damaged one is still a miss."""
    import graphs.cache as cache

    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_LOADED", {})
    resolved = resolve(MODEL)
    key = hf_key(resolved, dtype="bfloat16", autocast=None, attention=None, lora=None, op_selective=True,
                 compiled=False, liger=False)
    shipped = load_cached(key)
    assert shipped is not None and load_cached(key) is shipped
    data = shipped.to_json()
    edited = {**data, "dims": {**data["dims"], "hidden": data["dims"]["hidden"] + 2}}
    store_cached(key, LayerGraph.from_json(edited))  # the user's entry now shadows the shipped one
    mine = load_cached(key)
    assert mine is not shipped and mine.dims.hidden == shipped.dims.hidden + 2 and load_cached(key) is mine
    entry = tmp_path / "lower" / f"{key}.json"
    entry.write_text(entry.read_text()[:100])  # damaged: a miss, so the shipped entry answers
    assert load_cached(key).dims.hidden == shipped.dims.hidden
    entry.unlink()
    assert load_cached(key) is shipped
