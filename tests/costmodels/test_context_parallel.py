"""Context parallelism (costmodels/context_parallel.py) against torch's own ring attention on gloo ranks
(tests/costmodels/cp_ring_reference.py), and `estimate` with cp > 1: the rank's share, the exchange, refusals."""

from __future__ import annotations

from fractions import Fraction

import pytest

from costmodels import Config, Engine, Workload, estimate, parse_cluster
from costmodels.compute import CAUSAL_FRACTION
from costmodels.config import ContextParallel, Precision
from costmodels.context_parallel import (
    attention_shapes,
    buffer_bytes,
    output_copy_bytes,
    rank_graph,
    rank_workload,
    ring_traffic,
    ulysses_traffic,
)
from costmodels.estimator import InvalidConfig
from costmodels.memory import memory_terms
from graphs import Checkpoint, Role, lower
from tests.costmodels.cp_ring_reference import B, S, launch
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

DEGREES = (2, 4)

# --- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, list[dict]]:
    return {cp: launch(tmp_path_factory.mktemp(f"cp{cp}"), cp) for cp in DEGREES}


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    return lower(str(write_config(folder, tiny_values("llama"))), dtype="bfloat16", attention="sdpa")


def _config(cp: int, **knobs) -> Config:
    return Config(cp=cp, engine=Engine.FSDP2, zero=3, precision=Precision.BF16_MIXED, **knobs)


