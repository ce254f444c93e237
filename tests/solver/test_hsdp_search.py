"""The search opens hybrid sharding (issue 34) where its declaration offers it (`Knob.searched`: FSDP2, one shard
group per node, several nodes) and nowhere else, and the solver's choice agrees with enumerating the replica
counts one pin at a time."""

from __future__ import annotations

import pytest

from costmodels import Engine, Workload, parse_cluster
from graphs import lower
from solver import solve
from solver.search.pins import Pins
from solver.search.space import outer_space

MODEL = "meta-llama/Llama-3.2-1B"
WORKLOAD = Workload(seq_len=2048, global_batch=128)


def replicas_by_engine(gpus: str, **pins) -> dict[tuple[Engine, int], set[int]]:
    space = outer_space(lower(MODEL), parse_cluster(gpus), WORKLOAD, Pins.of(compile=False, **pins))
    found: dict[tuple[Engine, int], set[int]] = {}
    for outer in (*space.outers, *space.pipelines):
        found.setdefault((outer.engine, outer.dp), set()).add(outer.dp_replicate)
    return found


def test_hybrid_sharding_is_opened_for_fsdp2_across_nodes_only():
    two = replicas_by_engine("2x8xH100", tp=1, pp=1)
    assert two[(Engine.FSDP2, 16)] == {1, 2}  # one 8-GPU node per shard group
    assert all(found == {1} for (engine, _), found in two.items() if engine is not Engine.FSDP2)
    assert all(found == {1} for found in replicas_by_engine("1x8xH100").values())  # one node: nothing to split
    assert replicas_by_engine("2x8xH100", tp=1, pp=1, dp_replicate=1)[(Engine.FSDP2, 16)] == {1}  # a pin stands


@pytest.mark.parametrize("inter_node_gbps", [50, 12.5])
def test_the_solver_picks_the_replica_count_enumeration_picks(inter_node_gbps):
    # At 50 GB/s per GPU (rail-optimised 400 Gb/s NICs) sharding over both nodes is faster; at 12.5 GB/s per GPU
    # keeping the gathers on NVLink and all-reducing 1/8 of the gradients across nodes is.
    def plan(**pins):
        return solve(MODEL, "2x8xH100", seq_len=WORKLOAD.seq_len, global_batch=WORKLOAD.global_batch, time_limit=10,
                     engine="fsdp2", compile="off", cluster_options={"inter_node_gbps": inter_node_gbps}, **pins)

    enumerated = {r: plan(dp_replicate=r).estimate.time.step_time for r in (1, 2)}
    chosen = plan()
    assert chosen.estimate.time.step_time == pytest.approx(min(enumerated.values()), rel=1e-9)
    assert chosen.decisions.dp_replicate == min(enumerated, key=enumerated.get)
    assert (chosen.decisions.dp_replicate == 2) is (inter_node_gbps == 12.5)
