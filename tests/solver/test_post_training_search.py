"""The post-training search (`solver/search/post_training.py`) against brute force: every (reference or vLLM
placement, training configuration) pair enumerated, the training step's tables priced with the post-training
terms (TRL's fused head, the reference copy) and CP-SAT equal to the enumeration on each."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodels import generation as G
from costmodels.tasks import Task
from graphs import resolve
from graphs.lowering import lower_resolved
from solver import solve
from solver.search import post_training as post
from solver.search.pin_rules import pins_of, prepared
from solver.search.reference import enumerate_best
from solver.search.request import Request, cluster_from, workload_for
from solver.search.route import Lowerings, Route
from solver.search.space import outer_space
from solver.search.table_search import build_tables, search
from solver.search.tables import TICK_SECONDS

MODEL, GPUS = "Qwen/Qwen2.5-0.5B", "2xL4"


def brute_force(request: Request, spec: post.PostRequest, pins) -> dict[str, float]:
    """Each candidate's fastest whole step: the enumeration's training optimum (checked against CP-SAT on the
    same tables) plus the candidate's own costs, which no training decision changes."""
    graph_of = Lowerings(Route(resolved=request.resolved))
    totals = {}
    for cand in post.candidates(spec, request, kv_heads=2):
        cluster = request.cluster if cand.training_gpus == request.cluster.world_size else \
            replace(request.cluster, nodes=1, gpus_per_node=cand.training_gpus)
        workload = replace(request.workload, post=replace(request.workload.post, reference=cand.reference))
        graph = lower_resolved(request.resolved)
        space = outer_space(graph, cluster, workload, pins)
        tables = build_tables(space, graph_of, cluster, workload, headroom=request.headroom + cand.reserved_share)
        kinds = [layer.kind for layer in graph.decoder_layers()]
        best = enumerate_best(tables, kinds, space.modes)
        found = search(tables, kinds, space.modes, time_limit=60, configurations=len(tables))
        if best is None:
            assert found.result.table is None
            continue
        assert found.result.objective == best.objective  # CP-SAT = enumeration with the post-training terms
        training = tables[best.table].time_of(best.modes) * TICK_SECONDS
        totals[cand.label()] = training + extra_seconds(request, spec, cand)
    return totals


def extra_seconds(request: Request, spec: post.PostRequest, cand: post.Candidate) -> float:
    """The candidate's generation, weight sync and log-prob passes, priced from the model alone."""
    plan = solve(MODEL, GPUS, post_training=replace(spec, vllm_mode="colocate", utilization=0.3, vllm_tp=1,
                                                    sleep=False), engine="fsdp2", global_batch=8, time_limit=5)
    priced = post.price(plan, request, spec, cand)
    assert priced is not None
    return priced.time.step_time - priced.time.training


@pytest.mark.parametrize("spec", [
    post.PostRequest(task=Task.DPO, completion_len=256, prompt_len=256),
    post.PostRequest(task=Task.GRPO, completion_len=512, prompt_len=128, num_generations=4, sleep=False),
], ids=["dpo", "grpo"])
def test_post_training_search_equals_brute_force_over_placements_and_configurations(spec):
    plan = solve(MODEL, GPUS, post_training=spec, engine="fsdp2", global_batch=8, time_limit=30)
    resolved = resolve(MODEL)
    cluster = cluster_from(GPUS)
    workload, assumed = workload_for(resolved, cluster, spec.prompt_len + spec.completion_len, 8, None)
    workload = post.post_workload(spec, workload, assumed)
    pins, _ = prepared(pins_of(None, {"engine": "fsdp2"}), allow_savers=False, lora=None)
    pins = replace(pins, launcher="hf")  # TRL's trainers run what the HF Trainer runs (`solver/api.py`)
    request = Request(resolved=resolved, cluster=cluster, workload=workload, gpus=GPUS)
    totals = brute_force(request, spec, pins)
    chosen = plan.post_training
    assert chosen is not None
    # the plan's time is a fresh estimate of the decoded configuration; the tables round each node to a 1 us tick
    assert chosen.time.step_time == pytest.approx(min(totals.values()), abs=TICK_SECONDS * 100)
    assert len(totals) == len(chosen.considered)


def test_vllm_page_size_equals_vllms_own_spec_where_vllm_imports():
    """vLLM's `FullAttentionSpec.page_size_bytes` (vllm installs only as a CUDA wheel; the test runs where its
    kv_cache_interface imports, e.g. `pip install --no-deps --target DIR vllm` on PYTHONPATH)."""
    torch = pytest.importorskip("torch")
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    for kv_heads, head_dim, tp in ((4, 128, 1), (8, 128, 2), (2, 64, 1), (8, 128, 8)):
        shape = G.ModelShape(params=1, weight_bytes=1, layers=1, kv_heads=kv_heads, head_dim=head_dim, hidden=1,
                             intermediate=1, vocab=1)
        engine = G.Engine(placement=G.Placement.COLOCATE, tp=tp, utilization=0.3)
        spec = interface.FullAttentionSpec(block_size=G.VLLM_BLOCK_SIZE, num_kv_heads=max(1, kv_heads // tp),
                                           head_size=head_dim, dtype=torch.bfloat16)
        assert G.page_bytes(shape, engine) == spec.page_size_bytes
