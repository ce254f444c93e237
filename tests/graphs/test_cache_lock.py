"""Processes that miss the same lowering at once lower it once (`graphs.cache.cached_or_lowered`): a sweep's
workers, the test suite's workers and two terminals share each lowering instead of tracing it side by side."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from graphs import resolve
from graphs.cache import cached_or_lowered, load_cached
from graphs.graph import LayerGraph
from graphs.lowering_keys import hf_key

KEY = "0123456789abcdef0123456789abcdef"


def shipped_graph() -> LayerGraph:
    key = hf_key(resolve("meta-llama/Llama-3.2-1B"), dtype="bfloat16", autocast=None, attention=None, lora=None,
                 op_selective=True, compiled=False, liger=False)
    graph = load_cached(key)
    assert graph is not None, "graphs/shipped/ is stale: run python benchmarks/ship_lowerings.py"
    return graph


def _worker(cache: str, graph: LayerGraph, log: str, out: str) -> None:
    import os

    os.environ["FITPLAN_CACHE_DIR"] = cache

    def lower() -> LayerGraph:
        with open(log, "a") as handle:
            handle.write("lowered\n")
        time.sleep(1.0)  # long enough that the other process asks while this one lowers
        return graph

    Path(out).write_text(str(cached_or_lowered(KEY, lower).to_json() == graph.to_json()))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_two_processes_missing_one_entry_lower_it_once(tmp_path):
    graph = shipped_graph()
    log = tmp_path / "lowered.log"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_worker, args=(str(tmp_path / "cache"), graph, str(log), str(tmp_path / f"{i}")))
               for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert log.read_text().count("lowered") == 1
    assert [(tmp_path / f"{i}").read_text() for i in range(2)] == ["True", "True"]


def test_without_the_cache_it_always_lowers(tmp_path, monkeypatch):
    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp_path))
    graph = shipped_graph()
    calls = []
    for _ in range(2):
        cached_or_lowered(KEY, lambda: calls.append(1) or graph, use_cache=False)
    assert len(calls) == 2
    assert not (tmp_path / "lower" / f"{KEY}.json").exists()
