"""Pipeline plans end to end: `solve` returns one a launcher runs as emitted, its decisions carry the split it was
priced with, and `explain` shows per-stage memory, the bubble and why its schedule beat the others."""

from __future__ import annotations

import functools

import pytest

from costmodels import Config, Workload, parse_cluster
from costmodels.pipeline_schedule import Schedule
from costmodels.pipeline_stages import stage_layers
from costmodels.stage_split import megatron_splits
from graphs import Checkpoint, lower, resolve
from graphs.megatron import lower_megatron
from solver import Infeasible, estimate, solve
from solver.cli.commands import explain_plan
from solver.plan.capability import block_recompute_layers
from solver.plan.launchers import emit

# Plans as users get them: torch.compile searched, as without FITPLAN_AUTO_COMPILE (tests/conftest.py).
pytestmark = pytest.mark.compile_search

GIB = 2**30


@functools.cache
def megatron_pipeline():
    """Llama-3.2-1B over 4 pipeline ranks, memory tight enough that stages recompute (Megatron runs it, priced on
    megatron-core's layers with TE's kernels)."""
    return solve("meta-llama/Llama-3.2-1B", "4xA100-40GB", seq_len=2048, global_batch=16, pp=4, tp=1,
                 engine="megatron", zero=0, headroom=0.74)  # (0.71 before Megatron's own loss was priced)


def test_a_pipeline_plan_records_its_split_and_runs_on_megatron_as_emitted():
    plan = megatron_pipeline()
    d = plan.decisions
    assert d.pp == 4 and sum(d.pp_split) == 16 and len(d.pp_split) == 4 * d.pp_virtual
    assert "megatron" in plan.launchers
    assert Checkpoint.FULL in d.checkpoint  # tight: some layers recompute, as Megatron's block rule expresses
    assert block_recompute_layers(d.checkpoint, d.pp_split) is not None
    args = emit(plan, "megatron")
    text = "\n".join(args.values())
    assert "--pipeline-model-parallel-size 4" in text


def megatron_graph():
    return lower_megatron("meta-llama/Llama-3.2-1B", dtype="bfloat16", kernels="te")


def unsplit_config(plan) -> Config:
    d = plan.decisions
    return Config(pp=d.pp, pp_schedule=d.pp_schedule, pp_virtual=d.pp_virtual, grad_accum=d.grad_accum,
                  micro_batch=d.micro_batch, tp=d.tp)


def test_the_plan_split_is_the_one_estimate_prices():
    plan = megatron_pipeline()
    d = plan.decisions
    graph = megatron_graph()
    workload = Workload(seq_len=2048, global_batch=16)
    unsplit = unsplit_config(plan)
    # where memory binds, a lighter first stage than the FLOP-balanced one fits (it holds the most micro-batches)
    assert d.pp_split in megatron_splits(16, 4) and d.pp_split != stage_layers(graph, workload, unsplit)
    again = estimate("meta-llama/Llama-3.2-1B", "4xA100-40GB", d, seq_len=2048, global_batch=16)
    assert again.time.step_time == plan.estimate.time.step_time
    assert again.memory.device_peak == plan.estimate.memory.device_peak
    assert again.pipeline == plan.estimate.pipeline


@pytest.mark.parametrize("checkpoint", [None, "full"])
def test_a_pipeline_no_launcher_runs_for_this_model_is_never_searched(checkpoint):
    """FSDP2 with a pipeline runs on torchtitan only, which refuses tied embeddings (Llama-3.2-1B ties them): the
    search must not plan it, and say which pin leaves nothing (it once planned it with one checkpoint mode, the
    one case the pipeline search did not ask the launchers about, and failed with "a fitplan bug")."""
    pins = {"checkpoint": checkpoint} if checkpoint else {}
    with pytest.raises(Infeasible, match="--pp 2"):
        solve("meta-llama/Llama-3.2-1B", "8xA100", seq_len=1024, global_batch=64, engine="fsdp2", zero=2, pp=2,
              **pins)
    plan = solve("meta-llama/Llama-3.2-1B", "8xA100", seq_len=1024, global_batch=64, pp=2, **pins)
    assert plan.decisions.pp == 2 and plan.launchers == ("torchrun",)  # DDP stages, which the torchrun script cuts


