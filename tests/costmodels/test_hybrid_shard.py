"""Hybrid sharding (HSDP, issue 34) in the cost model: states sharded over one replica group's ranks, the gathers
and reduce-scatters priced over that group (one node here), plus the all-reduce of each rank's gradient shard
across the replicas, through the collective models; the values the search opens. Per-rank state bytes against
real FSDP2 runs on a 2-D mesh are in test_distributed_states.py (the hsdp cases)."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels import Config, Engine, Precision, Workload, estimate, parse_cluster, precision
from costmodels.collectives import Group, all_reduce_seconds
from costmodels.hybrid_shard import searched_degrees
from costmodels.overhead import runtime_overhead
from costmodels.states import model_states
from costmodels.zero import local_elements, shard_ranks
from graphs import lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

MB, GA = 2, 3


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    values = {**tiny_values("llama"), "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
    return lower(str(write_config(tmp_path_factory.mktemp("llama"), values)))


def fsdp(dp: int, replicas: int = 1) -> Config:
    return Config(engine=Engine.FSDP2, zero=3, dp=dp, dp_replicate=replicas, micro_batch=MB, grad_accum=GA,
                  precision=Precision.BF16_MIXED)


def dp_total(graph, cluster_spec: str, config: Config) -> float:
    cluster = parse_cluster(cluster_spec)
    workload = Workload(seq_len=64, global_batch=MB * GA * config.dp)
    return dict(estimate(graph, cluster, workload, config).time.details)["dp_collectives_total"]


def test_states_shard_over_one_replica_group(graph):
    hybrid, flat = fsdp(16, 2), fsdp(16)
    assert (shard_ranks(hybrid), shard_ranks(flat)) == (8, 16)
    # a replica group of 8 holds what plain FSDP2 over 8 ranks holds
    assert model_states(graph, hybrid) == model_states(graph, fsdp(8))
    assert model_states(graph, hybrid).optimizer > model_states(graph, flat).optimizer


def test_traffic_is_one_node_of_fsdp_plus_the_replica_all_reduce_of_gradient_shards(graph):
    # Per micro-batch, each rank gathers and reduce-scatters inside its node exactly as FSDP2 over that node alone
    # does, then all-reduces its 1/8 gradient shard (fp32: FSDP2's reduce_dtype) with its peer on the other node.
    hybrid = dp_total(graph, "2x8xH100", fsdp(16, 2))
    one_node = dp_total(graph, "1x8xH100", fsdp(8))
    cluster = parse_cluster("2x8xH100")
    trainable = local_elements(graph.tensor_groups(trainable=True), tp=1, dp=1, engine=Engine.FSDP2, sharded=False)
    reduce_itemsize = precision.reduce_itemsize(Precision.BF16_MIXED, Engine.FSDP2, fsdp(8).optimizer)
    across = all_reduce_seconds(cluster, Group(2, True, 1), trainable * reduce_itemsize / 8)
    assert across > 0
    assert hybrid == pytest.approx(one_node + GA * across, rel=1e-9)


def test_the_replica_group_adds_a_communicator():
    cluster = parse_cluster("2x8xH100")
    assert runtime_overhead(cluster, fsdp(16, 2)) > runtime_overhead(cluster, fsdp(16))


@pytest.mark.parametrize(("values", "gpus_per_node", "expected"), [
    ({"tp": 1, "cp": 1, "dp": 16, "ep": 1, "engine": Engine.FSDP2}, 8, (1, 2)),  # two nodes: a node per group
    ({"tp": 2, "cp": 1, "dp": 16, "ep": 1, "engine": Engine.FSDP2}, 8, (1, 4)),  # 4 nodes of 4 dp ranks
    ({"tp": 1, "cp": 2, "dp": 8, "ep": 1, "engine": Engine.FSDP2}, 8, (1, 2)),  # 4 dp x 2 cp ranks per node
    ({"tp": 1, "cp": 1, "dp": 8, "ep": 1, "engine": Engine.FSDP2}, 8, (1,)),  # one node: nothing to split
    ({"tp": 1, "cp": 1, "dp": 16, "ep": 1, "engine": Engine.DEEPSPEED}, 8, (1,)),  # the engine does not
    ({"tp": 1, "cp": 1, "dp": 16, "ep": 2, "engine": Engine.FSDP2}, 8, (1,)),  # EP's groups: not priced
    ({"tp": 8, "cp": 1, "dp": 4, "ep": 1, "engine": Engine.FSDP2}, 8, (1,)),  # one dp rank per node
])
def test_the_search_opens_one_node_shard_groups_where_the_engine_shards_hybridly(values, gpus_per_node, expected):
    assert searched_degrees(values, gpus_per_node) == expected
    for replicas in expected:  # every value offered is one `Config` accepts
        Config(engine=values["engine"], zero=3 if values["engine"] is Engine.FSDP2 else 0, tp=values["tp"],
               cp=values["cp"], dp=values["dp"], ep=values["ep"], dp_replicate=replicas)


@pytest.mark.parametrize(("changes", "words"), [
    ({"engine": Engine.DDP, "zero": 0}, "engine=ddp"),
    ({"engine": Engine.DEEPSPEED, "zero": 3}, "engine=deepspeed"),
    ({"dp_replicate": 3}, "must divide dp=16"),
    ({"dp_replicate": 16}, "at least 2"),
    ({"ep": 2}, "not priced"),
])
def test_configurations_hybrid_sharding_cannot_run_are_refused_naming_the_rule(changes, words):
    with pytest.raises(ValueError, match=words):
        dataclasses.replace(fsdp(16, 2), **changes)
