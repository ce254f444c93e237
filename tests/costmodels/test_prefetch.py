"""DeepSpeed ZeRO-3's module-by-module fetches (`prefetch`), against schedules worked out by hand from
`PartitionedParameterCoordinator.fetch_sub_module` (DeepSpeed 0.19): gather the current module unless prefetched,
wait, prefetch the next modules until at least the bucket's elements are in flight, compute."""

from __future__ import annotations

import pytest

from costmodels import Config, Engine, Workload, parse_cluster
from costmodels.prefetch import Fetch, exposed_seconds, modules
from costmodels.timing import time_terms
from costmodels.zero import persistence_threshold
from graphs import lower

BIG = 10**9  # elements: more than any bucket below


def test_without_compute_every_collective_shows():
    fetches = [Fetch(numel=BIG, gather=1.0, compute=0.0, reduce=0.5) for _ in range(4)]
    assert exposed_seconds(fetches, bucket=100) == pytest.approx(4 * 1.5)


def test_with_long_compute_only_the_first_gather_and_the_last_reduce_show():
    fetches = [Fetch(numel=BIG, gather=1.0, compute=10.0, reduce=0.5) for _ in range(4)]
    assert exposed_seconds(fetches, bucket=100) == pytest.approx(1.0 + 0.5)


def test_a_module_larger_than_the_bucket_is_prefetched_one_ahead_only():
    """Modules of 3, 1, 3 seconds of compute whose gathers take 1, 1, 4, each larger than the bucket: a module's
    fetch prefetches only the next one, after waiting for its own."""
    fetches = [Fetch(numel=BIG, gather=1.0, compute=3.0), Fetch(numel=BIG, gather=1.0, compute=1.0),
               Fetch(numel=BIG, gather=4.0, compute=3.0)]
    # t=0 gather A (ends 1), prefetch B (ends 2); A computes 1-4; at 4 B ready, prefetch C (4-8); B computes 4-5;
    # C waits until 8, computes 8-11: busy 7, so 4 seconds exposed.
    assert exposed_seconds(fetches, bucket=100) == pytest.approx(4.0)


def test_small_modules_are_prefetched_together_up_to_the_bucket():
    """Ten modules of 10 elements with a 40-element bucket: the first fetch prefetches four, so the queue runs
    ahead and a gather of 1 hides behind the compute of 1 each; only the first shows."""
    fetches = [Fetch(numel=10, gather=1.0, compute=1.0) for _ in range(10)]
    assert exposed_seconds(fetches, bucket=40) == pytest.approx(1.0)
    assert exposed_seconds(fetches, bucket=40) <= exposed_seconds(fetches, bucket=1)


def test_norms_and_biases_below_the_persistence_threshold_are_not_fetched():
    graph = lower("meta-llama/Llama-3.1-8B", dtype="bfloat16")
    layer = graph.decoder_layers()[0]
    config = Config(engine=Engine.DEEPSPEED, zero=3, dp=8)
    fetched = modules(layer, config, graph.dims.hidden)
    assert len(fetched) == 7  # q, k, v, o, gate, up, down
    threshold = persistence_threshold(graph.dims.hidden)
    assert sum(g for g, _ in fetched) == sum(p.numel for p in layer.params if p.numel > threshold)


def test_zero3_costs_more_the_fewer_tokens_hide_each_modules_gather():
    """Llama-3.1-8B on 64 H100s: at 512 tokens per micro-batch the modules' gathers outlast their neighbours'
    compute; at 4096 they hide. The exposed share falls as the tokens grow."""
    graph = lower("meta-llama/Llama-3.1-8B", dtype="bfloat16")
    cluster, shares = parse_cluster("8x8xH100"), {}
    for s in (512, 4096):
        config = Config(engine=Engine.DEEPSPEED, zero=3, dp=64, micro_batch=1)
        terms = time_terms(graph, cluster, Workload(seq_len=s, global_batch=64), config)
        shares[s] = terms.fixed.communication / terms.fixed.step_time
    assert shares[512] > 3 * shares[4096]