@pytest.mark.parametrize("model", ["gpt2", "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"])
def test_every_pipeline_configuration_searched_runs_on_a_launcher_of_the_model(model):
    # What the search may pick is what some launcher runs for this model, with the model's own limits (an
    # architecture the torchrun script cannot cut, tied embeddings torchtitan refuses) and every mode it searches.
    from solver.plan.launchers.support import model_launchers, pipeline_launchers, runnable_by
    from solver.plan.record import decisions_of
    from solver.search.pins import Pins
    from solver.search.request import Request, plan_inputs
    from solver.search.route import Lowerings, Route
    from solver.search.space import Outer, outer_space

    resolved, cluster = resolve(model), parse_cluster("2x4xA100")
    workload, pins = Workload(seq_len=1024, global_batch=64), Pins()
    graph = Lowerings(Route(resolved=resolved))(Outer())
    inputs = plan_inputs(Request(resolved=resolved, cluster=cluster, workload=workload, gpus="2x4xA100",
                                  headroom=0.1), pins, graph)
    launchers = model_launchers(inputs, graph.attention)
    space = outer_space(graph, cluster, workload, pins, launchers, pipeline_launchers(inputs, launchers))
    layers = len(graph.decoder_layers())
    checked = 0
    for outer in space.pipelines:
        for mode in (m for m in space.modes if outer.runs(m)):
            decisions = decisions_of(outer.config((mode,) * layers), (mode,) * layers, attention=graph.attention)
            assert runnable_by(decisions, inputs), (model, decisions.summary())
            checked += 1
    assert checked  # gpt2: Megatron's pipelines only (neither the script nor torchtitan, tied, cuts it)


def test_explain_shows_each_stage_the_bubble_and_the_schedules_compared(tmp_path):
    plan = megatron_pipeline()
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    text = "\n".join(explain_plan(path))
    p = plan.estimate.pipeline
    assert f"Pipeline: pp=4 {p.schedule}" in text and "bubble" in text
    for rank in p.ranks:
        assert f"rank {rank.rank} (stages" in text
        assert f"device peak {rank.memory.device_peak / GIB:.2f} GiB" in text
    assert plan.schedules[0].chosen and len(plan.schedules) >= 2  # megatron runs 1f1b and interleaved-1f1b
    assert "Schedules and splits for this layout and recompute:" in text
    for option in plan.schedules[1:]:
        assert option.schedule in text
        assert ("does not fit" in text) or f"{option.step_time / plan.estimate.time.step_time - 1:+.1%}" in text
    # the chosen schedule is the fastest of those that fit
    fitting = [o.step_time for o in plan.schedules if o.fits]
    assert plan.schedules[0].step_time == min(fitting)
    # and its split: at the FLOP-balanced one the same recompute does not fit
    at_balanced = [o for o in plan.schedules if o.schedule == p.schedule and o.split != plan.decisions.pp_split]
    assert [o.split for o in at_balanced] == [stage_layers(megatron_graph(), Workload(seq_len=2048, global_batch=16),
                                                           unsplit_config(plan))]
    assert not at_balanced[0].fits
    assert f"{p.schedule} at the FLOP-balanced split {list(at_balanced[0].split)}: does not fit" in text


def test_a_131k_token_sequence_runs_with_context_parallelism_on_the_gpus_given():
    # Before CP: "nothing fits (223 GiB), try about 22 GPUs", which cannot help a batch of 2 sequences.
    plan = solve("meta-llama/Llama-3.1-8B", "8xH100", seq_len=131072, global_batch=2)
    d = plan.decisions
    # Megatron's hybrid optimizer may keep the optimizer states on the host (its step beside the GPU's) where that
    # saves more recompute than it costs; parameters stay on the GPUs.
    assert d.cp > 1 and d.param_offload == "none"
    assert d.tp * d.cp * d.pp * d.dp == 8
    assert plan.estimate.memory.device_peak <= plan.inputs.cluster.gpu_memory_bytes * (1 - plan.inputs.headroom)
    assert plan.launchers


@pytest.mark.slow
def test_70b_full_fine_tuning_on_two_nodes_pipelines_without_offload():
    # The case: on 2x8xH100 at 4096 tokens the plan relied on CPU optimizer offload. With Megatron's
    # precision-aware optimizer allowed (bf16 moments: it changes the training, so it is never chosen unless allowed)
    # a tensor- and pipeline-parallel layout holds the 70B model with no offload, as published recipes run it.
    plan = solve("meta-llama/Llama-3.1-70B", "2x8xH100", seq_len=4096, optimizer=("adamw", "adamw-bf16"),
                 time_limit=120)  # proved optimal on a loaded machine too
    d = plan.decisions
    assert d.pp > 1 and d.optimizer_offload == "none" and d.param_offload == "none"
    assert d.tp * d.cp * d.pp * d.dp == 16
    assert plan.estimate.memory.device_peak <= plan.inputs.cluster.gpu_memory_bytes * (1 - plan.inputs.headroom)
    assert plan.solver.status == "OPTIMAL" and "megatron" in plan.launchers


