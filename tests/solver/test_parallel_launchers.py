"""Pipeline, context and expert parallelism as emitted (issue 13): Megatron-LM's own parse_args, validate_args and
TransformerConfig accept the emitted flags and read back the decided degrees, schedule and split (per stage, as
megatron-core builds its layers); torchtitan's own ConfigManager parses the emitted job with the same values, and
what a launcher cannot run is refused with the registry's reason.

The plans are Llama-3.1-405B on 1024xH100 (tp=8, pp=16, an uneven Megatron split) and Mixtral-8x22B on 64xH100
(ep=8, pp=4), built from decisions on the models' own inputs (shape from their lowering); the emitters read only a
plan's inputs and decisions.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from costmodels import Engine, Optimizer, Precision
from costmodels.config import ContextParallel
from costmodels.pipeline_schedule import SINGLE_STAGE, TORCH_CLASS, Schedule, local_stages, stage_ranks
from graphs import Checkpoint, FitplanError, lower, resolve
from solver import estimate, solve
from solver.plan.launchers import emit, megatron, torchtitan
from solver.plan.launchers.support import unsupported
from solver.plan.model_shape import model_shape
from solver.plan.record import Plan
from tests.solver.megatron_args import H100, megatron_stage_layers, validate
from tests.solver.test_launchers import flag_values, unknown_flags

# Plans as users get them: torch.compile searched, as without FITPLAN_AUTO_COMPILE (tests/conftest.py).
pytestmark = pytest.mark.compile_search


@pytest.fixture(scope="module")
def small() -> Plan:
    return solve("meta-llama/Llama-3.2-1B", "8xH100", seq_len=2048, global_batch=64, time_limit=5)


def plan_for(small: Plan, model: str, nodes: int, *, seq_len: int, **decisions: Any) -> Plan:
    """A plan for `model` on `nodes` 8xH100 nodes with these decisions (inputs as solve records them)."""
    graph = lower(model)
    cluster = dataclasses.replace(small.inputs.cluster, nodes=nodes, spec=f"{nodes * 8}xH100")
    decisions.setdefault("checkpoint", (Checkpoint.NONE,) * graph.dims.layers)
    d = dataclasses.replace(small.decisions, **decisions)
    inputs = dataclasses.replace(
        small.inputs, model=model, architecture=graph.architecture, layer_class=graph.layer_class,
        hidden_size=graph.dims.hidden, num_layers=graph.dims.layers, cluster=cluster, seq_len=seq_len,
        global_batch=d.micro_batch * d.grad_accum * d.dp, tokens_per_step=seq_len * d.micro_batch * d.grad_accum * d.dp,
        shape=model_shape(graph, resolve(model).as_dict(), seq_len=seq_len))
    return dataclasses.replace(small, inputs=inputs, decisions=d)


LLAMA_405B = {"engine": Engine.MEGATRON, "zero": 1, "tp": 8, "pp": 16, "dp": 8, "micro_batch": 1, "grad_accum": 32,
              "sequence_parallel": True, "precision": Precision.BF16_MIXED, "optimizer": Optimizer.ADAMW,
              "pp_split": (6, *[8] * 14, 8)}  # 126 layers: the first stage carries the embedding
MIXTRAL = {"engine": Engine.MEGATRON, "zero": 1, "tp": 1, "pp": 4, "dp": 16, "ep": 8, "micro_batch": 1,
           "grad_accum": 8, "precision": Precision.BF16_MIXED, "optimizer": Optimizer.ADAMW,
           "pp_split": (13, 15, 15, 13)}  # 56 layers


def megatron_checked(plan: Plan, tmp_path: Path, monkeypatch) -> tuple[Any, Any]:
    """Megatron-LM's validated arguments and TransformerConfig for the emitted job, in its launch environment."""
    files = emit(plan, "megatron")
    arguments = shlex.split(files["megatron_args.txt"])
    assert unknown_flags(arguments) == []
    launch = shlex.split(files["megatron_launch.sh"].splitlines()[-1])
    env = dict(word.split("=", 1) for word in launch[1:launch.index("torchrun")]) if launch[0] == "env" else {}
    world = plan.inputs.cluster.nodes * plan.inputs.cluster.gpus_per_node
    return validate(tmp_path, arguments, world=world, capability=H100, env=env, monkeypatch=monkeypatch)


