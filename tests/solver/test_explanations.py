"""Explanations come from the numbers: each alternative's reason is its own estimate's, every assumption that
decides a refusal is printed with the flag that changes it, and the ways out fit the request."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from costmodels import Workload, estimate, parse_cluster
from graphs import Checkpoint, LoraSpec, resolve
from graphs.lowering import lower_resolved
from solver import Infeasible, solve
from solver.cli.app import app
from solver.search.alternatives import misfit_reason
from solver.search.pins import Pins
from solver.search.route import Lowerings, Route
from solver.search.space import leanest_modes, outer_space
from solver.search.table_search import build_tables

GIB = 2**30


def test_alternatives_reasons_match_their_own_estimates():
    plan = solve("meta-llama/Llama-3.2-1B", "8xA100", seq_len=2048, global_batch=64, alternatives_count=6)
    assert plan.alternatives
    for alt in plan.alternatives:
        if alt.fits:
            assert "step time" in alt.why
        else:
            assert "host RAM" not in alt.why or "opt-offload" in alt.decisions or "param-offload" in alt.decisions
            assert "does not fit" in alt.why or "host RAM" in alt.why


def test_no_alternative_without_offload_is_blamed_on_host_ram():
    # compile pinned off here and below where a test is not about it: the compiled lowerings were half of each test
    plan = solve("meta-llama/Llama-3.1-70B", "2x8xH100", seq_len=4096, global_batch=64, compile="off")
    for alt in plan.alternatives:
        if "offload" not in alt.decisions:
            assert "host RAM" not in alt.why, alt


def test_a_small_node_gets_its_share_of_the_typical_host():
    one = parse_cluster("1xA10G")
    assert one.cpu_ram_per_node == 96 * GIB  # 1/8 of g5.48xlarge's 768 GiB
    assert one.cpu_cores_per_node == 12
    note = next(a for a in one.assumptions if a.startswith("host"))
    assert "--cpu-ram-gib" in note and "1/8" in note
    assert parse_cluster("8xA10G").cpu_ram_per_node == 768 * GIB
    assert parse_cluster("1xA10G", cpu_ram_gib=32).cpu_ram_per_node == 32 * GIB


def test_host_ram_refusal_names_the_assumption_and_the_flag():
    with pytest.raises(Infeasible) as caught:
        solve("meta-llama/Llama-3.1-70B", "1xT4", seq_len=1024, global_batch=8, compile="off")
    diagnosis = caught.value.diagnosis
    assert diagnosis["binding"] == "host RAM for offloaded states"
    assert any("--cpu-ram-gib" in a for a in diagnosis["assumptions"])
    assert "--cpu-ram-gib" in caught.value.hint
    needed = int(re.search(r"need at least (\d+) GiB", caught.value.message).group(1))
    # Giving the node that much RAM (and a little more) makes the same request plan.
    plan = solve("meta-llama/Llama-3.1-70B", "1xT4", seq_len=1024, global_batch=8, compile="off",
                 cluster_options={"cpu_ram_gib": needed + 16})
    assert plan.decisions.optimizer_offload.value == "cpu"


def test_cli_cluster_flags_reach_the_cluster():
    result = CliRunner().invoke(app, ["solve", "--model", "meta-llama/Llama-3.2-1B", "--gpus", "1xA10G",
                                      "--seq-len", "512", "--global-batch", "4", "--cpu-ram-gib", "40", "--json"])
    assert result.exit_code == 0, result.output
    assert '"cpu_ram_per_node_bytes": 42949672960' in result.output


def test_pinned_no_checkpointing_is_not_called_every_layer_checkpointed():
    with pytest.raises(Infeasible) as caught:
        # proving that nothing fits explores every configuration: a time limit a loaded 2-core machine meets
        solve("meta-llama/Llama-3.1-8B", "1xA10G", seq_len=4096, global_batch=8, checkpoint="none", compile="off",
              time_limit=120)
    assert "every layer checkpointed" not in caught.value.message
    assert "checkpointing pinned to none" in caught.value.message
    assert "--checkpoint auto" in caught.value.hint


def test_larger_gpu_suggestions_run_the_pinned_precision():
    hints = {}
    for pinned in ((), ("bf16-mixed",)):
        with pytest.raises(Infeasible) as caught:
            # time limit raised: the search must prove infeasibility, which a loaded machine can take past 10 s
            solve("meta-llama/Llama-3.2-1B", "1xL4", seq_len=1024, global_batch=8, precision=pinned,
                  checkpoint="none", offload="none", param_offload="none", compile="off", time_limit=120)
        hints[pinned] = caught.value.hint
    assert "V100" in hints[()]  # fp16-mixed runs there
    assert "V100" not in hints[("bf16-mixed",)]  # V100 has no bf16


def test_a_lora_run_is_not_told_to_use_lora():
    with pytest.raises(Infeasible) as caught:
        # compile pinned off: the hint is not about it, and the compiled LoRA lowerings cost most of the test
        solve("meta-llama/Llama-3.1-70B", "1xT4", seq_len=1024, global_batch=8, lora=LoraSpec(rank=8, alpha=16),
              checkpoint="none", offload="none", param_offload="none", compile="off")
    assert "--lora-rank" not in caught.value.hint


def test_misfit_reason_numbers_are_the_estimate_numbers():
    resolved = resolve("meta-llama/Llama-3.2-1B")
    cluster = parse_cluster("1xT4")
    workload = Workload(seq_len=4096, global_batch=16)
    graph = lower_resolved(resolved)
    space = outer_space(graph, cluster, workload, Pins.of(checkpoint=Checkpoint.NONE))
    graph_of = Lowerings(Route(resolved=resolved))
    tables = build_tables(space, graph_of, cluster, workload, headroom=0.05)
    lean = leanest_modes(space.modes, len(graph.decoder_layers()))
    misfits = [t for t in tables if t.host_ok and t.peak_of(lean) > t.budget]
    assert misfits
    for table in misfits[:5]:
        est = estimate(graph_of(table.outer), cluster, workload, table.outer.config(lean))
        why = misfit_reason(est, table, cluster, lean)
        assert f"allocates {est.memory.allocated_peak / GIB:.1f} GiB" in why
        assert f"{table.budget / GIB:.1f} GiB is available" in why
        assert est.memory.allocated_peak == table.peak_of(lean)  # the table and the estimate agree
        assert "checkpointed" not in why  # checkpointing was pinned to none


@pytest.mark.parametrize(("pins", "named"), [({"tp": 16}, "--tp 16"), ({"offload": "nvme"}, "--offload nvme"),
                                             ({"launcher": "megatron", "engine": "fsdp2"}, "--engine fsdp2")])
def test_pins_that_leave_nothing_are_named(pins, named):
    with pytest.raises(Infeasible) as caught:
        solve("meta-llama/Llama-3.2-1B", "8xA100", seq_len=1024, global_batch=64, **pins)
    assert caught.value.diagnosis["binding"] == "pins"
    assert named in caught.value.message


def test_activations_that_no_sharding_removes_are_not_told_to_add_gpus():
    # 8B at 131,072 tokens without context or pipeline parallelism (which run it: test_pipeline_plans.py): the
    # logits and activations alone exceed an H100; more data-parallel GPUs (or LoRA) only shard or drop model
    # states. Before: "more GPUs: ... try about 26 GPUs".
    with pytest.raises(Infeasible) as caught:
        solve("meta-llama/Llama-3.1-8B", "8xH100", seq_len=131072, global_batch=8, cp=1, pp=1, compile="off")
    hint = caught.value.hint
    assert "not more GPUs" in hint and "try about" not in hint and "--lora-rank" not in hint
    assert "--seq-len 65536" in hint