def test_context_parallel_ranks_shard_the_model_states_like_data_parallel_ones():
    # Weights are reduced and sharded over dp x cp (Megatron's distributed optimizer, torchtitan's dp_shard_cp):
    # cp=8 x dp=1 holds the states dp=8 does.
    graph = lower("meta-llama/Llama-3.1-8B", dtype="bfloat16")
    from costmodels import Engine, Precision
    from costmodels.states import model_states

    states = {cp: model_states(graph, Config(cp=cp, dp=8 // cp, engine=Engine.MEGATRON, zero=1,
                                             precision=Precision.BF16_MIXED)) for cp in (1, 8)}
    assert states[8].optimizer == states[1].optimizer and states[8].master == states[1].master
    assert states[8].grads == states[1].grads


@pytest.mark.slow
@pytest.mark.parametrize(("model", "gpus", "pins"), [
    ("meta-llama/Llama-3.1-405B", "1024xH100", {"seq_len": 8192, "pp": 16, "tp": 8}),
    ("mistralai/Mixtral-8x22B-v0.1", "64xH100", {"seq_len": 4096, "pp": 8}),
])
def test_solved_large_plans_pass_megatrons_own_argument_validation(model, gpus, pins, tmp_path, monkeypatch):
    """The issue's large cases, solved (not hand-built) for the Megatron launcher: Megatron-LM's parse_args and
    validate_args accept the emitted flags and read back the plan's layout (skipped without Megatron-LM's
    source, tests/solver/megatron_args.py; .ci/run provides it when a local snapshot exists)."""
    from tests.solver.test_parallel_launchers import check_megatron_reads, megatron_checked

    plan = solve(model, gpus, launcher="megatron", time_limit=120, **pins)
    assert plan.decisions.pp == pins["pp"] and "megatron" in plan.launchers
    args, config = megatron_checked(plan, tmp_path, monkeypatch)
    check_megatron_reads(plan, args, config)


def test_a_searched_uneven_split_passes_megatrons_own_argument_validation(tmp_path, monkeypatch):
    """The split the search chose where memory binds (first and last stages lighter than the middle ones): Megatron's
    first/last-stage flags pass its validate_args and read back as the plan's split."""
    from tests.solver.test_parallel_launchers import check_megatron_reads, megatron_checked

    plan = megatron_pipeline()
    first, middle, *_, last = plan.decisions.pp_split
    assert first < middle and last < middle
    args, config = megatron_checked(plan, tmp_path, monkeypatch)
    check_megatron_reads(plan, args, config)


@pytest.mark.slow
def test_solved_405b_pipeline_plan_passes_torchtitans_config_parser(tmp_path, monkeypatch):
    """The 405B case solved for torchtitan (lowered through torchtitan's own model): its TOML parses in torchtitan's
    ConfigManager and the model's update_from_config, with the plan's degrees, schedule, split and placement."""
    pytest.importorskip("torchtitan")
    from tests.solver.test_parallel_launchers import torchtitan_checked

    plan = solve("meta-llama/Llama-3.1-405B", "1024xH100", seq_len=8192, launcher="torchtitan", pp=16, tp=8,
                 time_limit=120)
    assert plan.decisions.pp == 16 and plan.launchers == ("torchtitan",)
    config = torchtitan_checked(plan, tmp_path / "titan", monkeypatch)
    assert config.model_spec.flavor == "405B"


def test_megatron_runs_a_pipeline_of_more_stages_than_micro_batches(tmp_path, monkeypatch):
    """megatron-core's 1F1B warms up min(pp - rank - 1, m) micro-batches, so Megatron-LM runs 2 micro-batches through
    4 stages, which torch's Schedule1F1B refuses: the search offers it on Megatron's engine only, and Megatron-LM's
    validate_args accepts the emitted flags (skipped without its source)."""
    from tests.solver.test_parallel_launchers import check_megatron_reads, megatron_checked

    pins = {"seq_len": 1024, "global_batch": 2, "micro_batch": 1, "pp": 4, "tp": 1,
            "pp_schedule": Schedule.ONE_F_ONE_B}
    plan = solve("Qwen/Qwen2.5-0.5B", "4xA100", launcher="megatron", time_limit=60, **pins)
    assert (plan.decisions.pp, plan.decisions.grad_accum) == (4, 2)
    with pytest.raises(Infeasible):
        solve("Qwen/Qwen2.5-0.5B", "4xA100", launcher="torchrun", time_limit=60, **pins)
    args, config = megatron_checked(plan, tmp_path, monkeypatch)
    check_megatron_reads(plan, args, config)
