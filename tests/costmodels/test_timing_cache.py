"""The caches of the cost models are exact: `node_time`, `speed_for` and `model_states` read only the configuration
fields their caches key on, and time terms with the caches warm equal those computed with them empty, over
configurations that differ in every knob."""

from __future__ import annotations

import itertools

import pytest

import costmodels.states as states
import costmodels.timing as timing
from costmodels import Config, Engine, Offload, Optimizer, Precision, Workload, parse_cluster
from costmodels.config import ContextParallel
from graphs import resolve
from solver.search.route import Lowerings, Route
from solver.search.space import Outer
from tests.solver.test_pipeline_search import _tiny_moe

WORKLOAD = Workload(seq_len=2048, global_batch=64)
# Configurations over tp, sequence parallelism, cp (ring and all-to-all), fp8, ep, sharding, offload and optimizer.
DENSE = [dict(tp=2, dp=8, sequence_parallel=True), dict(tp=1, dp=8, cp=2),
         dict(tp=1, dp=4, cp=4, cp_mode=ContextParallel.ALL_TO_ALL), dict(tp=2, dp=8, precision=Precision.FP8),
         dict(tp=1, dp=16, engine=Engine.FSDP2, zero=3, micro_batch=2, grad_accum=2),
         dict(tp=1, dp=16, engine=Engine.FSDP2, zero=3, dp_replicate=2, micro_batch=2, grad_accum=2),
         dict(tp=1, dp=16, engine=Engine.DEEPSPEED, zero=3, optimizer_offload=Offload.CPU),
         dict(tp=4, dp=4, engine=Engine.MEGATRON, zero=1, compile=True),
         # the FSDP2 layout above compiled, and under DeepSpeed ZeRO-3 (whose compile is not credited): the caches share
         # kernel rates and layer times across engines that run the same kernels (`timing.kernel_key`)
         dict(tp=1, dp=16, engine=Engine.FSDP2, zero=3, micro_batch=2, grad_accum=2, compile=True),
         dict(tp=1, dp=16, engine=Engine.DEEPSPEED, zero=3, micro_batch=2, grad_accum=2, compile=True)]
MOE = [dict(tp=1, dp=16, ep=8, engine=Engine.MEGATRON), dict(tp=1, dp=16, ep=4, engine=Engine.MEGATRON, zero=1)]
# and the optimizers and offloads that change what the states hold
STATES = [dict(dp=16, engine=Engine.DEEPSPEED, zero=2, optimizer_offload=Offload.CPU, grad_accum=4),
          dict(dp=16, engine=Engine.DEEPSPEED, zero=3, optimizer_offload=Offload.CPU, param_offload=Offload.CPU),
          dict(dp=1, optimizer=Optimizer.PAGED_ADAMW_8BIT), dict(dp=1, optimizer_in_backward=True)]


# Config properties computed from fields (`Config.shard_ranks` is dp x cp): reading one reads those fields.
PROPERTIES = {"shard_ranks": ("dp", "cp"), "world_size": ("tp", "cp", "pp", "dp")}


