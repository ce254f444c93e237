"""Clusters that differ only in their node count share the caches of per-node costs (`cluster.node_view`): exact
because the time terms never read a cluster's node count (its world size) or its notes, checked by recording what
they read and by comparing them across node counts with the caches empty."""

from __future__ import annotations

from dataclasses import fields

import pytest

import costmodels.timing as timing
from costmodels import Cluster, parse_cluster
from costmodels.cluster import node_view
from tests.costmodels.test_timing_cache import WORKLOAD, _cases

# What `node_view` drops: a cost cached on the view must not read them.
DROPPED = {"nodes", "world_size", "assumptions"}


class _ClusterRecorder:
    """A cluster that records which of its fields (and properties) are read."""

    def __init__(self, cluster: Cluster, read: set[str]) -> None:
        object.__setattr__(self, "_cluster", cluster)
        object.__setattr__(self, "_read", read)

    def __getattr__(self, name: str) -> object:
        self._read.add(name)
        return getattr(self._cluster, name)


def test_node_view_is_one_object_per_node_shape():
    views = {spec: node_view(parse_cluster(spec)) for spec in ("8xH100", "16xH100", "2x8xH100", "64xH100", "4xH100",
                                                                "16xA100")}
    assert views["16xH100"] is views["64xH100"] is views["2x8xH100"] is views["8xH100"]
    assert views["4xH100"] is not views["8xH100"]  # four GPUs in the node: other groups
    assert views["16xA100"] is not views["16xH100"]
    kept = {f.name for f in fields(Cluster)} - DROPPED
    assert all(getattr(views["16xH100"], name) == getattr(parse_cluster("64xH100"), name) for name in kept)


def test_time_terms_never_read_the_node_count(tmp_path_factory, monkeypatch):
    read: set[str] = set()
    monkeypatch.setattr(timing, "node_view", lambda cluster: cluster)  # the recorder keys the caches itself
    timing.clear_caches()
    for graph, config in _cases(tmp_path_factory):
        timing.time_terms(graph, _ClusterRecorder(parse_cluster("2x8xH100"), read), WORKLOAD, config)
    timing.clear_caches()
    assert read and not read & DROPPED


@pytest.mark.parametrize("spec", ["8xH100", "8x8xH100"])
def test_time_terms_on_more_nodes_equal_those_priced_alone(tmp_path_factory, spec):
    """Each configuration priced on 2 nodes, then on another node count with the caches warm (the view shared)
    and empty: the three are equal."""
    cases = _cases(tmp_path_factory)
    timing.clear_caches()
    priced = [timing.time_terms(graph, parse_cluster("2x8xH100"), WORKLOAD, config) for graph, config in cases]
    other = parse_cluster(spec)
    warm = [timing.time_terms(graph, other, WORKLOAD, config) for graph, config in cases]
    alone = []
    for graph, config in cases:
        timing.clear_caches()
        alone.append(timing.time_terms(graph, other, WORKLOAD, config))
    assert warm == alone == priced