def check_megatron_reads(plan: Plan, args: Any, config: Any) -> None:
    d = plan.decisions
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
            args.expert_model_parallel_size, args.data_parallel_size) == (d.tp, d.pp, d.cp, d.ep, d.dp)
    assert (args.virtual_pipeline_model_parallel_size or 1) == d.pp_virtual
    # Megatron's micro-batches per step: global / (micro x data-parallel ranks) = the pipeline's m
    assert args.global_batch_size // (args.micro_batch_size * args.data_parallel_size) == d.grad_accum
    assert args.micro_batch_size == d.micro_batch and args.global_batch_size == plan.inputs.global_batch
    assert megatron_stage_layers(config, d.pp, d.pp_virtual) == d.pp_split
    if d.cp > 1:
        assert args.cp_comm_type == [{ContextParallel.RING: "p2p", ContextParallel.ALL_TO_ALL: "a2a"}[d.cp_mode]]
    shape = plan.inputs.shape
    assert (config.num_moe_experts or 0) == shape.experts
    if shape.experts:
        assert (config.moe_router_topk, config.moe_ffn_hidden_size) == \
            (shape.top_k, shape.expert_ffn_hidden or shape.ffn_hidden)
        assert config.moe_token_dispatcher_type == "alltoall"
        # the router as graphs/megatron_moe traces it: the aux loss at the model's weight, pre-softmax or not
        assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff, config.moe_router_pre_softmax) == \
            ("aux_loss", shape.aux_loss_coeff, shape.router_pre_softmax)


def test_llama_405b_pipeline_plan_passes_megatron_validation(small, tmp_path, monkeypatch):
    plan = plan_for(small, "meta-llama/Llama-3.1-405B", 128, seq_len=8192, **LLAMA_405B)
    assert unsupported("megatron", plan.decisions, plan.inputs) == []
    args, config = megatron_checked(plan, tmp_path, monkeypatch)
    check_megatron_reads(plan, args, config)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (6, 8)


def test_llama_405b_interleaved_uneven_split_passes_megatron_validation_as_a_layout(small, tmp_path, monkeypatch):
    split = (3, *[4] * 30, 3)  # 32 stages of 126 layers, v=2 per rank
    plan = plan_for(small, "meta-llama/Llama-3.1-405B", 128, seq_len=8192,
                    **{**LLAMA_405B, "pp_schedule": Schedule.INTERLEAVED_1F1B, "pp_virtual": 2, "pp_split": split})
    args, config = megatron_checked(plan, tmp_path, monkeypatch)
    check_megatron_reads(plan, args, config)
    assert args.pipeline_model_parallel_layout is not None


def test_llama_405b_recompute_blocks_are_read_back_per_stage(small, tmp_path, monkeypatch):
    split = LLAMA_405B["pp_split"]
    # the first 2 layers of every stage recomputed
    modes = tuple(Checkpoint.FULL if i < 2 else Checkpoint.NONE for n in split for i in range(n))
    plan = plan_for(small, "meta-llama/Llama-3.1-405B", 128, seq_len=8192, **LLAMA_405B)
    plan = dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, checkpoint=modes))
    _, config = megatron_checked(plan, tmp_path, monkeypatch)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == \
        ("full", "block", 2)
    shifted = modes[1:] + modes[:1]  # no k recomputes these
    bad = dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, checkpoint=shifted))
    with pytest.raises(FitplanError, match="first k of every pipeline stage"):
        emit(bad, "megatron")


