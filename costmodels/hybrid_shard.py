"""Hybrid sharding (HSDP, FSDP2's `fully_shard` on a 2-D (replicate, shard) mesh): the data-parallel ranks split
into `dp_replicate` groups; each group shards the model states over its dp / dp_replicate ranks (times the
context-parallel ones, torchtitan's `dp_shard_cp` mesh) and holds a full replica of them. Gathers and
reduce-scatters stay inside a shard group, and each rank's reduced gradient shard is then all-reduced with the
ranks holding the same shard in the other groups (torch 2.13 fsdp/_fully_shard/_fsdp_collectives.py
`foreach_reduce`: reduce_scatter over the shard group, then all_reduce over the replicate group, every
micro-batch's backward unless `set_requires_all_reduce(False)`, which torchtitan and the torchrun script do not
call).

Where it pays: on several nodes a shard group of one node keeps the gathers of every micro-batch on NVLink, and
only a 1 / (shard ranks) slice of the gradients crosses the network, at the cost of states sharded over fewer
ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .engines import rules_of


def shard_degree(dp: int, cp: int, replicas: int) -> int:
    """The ranks one shard group spans: its data-parallel ranks times the context-parallel ones."""
    return dp // replicas * cp


def searched_degrees(values: Mapping[str, Any], gpus_per_node: int) -> tuple[int, ...]:
    """The replica counts the search tries (`Knob.searched`): 1 (plain FSDP), and the one whose shard group is
    one node's data- and context-parallel ranks where that leaves two replicas or more (several nodes) and the
    engine shards hybridly (`EngineRules.hybrid_shards`). Expert parallelism's own groups are not priced with it."""
    tp, cp, dp = values["tp"], values["cp"], values["dp"]
    if not rules_of(values["engine"]).hybrid_shards or values["ep"] > 1 or gpus_per_node % (tp * cp):
        return (1,)
    per_node = gpus_per_node // (tp * cp)  # data-parallel ranks of one node (one per TP x CP group)
    if per_node < 2 or dp % per_node or dp // per_node < 2:
        return (1,)
    return (1, dp // per_node)
