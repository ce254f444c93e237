"""The runtime is part of the lowering: a plan for the torchtitan launcher is priced on torchtitan's own model code,
op-level SAC is traced (and searched) only where an allowed launcher runs it, and a pinned mode no allowed launcher
runs is refused with the names of those that do."""

from __future__ import annotations

import json
import sys

import pytest
import tomllib
from typer.testing import CliRunner

from costmodels import Workload, parse_cluster
from costmodels import estimate as estimate_config
from graphs import Checkpoint, FitplanError, resolve
from graphs.lowering import lower_resolved
from solver import solve
from solver.cli.app import app
from solver.plan.capability import LAUNCHERS
from solver.plan.launchers import torchtitan
from solver.search.pins import Pins
from solver.search.request import Request
from solver.search.solve import runtime_route

LLAMA_8B = ["--model", "meta-llama/Llama-3.1-8B", "--gpus", "8xH100", "--seq-len", "8192", "--global-batch", "16"]


@pytest.fixture(scope="module")
def titan_plan() -> dict:
    pytest.importorskip("torchtitan")
    result = CliRunner().invoke(app, ["solve", *LLAMA_8B, "--launcher", "torchtitan", "--checkpoint", "op_selective",
                                      "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_torchtitan_llama_8b_at_8192_tokens_with_op_sac_fits(titan_plan):
    # torchtitan's published llama3_8b recipe: 8 H100s, 8192 tokens, op-level SAC (issue 10: fitplan refused it)
    d = titan_plan["decisions"]
    assert d["checkpoint"] == ["op_selective"] * 32
    assert titan_plan["launchers"] == ["torchtitan"]  # the others run the HF code, which this plan did not price
    memory = titan_plan["estimate"]["memory"]
    assert memory["device_peak"] <= titan_plan["inputs"]["cluster"]["gpu_memory_bytes"]


def test_torchtitan_plan_is_priced_on_torchtitans_own_model(titan_plan):
    # The plan's estimate equals a fresh estimate over the torchtitan lowering, and differs from the HF one.
    from graphs.titan import lower_titan_resolved
    from solver.api import config_from
    from solver.search.route import TITAN_LOSSES

    d = titan_plan["decisions"]
    knobs = {k: d[k] for k in ("tp", "dp", "engine", "zero", "micro_batch", "grad_accum", "precision", "optimizer",
                               "optimizer_offload", "param_offload", "compile", "sequence_parallel", "loss",
                               "pp", "pp_schedule", "pp_virtual", "pp_split")}
    config = config_from({**knobs, "checkpoint": "op_selective"}, layers=32)
    cluster, workload = parse_cluster("8xH100"), Workload(seq_len=8192, global_batch=16)
    resolved = resolve("meta-llama/Llama-3.1-8B")
    # the loss the plan chose among torchtitan's two (issue 37: its ChunkedLossWrapper or plain cross-entropy)
    titan = estimate_config(lower_titan_resolved(resolved, dtype="bfloat16", loss=TITAN_LOSSES[config.loss]), cluster,
                            workload, config)
    hf = estimate_config(lower_resolved(resolved, dtype="bfloat16", op_selective=True), cluster, workload, config)
    assert titan.memory.allocated_peak == titan_plan["estimate"]["memory"]["allocated_peak"]
    assert hf.memory.allocated_peak != titan.memory.allocated_peak


def test_emitted_torchtitan_job_runs_selective_ac_as_torchtitan_parses_it(tmp_path, monkeypatch):
    pytest.importorskip("torchtitan")
    result = CliRunner().invoke(app, ["solve", *LLAMA_8B, "--launcher", "torchtitan", "--checkpoint", "op_selective",
                                      "--emit", "torchtitan", "--emit-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.stderr
    job = tomllib.loads((tmp_path / torchtitan.JOB_FILE).read_text())
    assert job["activation_checkpoint"]["mode"] == "selective"
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, torchtitan.MODULE, raising=False)
    config = ConfigManager().parse_args(["--module", torchtitan.MODULE, "--config", torchtitan.CONFIG])
    monkeypatch.delitem(sys.modules, torchtitan.MODULE, raising=False)
    assert type(config.activation_checkpoint) is SelectiveAC.Config  # torchtitan's op-level SAC


@pytest.mark.parametrize("launcher", ["hf", "accelerate", "deepspeed", "megatron"])
def test_op_selective_with_a_launcher_that_cannot_run_it_names_those_that_can(launcher):
    with pytest.raises(FitplanError) as caught:
        solve("meta-llama/Llama-3.2-1B", "8xH100", seq_len=2048, global_batch=64, time_limit=5,
              checkpoint="op_selective", launcher=launcher)
    assert f"The {launcher} launcher cannot run op-level selective checkpointing" in caught.value.message
    assert "torchrun" in caught.value.hint and "torchtitan" in caught.value.hint


def test_cli_op_selective_with_hf_exits_2_naming_the_launchers_that_can():
    result = CliRunner().invoke(app, ["solve", "--model", "meta-llama/Llama-3.2-1B", "--gpus", "8xH100",
                                      "--launcher", "hf", "--checkpoint", "op_selective", "--json"])
    assert result.exit_code == 2
    assert "torchrun, torchtitan" in result.stderr and "Traceback" not in result.stderr


def test_gpt2_pinned_to_op_selective_plans_it_on_every_layer_for_torchrun():
    # Before: "min() arg is an empty sequence" (the default lowering had no op-SAC costs).
    plan = solve("gpt2", "1xA100", time_limit=10, checkpoint="op_selective")
    assert set(plan.decisions.checkpoint) == {Checkpoint.OP_SELECTIVE}
    assert plan.launchers == ("torchrun",)  # gpt2 is no torchtitan flavour; the HF stacks checkpoint whole layers


@pytest.mark.parametrize(("pins", "expected"), [
    (Pins.of(), {"op_selective": True, "titan": False}),  # the torchrun script runs it per layer
    (Pins.of(launcher="hf"), {"op_selective": False, "titan": False}),
    (Pins.of(launcher="deepspeed"), {"op_selective": False, "titan": False}),
    (Pins.of(checkpoint="full"), {"op_selective": False, "titan": False}),
    (Pins.of(launcher="torchrun", checkpoint="op_selective"), {"op_selective": True, "titan": False}),
    (Pins.of(launcher="torchtitan", checkpoint="op_selective"), {"op_selective": False, "titan": True}),
])
def test_op_sac_is_traced_only_where_an_allowed_launcher_runs_it(pins, expected):
    request = Request(resolved=resolve("gpt2"), cluster=parse_cluster("1xA100"),
                      workload=Workload(seq_len=128, global_batch=1), gpus="1xA100")
    route = runtime_route(request, pins, LAUNCHERS)
    assert {"op_selective": route.op_selective, "titan": route.titan} == expected


def test_lowering_cache_keeps_op_sac_and_plain_graphs_apart():
    # Both lowerings are cached on disk; a key without op_selective would hand one the other's graph.
    resolved = resolve("gpt2")
    plain = lower_resolved(resolved, dtype="bfloat16")
    traced = lower_resolved(resolved, dtype="bfloat16", op_selective=True)
    assert Checkpoint.OP_SELECTIVE not in plain.checkpoint_modes()
    assert Checkpoint.OP_SELECTIVE in traced.checkpoint_modes()
    assert {m for m, _ in traced.decoder_layers()[0].modes} - {m for m, _ in plain.decoder_layers()[0].modes} == \
        {Checkpoint.OP_SELECTIVE}


def test_torchtitan_without_a_mode_pinned_plans_the_fastest_whole_model_mode():
    # torchtitan applies one policy to every layer: with no --checkpoint the plan is the fastest of the modes it
    # runs, each searched with that mode pinned (the reference: the three pinned solves).
    pytest.importorskip("torchtitan")
    args = ("meta-llama/Llama-3.1-8B", "8xH100")
    common = {"seq_len": 8192, "global_batch": 16, "launcher": "torchtitan"}
    plan = solve(*args, **common, time_limit=30)
    pinned = {mode: solve(*args, **common, time_limit=10, checkpoint=mode.value)
              for mode in (Checkpoint.NONE, Checkpoint.OP_SELECTIVE, Checkpoint.FULL)}
    fastest = min(pinned, key=lambda mode: pinned[mode].estimate.time.step_time)
    assert set(plan.decisions.checkpoint) == {fastest}
    assert plan.estimate.time.step_time == pytest.approx(pinned[fastest].estimate.time.step_time, rel=1e-12)
    assert "checkpoint" not in plan.inputs.pins and plan.launchers == ("torchtitan",)


@pytest.mark.parametrize("launcher", ["torchrun", "hf"])
def test_a_plan_priced_on_torchtitans_code_is_refused_by_launchers_running_hf_code(launcher):
    pytest.importorskip("torchtitan")
    from solver.plan.launchers import emit

    plan = solve("meta-llama/Llama-3.2-1B", "8xH100", seq_len=2048, global_batch=64, time_limit=5,
                 launcher="torchtitan", checkpoint="full")
    assert plan.launchers == ("torchtitan",)
    with pytest.raises(FitplanError) as caught:
        emit(plan, launcher)
    assert "torchtitan's model code" in caught.value.message


def test_estimate_of_a_torchtitan_plan_json_gives_the_plans_own_estimate(tmp_path):
    # `fitplan estimate --config plan.json` prices the decisions on the code the plan was priced on.
    pytest.importorskip("torchtitan")
    plan_path = tmp_path / "plan.json"
    solved = CliRunner().invoke(app, ["solve", *LLAMA_8B, "--launcher", "torchtitan", "--checkpoint", "op_selective",
                                      "--json", "-o", str(plan_path)])
    assert solved.exit_code == 0, solved.stderr
    result = CliRunner().invoke(app, ["estimate", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8xH100",
                                      "--config", str(plan_path), "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    plan = json.loads(plan_path.read_text())
    not_in_plan = ("fits", "device_capacity_bytes", "verdict", "log")
    assert {k: v for k, v in data.items() if k not in not_in_plan} == plan["estimate"]


MEGATRON_1B = ("meta-llama/Llama-3.2-1B", "8xH100")


@pytest.fixture(scope="module")
def megatron_plan():
    pytest.importorskip("megatron.core")
    return solve(*MEGATRON_1B, seq_len=2048, global_batch=64, time_limit=20, launcher="megatron")


def test_megatron_plan_is_priced_on_megatron_cores_layers_with_transformer_engines_kernels(megatron_plan):
    # Megatron's engine runs megatron-core's GPT layers with TE's flash attention and fused SwiGLU/RoPE (Megatron-LM's
    # defaults; the launcher emits no --transformer-impl local): the plan's estimate is that lowering's, not HF's.
    from graphs.megatron import TE_ATTENTION, lower_megatron_resolved
    from solver.hardware.check import plan_config

    plan = megatron_plan
    assert plan.decisions.attention == TE_ATTENTION and plan.launchers == ("megatron",)
    config = plan_config(plan)
    cluster, workload = parse_cluster(MEGATRON_1B[1]), Workload(seq_len=2048, global_batch=64)
    resolved = resolve(MEGATRON_1B[0])
    megatron = estimate_config(lower_megatron_resolved(resolved, dtype="bfloat16", kernels="te"), cluster, workload,
                               config)
    hf = estimate_config(lower_resolved(resolved, dtype="bfloat16"), cluster, workload, config)
    assert megatron.memory.allocated_peak == plan.estimate.memory.allocated_peak
    assert megatron.time.step_time == pytest.approx(plan.estimate.time.step_time, rel=1e-12)
    assert hf.memory.allocated_peak != megatron.memory.allocated_peak
    assert any("megatron-core's GPT layers" in note for note in plan.estimate.notes)


def test_estimate_of_a_megatron_plan_json_gives_the_plans_own_estimate(megatron_plan, tmp_path):
    # `fitplan estimate` and `solve` price the same decisions on the same code, so they give one verdict.
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(megatron_plan.to_json()))
    result = CliRunner().invoke(app, ["estimate", "--model", MEGATRON_1B[0], "--gpus", MEGATRON_1B[1],
                                      "--config", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    plan = json.loads(path.read_text())
    not_in_plan = ("fits", "device_capacity_bytes", "verdict", "log")
    assert {k: v for k, v in data.items() if k not in not_in_plan} == plan["estimate"]


def test_megatron_engine_estimate_without_a_plan_uses_the_megatron_lowering_too(megatron_plan):
    from solver.api import estimate

    d = megatron_plan.decisions
    knobs = {k: getattr(d, k) for k in ("tp", "dp", "pp", "engine", "zero", "micro_batch", "grad_accum", "precision",
                                        "optimizer", "sequence_parallel")}
    modes = [mode.value for mode in d.checkpoint]
    got = estimate(*MEGATRON_1B, {**knobs, "checkpoint": modes}, seq_len=2048, global_batch=64)
    assert got.memory.allocated_peak == megatron_plan.estimate.memory.allocated_peak
    assert any("megatron-core's GPT layers" in note for note in got.notes)


@pytest.mark.parametrize(("model", "lora", "attention", "expected"), [
    ("meta-llama/Llama-3.1-8B", None, None, True),
    ("Qwen/Qwen2.5-7B", None, None, True),
    ("meta-llama/Llama-3.1-8B", "lora", None, False),  # Megatron runs no PEFT adapters
    ("meta-llama/Llama-3.1-8B", None, "eager", False),  # a pinned HF attention is the HF code's
    ("mistralai/Mixtral-8x7B-v0.1", None, None, True),  # MoE layers through megatron_moe
    ("Qwen/Qwen3-30B-A3B", None, None, True),
    ("mistralai/Mistral-7B-v0.1", None, None, False),  # a sliding window: megatron's window_size is not set
    ("google/gemma-2-2b", None, None, False),
])
def test_which_models_megatron_prices_on_its_own_layers(model, lora, attention, expected):
    pytest.importorskip("megatron.core")
    from graphs import LoraSpec
    from solver.search.route import Route

    spec = LoraSpec(rank=8) if lora else None
    assert Route(resolved=resolve(model), lora=spec, attention=attention).megatron_lowers() is expected


def test_te_attention_without_megatrons_engine_is_refused_clearly():
    from solver.api import estimate

    with pytest.raises(FitplanError, match="only Megatron's engine runs"):
        estimate(*MEGATRON_1B, {"engine": "fsdp2", "zero": 3, "micro_batch": 1}, seq_len=2048, attention="te-flash")


def test_a_config_megatron_core_cannot_build_is_priced_on_the_hf_code(monkeypatch):
    # A Llama-type config the megatron-core lowering refuses (UnsupportedModel) still plans, on the HF lowering.
    pytest.importorskip("megatron.core")
    import graphs.variant
    from graphs import UnsupportedModel

    lower = graphs.variant._lower

    def refuse_megatron(resolved, variant):  # cached or not (the route reads the cache before lowering)
        if variant.runtime == "megatron":
            raise UnsupportedModel("not buildable", "")
        return lower(resolved, variant)

    monkeypatch.setattr(graphs.variant, "_lower", refuse_megatron)
    plan = solve(*MEGATRON_1B, seq_len=2048, global_batch=64, time_limit=20, launcher="megatron")
    assert plan.decisions.engine.value == "megatron" and plan.decisions.attention == "sdpa"
    assert not any("megatron-core's GPT layers" in note for note in plan.estimate.notes)


def test_the_plan_says_what_selective_recompute_would_free_under_te_flash_attention(megatron_plan):
    # Megatron's selective recompute checkpoints the attention core; with TE's flash attention that keeps no scores,
    # so it frees almost nothing (the issue: "worth nothing with flash attention, which the plan must say").
    from costmodels.activations import evaluate
    from graphs.megatron import lower_megatron_resolved

    d = megatron_plan.decisions
    assert Checkpoint.SELECTIVE not in d.checkpoint
    layer = lower_megatron_resolved(resolve(MEGATRON_1B[0]), dtype="bfloat16", kernels="te").decoder_layers()[0]
    shape = {"b": d.micro_batch, "s": 2048 // d.cp, "tp": d.tp, "sequence_parallel": d.sequence_parallel}
    kept = evaluate(layer.cost(Checkpoint.NONE).saved, **shape)
    freed = kept - evaluate(layer.cost(Checkpoint.SELECTIVE).saved, **shape)
    assert 0 < freed < kept / 20
    line = next(a for a in megatron_plan.advice if a.startswith("gradient checkpointing"))
    assert f"would free {freed / 2**20:,.0f} MiB of a layer's {kept / 2**20:,.0f} MiB here (te-flash" in line