def titan_micro_batches(config: Any, d: Any) -> int:
    """The micro-batches of rank 0's schedule as torchtitan's `_build_pipeline_schedule` builds it from the parsed
    job (local_batch_size // pipeline_parallel_microbatch_size), on stand-in stages."""
    from torchtitan.distributed.pipeline_parallel import _build_pipeline_schedule

    from tests.costmodels.test_pipeline_schedule import RecordingStage

    v = local_stages(d.pp_schedule, d.pp_virtual)
    stages = [RecordingStage(k * d.pp, d.pp * v, d.pp) for k in range(v)]
    schedule = _build_pipeline_schedule(parallelism=config.parallelism, stages=stages,
                                        local_batch_size=config.training.local_batch_size,
                                        loss_fn=lambda *args: (None, None))
    return schedule._n_microbatches


def torchtitan_checked(plan: Plan, folder: Path, monkeypatch) -> Any:
    """torchtitan's parsed Trainer.Config of the emitted job, checked against the plan's pipeline decisions and by
    the model's own update_from_config (weight tying under PP, TP heads, RoPE length)."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

    folder.mkdir()
    for name, text in emit(plan, "torchtitan").items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, torchtitan.MODULE, raising=False)
    config = ConfigManager().parse_args(["--module", torchtitan.MODULE, "--config", torchtitan.CONFIG])
    monkeypatch.delitem(sys.modules, torchtitan.MODULE, raising=False)
    d, par = plan.decisions, config.parallelism
    assert (par.pipeline_parallel_degree, par.tensor_parallel_degree, par.data_parallel_shard_degree) == \
        (d.pp, d.tp, d.dp)
    assert "Schedule" + par.pipeline_parallel_schedule == TORCH_CLASS[d.pp_schedule]
    # torchtitan's micro-batches per step, as its own schedule builder splits local_batch_size: m
    assert titan_micro_batches(config, d) == d.grad_accum
    assert par.pipeline_parallel_microbatch_size == d.micro_batch
    parts = par.module_fqns_per_model_part
    assert tuple(sum(name.startswith("layers.") for name in part) for part in parts) == d.pp_split
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
    layers = [n for part in parts for n in part if n.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(plan.inputs.num_layers)]
    # torchtitan places the stages on ranks as fitplan priced them (looped, or a V for ZBVZeroBubble)
    placed = {s: r for r in range(d.pp) for s in _get_pp_rank_to_stage_indices_mapping(
        r, d.pp, par.pipeline_parallel_schedule, len(parts))}
    assert tuple(placed[s] for s in range(len(parts))) == stage_ranks(d.pp_schedule, d.pp, d.pp_virtual)
    config.model_spec.model.update_from_config(config=config)
    # the device mesh torchtitan's trainer builds: its degrees must multiply to the world size
    from torchtitan.distributed.parallel_dims import ParallelDims

    world = plan.inputs.cluster.nodes * plan.inputs.cluster.gpus_per_node
    dims = ParallelDims.from_config(par, world)
    assert (dims.pp, dims.tp, dims.dp_shard * dims.dp_replicate) == (d.pp, d.tp, d.dp)
    return config


def test_llama_405b_pipeline_plan_passes_torchtitan_config_parser(small, tmp_path, monkeypatch):
    pytest.importorskip("torchtitan")
    plan = plan_for(small, "meta-llama/Llama-3.1-405B", 128, seq_len=8192,
                    **{**LLAMA_405B, "engine": Engine.FSDP2, "zero": 2, "pp_schedule": Schedule.INTERLEAVED_ZB,
                       "pp_virtual": 2, "pp_split": (3, *[4] * 30, 3)})
    config = torchtitan_checked(plan, tmp_path / "titan", monkeypatch)
    assert config.model_spec.flavor == "405B"


# Llama-3.1-8B (32 layers, untied) on pp=4 ranks: one uneven split per stage count.
SPLITS = {1: (7, 9, 9, 7), 2: (3, 4, 4, 4, 4, 4, 4, 5)}


@pytest.mark.parametrize("schedule", list(Schedule))
def test_torchtitan_parses_every_pipeline_schedule_with_its_split(small, tmp_path, monkeypatch, schedule):
    pytest.importorskip("torchtitan")
    v = 1 if schedule in SINGLE_STAGE else 2
    plan = plan_for(small, "meta-llama/Llama-3.1-8B", 2, seq_len=4096, engine=Engine.FSDP2, zero=2, tp=1, pp=4, dp=4,
                    micro_batch=1, grad_accum=8, pp_schedule=schedule, pp_virtual=v, pp_split=SPLITS[v])
    assert unsupported("torchtitan", plan.decisions, plan.inputs) == []
    torchtitan_checked(plan, tmp_path / "titan", monkeypatch)


def test_torchtitan_refuses_a_pipeline_over_tied_embeddings(small):
    plan = dataclasses.replace(small, decisions=dataclasses.replace(
        small.decisions, engine=Engine.FSDP2, zero=2, pp=2, dp=4, grad_accum=8, pp_split=(8, 8)))
    assert small.inputs.shape.tied_embeddings
    (problem,) = unsupported("torchtitan", plan.decisions, plan.inputs)
    assert "Weight tying" in problem
    with pytest.raises(FitplanError, match="Weight tying"):
        emit(plan, "torchtitan")


def test_estimate_for_torchtitan_refuses_the_pipeline_over_tied_embeddings_that_solve_refuses():
    """`estimate --launcher torchtitan` checks the model's layout as `solve`'s launcher filter does (it priced the
    pipeline)."""
    config = {"engine": "fsdp2", "zero": 2, "pp": 2, "dp": 4, "grad_accum": 4}
    with pytest.raises(FitplanError, match="Weight tying") as refused:
        estimate("meta-llama/Llama-3.2-1B", "8xH100", config, seq_len=2048, launcher="torchtitan")
    assert "Llama3Model" not in str(refused.value)  # the model is named by its HF facts, as a plan records them


@pytest.mark.parametrize("tp", [1, 2])
def test_mixtral_expert_and_pipeline_plan_passes_megatron_validation(small, tmp_path, monkeypatch, tp):
    """With TP the experts are TP-sharded too (Megatron's expert_tensor_parallel_size defaults to tp, as fitplan
    shards the expert stacks) and EP takes ep of the dp x cp ranks."""
    plan = plan_for(small, "mistralai/Mixtral-8x22B-v0.1", 8, seq_len=4096,
                    **{**MIXTRAL, "tp": tp, "dp": 16 // tp, "sequence_parallel": tp > 1})
    assert unsupported("megatron", plan.decisions, plan.inputs) == []
    args, config = megatron_checked(plan, tmp_path, monkeypatch)
    check_megatron_reads(plan, args, config)
    assert (args.expert_tensor_parallel_size, args.sequence_parallel) == (tp, tp > 1)


def test_mixtral_plan_is_refused_by_torchtitan_with_reasons(small):
    plan = plan_for(small, "mistralai/Mixtral-8x22B-v0.1", 8, seq_len=4096,
                    **{**MIXTRAL, "engine": Engine.FSDP2, "zero": 2})
    problems = unsupported("torchtitan", plan.decisions, plan.inputs)
    assert any("expert parallelism" in p for p in problems) and any("flavour" in p for p in problems)
    with pytest.raises(FitplanError) as refusal:
        emit(plan, "torchtitan")
    assert all(p in str(refusal.value) for p in problems)


@pytest.mark.parametrize("mode", list(ContextParallel))
def test_context_parallel_plan_passes_megatron_validation_in_each_mode(small, tmp_path, monkeypatch, mode):
    plan = plan_for(small, "meta-llama/Llama-3.1-8B", 1, seq_len=131072, engine=Engine.MEGATRON, zero=1, cp=8,
                    cp_mode=mode, dp=1, micro_batch=1, grad_accum=2, checkpoint=(Checkpoint.FULL,) * 32)
    args, config = megatron_checked(plan, tmp_path, monkeypatch)
    assert (args.context_parallel_size, args.cp_comm_type) == (8, [megatron.MEGATRON_CP_COMM[mode]])
    assert args.seq_length == 131072 and config.context_parallel_size == 8
    problems = unsupported("torchtitan", plan.decisions, plan.inputs)
    assert any("all-gathers" in p for p in problems)


def test_dense_model_with_expert_parallelism_is_refused_by_every_launcher(small):
    plan = dataclasses.replace(small, decisions=dataclasses.replace(small.decisions, ep=2))
    for launcher in ("megatron", "torchrun", "torchtitan"):
        assert any("without experts" in p for p in unsupported(launcher, plan.decisions, plan.inputs))
        with pytest.raises(FitplanError, match="without experts"):
            emit(plan, launcher)


def test_megatron_refuses_schedules_megatron_core_lacks(small):
    for schedule, v, split in ((Schedule.GPIPE, 1, (8, 8)), (Schedule.ZBV, 2, (4, 4, 4, 4)),
                               (Schedule.INTERLEAVED_ZB, 2, (4, 4, 4, 4))):
        d = dataclasses.replace(small.decisions, engine=Engine.MEGATRON, zero=1, pp=2, dp=4, grad_accum=8,
                                pp_schedule=schedule, pp_virtual=v, pp_split=split)
        problems = unsupported("megatron", d, small.inputs)
        assert any(f"pipeline schedule {schedule}" in p and "torchtitan" in p for p in problems), schedule
        assert not any("pipeline schedule" in p for p in unsupported("torchtitan", d, small.inputs))


def test_megatron_flag_values_name_the_split_forms(small):
    """Each split form takes its own flags: even (none), equal chunks, first/last, and a layout otherwise."""
    base = dict(engine=Engine.MEGATRON, zero=1, pp=2, dp=4, grad_accum=8)
    cases = {(8, 8): (1, {}), (7, 9): (1, {"--decoder-first-pipeline-num-layers": "7",
                                           "--decoder-last-pipeline-num-layers": "9"}),
             (4, 4, 4, 4): (2, {"--num-layers-per-virtual-pipeline-stage": "4"}),
             (3, 5, 4, 4): (2, {"--pipeline-model-parallel-layout": "Ettt|ttttt|tttt|ttttL"})}
    for split, (v, expected) in cases.items():
        schedule = Schedule.INTERLEAVED_1F1B if v > 1 else Schedule.ONE_F_ONE_B
        d = dataclasses.replace(small.decisions, **base, pp_schedule=schedule, pp_virtual=v, pp_split=split)
        values = flag_values(megatron.pipeline_arguments(d, 16))
        assert {k: values[k] for k in expected} == expected
        assert set(values) - {"--pipeline-model-parallel-size"} == set(expected)


def test_megatron_validation_refuses_a_job_without_its_launch_environment_or_with_a_bad_split(small, tmp_path,
                                                                                              monkeypatch):
    """The checks are Megatron's own and they bite: tensor parallelism without the launch script's
    CUDA_DEVICE_MAX_CONNECTIONS=1, and first/last stages leaving middle stages of unequal size."""
    plan = plan_for(small, "meta-llama/Llama-3.1-405B", 128, seq_len=8192, **LLAMA_405B)
    arguments = megatron.arguments(plan)
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        validate(tmp_path, arguments, world=1024, capability=H100, env={}, monkeypatch=monkeypatch)
    first = arguments.index("--decoder-first-pipeline-num-layers") + 1
    uneven = [*arguments[:first], "5", *arguments[first + 1:]]
    with pytest.raises((AssertionError, ValueError)):
        _, config = validate(tmp_path, uneven, world=1024, capability=H100,
                             env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, monkeypatch=monkeypatch)
        megatron_stage_layers(config, 16, 1)


def test_qwen3_moe_plan_passes_megatron_validation_with_its_expert_width(small, tmp_path, monkeypatch):
    """Qwen3-30B-A3B: 128 experts of width moe_intermediate_size (not the dense intermediate_size), top-8, and
    per-head query/key norms."""
    plan = plan_for(small, "Qwen/Qwen3-30B-A3B", 2, seq_len=4096, engine=Engine.MEGATRON, zero=1, tp=1, pp=2, dp=8,
                    ep=8, micro_batch=1, grad_accum=4, pp_split=(24, 24))
    args, config = megatron_checked(plan, tmp_path, monkeypatch)
    check_megatron_reads(plan, args, config)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size, config.qk_layernorm) == \
        (128, 8, 768, True)