def _shapes(graph, cp: int):
    return attention_shapes(graph, _config(cp), b=B, s_local=S // cp)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cp", DEGREES)
def test_ring_traffic_equals_what_torch_ring_attention_sends_on_gloo(cp, measured, graph):
    """Exact bytes: both sides count the same bf16 K, V shards and fp32 dK, dV shards."""
    traffic = ring_traffic(_shapes(graph, cp), cp)
    assert [rank["sent"] for rank in measured[cp]] == [[traffic.forward, traffic.backward]] * cp


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cp", DEGREES)
def test_rank_attention_flops_equal_torch_ring_attention_work_on_gloo(cp, measured, graph):
    """The lowering's attention FLOPs, rescaled by `rank_graph` and taken at s / cp, at the causal fraction the
    kernels run: every rank's work in torch's load-balanced ring, exactly (and so the same on every rank)."""
    layer = next(n for n in rank_graph(graph, cp).nodes() if n.role is Role.DECODER)
    cost = layer.cost()
    expected = [str(Fraction(w.attention_flops(B, S // cp)) * Fraction(CAUSAL_FRACTION))
                for w in (cost.forward, cost.backward)]
    assert [rank["flops"] for rank in measured[cp]] == [expected] * cp


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cp", DEGREES)
def test_ring_buffers_bound_torch_ring_attention_extra_bytes_on_gloo(cp, measured, graph):
    """`buffer_bytes` follows torch's ring step by step, but which step peaks differs by rank (a rank's partial
    steps copy the merged output once more): the forward within 25%, the backward within 15% of the largest
    rank's extra bytes over local attention on the same shard."""
    forward, backward = buffer_bytes(_shapes(graph, cp), _config(cp))
    extra_forward = max(rank["extra"][0] for rank in measured[cp])
    extra_backward = max(rank["extra"][1] for rank in measured[cp])
    assert forward == pytest.approx(extra_forward, rel=0.25)
    assert backward == pytest.approx(extra_backward, rel=0.15)


@pytest.fixture(scope="module")
def model_measured(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("cp-model")
    return launch(folder, 2, model=write_config(folder / "llama", tiny_values("llama")))


@pytest.mark.distributed
@pytest.mark.slow
def test_saved_bytes_per_layer_equal_a_real_ring_attention_step_of_tiny_llama_on_gloo(model_measured, graph):
    """Saved-tensor hooks over a real training step of the tiny Llama on 2 gloo ranks, each on its load-balanced
    half of every sequence with torch's ring attention: the largest rank saves exactly what `memory_terms` gives
    a decoder layer at s / cp with the ring's output copy, the last rank (no partial merge) exactly the lowering
    at s / cp; the first layer also saves the model-wide rotary tables (`graph.shared`)."""
    cp = 2
    terms = memory_terms(graph, Workload(seq_len=S, global_batch=B), _config(cp, micro_batch=B))
    decoder = [dict(options)[Checkpoint.NONE].saved for layer, options in zip(graph.nodes(), terms.nodes, strict=True)
               if layer.role is Role.DECODER]
    shared = [graph.shared(B, S // cp)] + [0] * (len(decoder) - 1)
    copy = output_copy_bytes(_shapes(graph, cp), _config(cp))
    largest = [max(rank["layer_saved"][i] for rank in model_measured) for i in range(len(decoder))]
    last = model_measured[-1]["layer_saved"]
    assert largest == [n + extra for n, extra in zip(decoder, shared, strict=True)]
    assert last == [n - copy + extra for n, extra in zip(decoder, shared, strict=True)]


def test_rank_graph_leaves_linear_work_per_token_and_scales_attention_by_cp(graph):
    """At s / cp every non-attention FLOP is the token share (1/cp of the whole), attention 1/cp of the whole."""
    cp = 4
    for whole, part in zip(graph.nodes(), rank_graph(graph, cp).nodes(), strict=True):
        for mode in whole.checkpoint_modes:
            for w, p in ((whole.cost(mode).forward, part.cost(mode).forward),
                         (whole.cost(mode).backward, part.cost(mode).backward)):
                assert Fraction(p.attention_flops(B, S // cp)) * cp == w.attention_flops(B, S)
                linear = w.flops - w.attention_flops
                assert (p.flops - p.attention_flops).exact(B, S // cp) * cp == linear.exact(B, S)


@pytest.mark.distributed
@pytest.mark.slow
def test_ulysses_traffic_equals_what_deepspeed_distributed_attention_sends_on_gloo(tmp_path, graph):
    """DeepSpeed-Ulysses' own `DistributedAttention` over 2 gloo ranks: exact bytes of its q, k, v and output
    all-to-alls in forward and of their gradients in backward."""
    cp = 2
    traffic = ulysses_traffic(_shapes(graph, cp), cp)
    assert [rank["sent"] for rank in launch(tmp_path, cp, ulysses=True)] == [[traffic.forward, traffic.backward]] * cp


# --- estimate: wiring and refusals ----------------------------------------------------------------------------


def _estimate(graph, cp: int, *, seq_len: int = 256, mode: ContextParallel = ContextParallel.RING, gpus: int = 0):
    config = _config(cp, cp_mode=mode, checkpoint=(Checkpoint.FULL,) * 3)
    return estimate(graph, parse_cluster(f"{gpus or cp}xH100"), Workload(seq_len=seq_len, global_batch=1), config)


def test_estimate_with_cp_prices_the_rank_share_and_reports_the_exchange(graph):
    """cp=2 against cp=1: half the saved activations per rank, and the ring's exposed time a detail of its own."""
    one, two = _estimate(graph, 1), _estimate(graph, 2)
    assert dict(one.time.details)["cp_exposed"] == 0.0
    assert dict(two.time.details)["cp_exposed"] > 0.0
    assert two.memory.activations * 2 == one.memory.activations  # full checkpointing: per-token layer inputs


def test_estimate_refuses_a_sequence_that_does_not_split_into_2_cp_chunks(graph):
    with pytest.raises(InvalidConfig):
        _estimate(graph, 4, seq_len=4 * 2 * 8 + 4)


def test_estimate_refuses_all_to_all_when_heads_do_not_divide_by_tp_cp(graph):
    """The tiny Llama has 2 key/value heads: Ulysses over 4 ranks cannot give each whole heads."""
    with pytest.raises(InvalidConfig):
        _estimate(graph, 4, mode=ContextParallel.ALL_TO_ALL)
    assert _estimate(graph, 2, mode=ContextParallel.ALL_TO_ALL).time.step_time > 0


def test_estimate_refuses_cp_over_eager_attention(tmp_path):
    eager = lower(str(write_config(tmp_path, tiny_values("llama"))), dtype="bfloat16", attention="eager")
    with pytest.raises(InvalidConfig):
        _estimate(eager, 2)


def test_rank_workload_and_graph_are_unchanged_at_cp_1(graph):
    workload = Workload(seq_len=256, global_batch=1)
    assert rank_graph(graph, 1) is graph
    assert rank_workload(workload, _config(1)) is workload