class _Recorder:
    """A configuration that records which fields are read (a property as the fields it is computed from)."""

    def __init__(self, config: Config, read: set[str]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_read", read)

    def __getattr__(self, name: str) -> object:
        self._read.update(PROPERTIES.get(name, (name,)))
        return getattr(self._config, name)


def _cases(tmp_path_factory) -> list[tuple[object, Config]]:
    dense = Lowerings(Route(resolved=resolve("meta-llama/Llama-3.2-1B")))
    moe = Lowerings(Route(resolved=resolve(_tiny_moe(tmp_path_factory.mktemp("moe")))))
    return [(dense(Outer(**c)), Config(**c)) for c in DENSE] + [(moe(Outer(**c)), Config(**c)) for c in MOE]


def test_node_time_reads_only_the_fields_its_cache_keys_on(tmp_path_factory, monkeypatch):
    read: set[str] = set()
    original = timing.node_time
    monkeypatch.setattr(timing, "node_time", lambda graph, cluster, config, *args, **kwargs: original(
        graph, cluster, _Recorder(config, read), *args, **kwargs))
    timing.clear_caches()
    for graph, config in _cases(tmp_path_factory):
        timing.time_terms(graph, parse_cluster("2x8xH100"), WORKLOAD, config)
    assert read and read <= set(timing.NODE_TIME_FIELDS)


def test_speed_for_reads_only_the_fields_its_cache_keys_on(tmp_path_factory, monkeypatch):
    read: set[str] = set()
    original = timing._speed_for
    monkeypatch.setattr(timing, "_speed_for", lambda graph, cluster, config, **kwargs: original(
        graph, cluster, _Recorder(config, read), **kwargs))
    timing.clear_caches()
    for graph, config in _cases(tmp_path_factory):
        timing.time_terms(graph, parse_cluster("2x8xH100"), WORKLOAD, config)
    timing.clear_caches()
    assert read and read <= set(timing.SPEED_FIELDS)


def test_node_terms_read_only_the_fields_their_cache_keys_on(tmp_path_factory, monkeypatch):
    read: set[str] = set()
    original = timing._node_terms
    monkeypatch.setattr(timing, "_node_terms", lambda graph, cluster, config, *args, **kwargs: original(
        graph, cluster, _Recorder(config, read), *args, **kwargs))
    timing.clear_caches()
    for graph, config in _cases(tmp_path_factory):
        timing.time_terms(graph, parse_cluster("2x8xH100"), WORKLOAD, config)
    timing.clear_caches()
    assert read and read <= set(timing.NODE_TERMS_FIELDS)


@pytest.mark.parametrize("order", [0, 1])
def test_time_terms_with_a_warm_cache_equal_those_with_an_empty_one(tmp_path_factory, order):
    cluster = parse_cluster("2x8xH100")
    cases = _cases(tmp_path_factory)
    fresh = []
    for graph, config in cases:
        timing.clear_caches()
        fresh.append(timing.time_terms(graph, cluster, WORKLOAD, config))
    timing.clear_caches()
    indices = list(range(len(cases)))
    for k in itertools.chain(indices[::-1] if order else indices, indices):  # every case with the cache warmed
        graph, config = cases[k]
        assert timing.time_terms(graph, cluster, WORKLOAD, config) == fresh[k]


def test_engines_that_run_other_kernels_keep_their_own_cached_times():
    """On one graph (as a Megatron plan is priced on the HF code where megatron-core cannot build the model),
    Transformer Engine's kernels and a credited compile do not share the kernel rates and layer times of the other
    engines (`timing.kernel_key`): warm, each configuration's terms equal its own cold ones, and they differ."""
    graph = Lowerings(Route(resolved=resolve("meta-llama/Llama-3.2-1B")))(Outer(tp=4, dp=4))
    cluster = parse_cluster("2x8xH100")
    configs = [Config(tp=4, dp=4, engine=Engine.FSDP2, zero=2), Config(tp=4, dp=4, engine=Engine.MEGATRON, zero=1),
               Config(tp=4, dp=4, engine=Engine.FSDP2, zero=2, compile=True)]
    fresh = []
    for config in configs:
        timing.clear_caches()
        fresh.append(timing.time_terms(graph, cluster, WORKLOAD, config))
    timing.clear_caches()
    assert [timing.time_terms(graph, cluster, WORKLOAD, config) for config in configs] == fresh
    assert fresh[0].layers != fresh[1].layers and fresh[0].layers != fresh[2].layers


def test_model_states_read_only_the_fields_their_cache_keys_on(tmp_path_factory):
    read: set[str] = set()
    cases = _cases(tmp_path_factory)
    dense = cases[0][0]
    for graph, config in [*cases, *((dense, Config(**c)) for c in STATES)]:
        expected = states._model_states(graph, config)
        assert states._model_states(graph, _Recorder(config, read)) == expected
        assert states.model_states(graph, config) == expected  # warm or cold, the same
    assert read and read <= set(states.STATE_FIELDS)
