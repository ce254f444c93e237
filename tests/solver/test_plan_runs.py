"""The plan is what its emitted files run: combinations an engine refuses are never planned (issue 12)."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels import Config, Engine, Offload, Optimizer, Precision, Workload, parse_cluster
from graphs import Checkpoint, FitplanError, resolve
from graphs.lowering import lower_resolved
from solver import api
from solver.search.pins import Pins
from solver.search.space import outer_space


def space_for(model: str, gpus: str, **pins):
    cluster = parse_cluster(gpus)
    graph = lower_resolved(resolve(model))
    return outer_space(graph, cluster, Workload(seq_len=2048, global_batch=cluster.world_size * 4), Pins.of(**pins))


def test_deepspeed_stage0_optimizer_offload_is_refused_and_never_planned():
    # DeepSpeed's ZeRO config: offload_optimizer is "Valid for ZeRO stage 1, 2, 3".
    with pytest.raises(ValueError, match="stage 1-3"):
        Config(engine=Engine.DEEPSPEED, zero=0, optimizer_offload=Offload.CPU)
    outers = space_for("meta-llama/Llama-3.1-8B", "1xH200").outers
    assert any(o.engine is Engine.DEEPSPEED and o.zero == 1 and o.optimizer_offload is Offload.CPU for o in outers)
    assert not [o for o in outers if o.engine is Engine.DEEPSPEED and o.zero == 0
                and o.optimizer_offload is not Offload.NONE]
    with pytest.raises(FitplanError, match="stage 1-3"):
        api.estimate("meta-llama/Llama-3.1-8B", "1xH200",
                     {"engine": "deepspeed", "zero": 0, "optimizer_offload": "cpu"}, seq_len=512)


def test_8bit_adamw_under_deepspeed_optimizer_offload_is_refused_and_never_planned():
    with pytest.raises(ValueError, match="fp32 CPU Adam"):
        Config(engine=Engine.DEEPSPEED, zero=2, optimizer_offload=Offload.CPU, optimizer=Optimizer.ADAMW_8BIT)
    Config(engine=Engine.DEEPSPEED, zero=2, optimizer=Optimizer.ADAMW_8BIT)  # without offload it runs
    outers = space_for("meta-llama/Llama-3.1-8B", "1xH200", optimizers=(Optimizer.ADAMW, Optimizer.ADAMW_8BIT)).outers
    assert any(o.optimizer is Optimizer.ADAMW_8BIT and o.engine is Engine.DEEPSPEED for o in outers)
    assert any(o.optimizer is Optimizer.ADAMW and o.engine is Engine.DEEPSPEED and o.optimizer_offload is Offload.CPU
               for o in outers)
    assert not [o for o in outers if o.optimizer is Optimizer.ADAMW_8BIT and o.engine is Engine.DEEPSPEED
                and o.optimizer_offload is not Offload.NONE]


@pytest.mark.compile_search  # the space and advice of an unpinned --compile
def test_compile_is_not_credited_inside_deepspeed_zero3():
    from costmodels.compilation import COMPILED_MEMORY_BOUND_SPEEDUP, memory_bound_speedup

    z3 = Config(engine=Engine.DEEPSPEED, zero=3, compile=True)
    assert memory_bound_speedup(z3) == 1.0
    assert memory_bound_speedup(Config(engine=Engine.FSDP2, zero=3, compile=True)) == COMPILED_MEMORY_BOUND_SPEEDUP
    outers = space_for("meta-llama/Llama-3.1-8B", "8xH100").outers
    assert not [o for o in outers if o.engine is Engine.DEEPSPEED and o.zero == 3 and o.compile]
    assert all(o.compile for o in outers if o.engine is Engine.FSDP2)
    plan = api.solve("meta-llama/Llama-3.1-8B", "8xH100", engine="deepspeed", zero=3, seq_len=2048, time_limit=20)
    assert not plan.decisions.compile
    assert any("torch.compile: off (DeepSpeed 0.19 runs a compiled model only at ZeRO stage(s) 0, 1, 2 (zero=3"
               in line for line in plan.advice), plan.advice
    pinned = api.solve("meta-llama/Llama-3.1-8B", "8xH100", engine="deepspeed", zero=3, compile="on", seq_len=2048,
                       time_limit=20)
    assert pinned.decisions.compile and any("no speed-up is credited" in line for line in pinned.advice)


def test_every_outer_in_the_space_has_a_launcher_that_runs_it():
    from solver.plan.capability import runnable_by

    for gpus, pins in (("8xH100", {}), ("1xH200", {"precision": ("bf16-mixed", "fp8")}),
                       ("2x8xH100", {"precision": ("bf16", "fp8")})):
        space = space_for("meta-llama/Llama-3.1-8B", gpus, **pins)
        assert space.outers
        for outer in space.outers:
            assert runnable_by(outer), outer
            # selective recompute only where torchrun (per layer) or Megatron (all layers) runs the outer
            if outer.selective:
                assert "torchrun" in runnable_by(outer)


def test_outer_only_one_policy_launchers_run_takes_one_mode_for_every_layer():
    # fp8 with tp=2 runs under torchtitan alone (one activation-checkpoint policy for every layer): the search
    # used to mix full and no recompute there, and the plan then had no launcher (issue 35 item 2, Llama-3.1-405B
    # on 64x8 H100 with fp8: "No launcher runs the chosen configuration ... fitplan bug").
    from solver.plan.capability import runnable_by

    pins = {"tp": 2, "pp": 1, "cp": 1, "engine": Engine.FSDP2, "precision": (Precision.FP8,)}
    outers = space_for("meta-llama/Llama-3.1-8B", "8xH100", **pins).outers
    assert outers and all(o.uniform is not None for o in outers)
    assert {o.uniform for o in outers} >= {Checkpoint.NONE, Checkpoint.FULL}
    for outer in outers:
        layers = 32
        assert [m for m in Checkpoint if outer.runs(m)] == [outer.uniform]
        assert runnable_by(outer.config((outer.uniform,) * layers), checkpoint=(outer.uniform,) * layers)
    plan = api.solve("meta-llama/Llama-3.1-8B", "8xH100", seq_len=16384, global_batch=8, time_limit=20,
                     **{k: v for k, v in pins.items() if k != "precision"}, precision=("fp8",))
    assert plan.launchers == ("torchtitan",) and len(set(plan.decisions.checkpoint)) == 1, plan.decisions.summary()


def test_deepspeed_zero_stages_are_searched_on_one_gpu_only_where_they_offload():
    # Issue 35 item 14: on one GPU a ZeRO stage shards nothing; only its offload (ZeRO-Offload) can help there.
    def deepspeed(gpus: str, **pins) -> list:
        return [o for o in space_for("meta-llama/Llama-3.1-8B", gpus, **pins).outers if o.engine is Engine.DEEPSPEED]

    one = deepspeed("1xH200")
    assert any(o.zero == 0 for o in one) and any(o.zero > 0 for o in one)
    assert all(Offload.CPU in (o.optimizer_offload, o.param_offload) for o in one if o.zero > 0)
    assert any(o.zero == 2 and o.optimizer_offload is Offload.NONE for o in deepspeed("1xH200", zero=2))  # pinned
    assert any(o.zero == 2 and o.optimizer_offload is Offload.NONE for o in deepspeed("8xH100"))  # it shards


def test_fsdp2_under_a_pipeline_runs_at_zero_2_as_help_and_plan_say():
    # Issue 35 item 8: the rule (engines' pipeline_stages) was said by `estimate` alone.
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from solver.cli.app import app
    from solver.plan.advice import _zero

    with pytest.raises(ValueError, match="zero=2"):
        Config(engine=Engine.FSDP2, zero=3, pp=2, dp=4, grad_accum=2)
    shown = CliRunner().invoke(app, ["solve", "--help"], env={"COLUMNS": "400"})
    flat = " ".join(shown.output.replace("│", " ").split())  # rich's panel borders and wrapping aside
    assert "with pipeline parallelism, --pp > 1, FSDP2 runs at 2 only" in flat
    line = _zero(Config(engine=Engine.FSDP2, zero=2, pp=2, dp=4, grad_accum=2),
                 SimpleNamespace(memory=SimpleNamespace(device_peak=0)))
    assert "with pipeline parallelism fsdp2 runs at zero=2 only" in line
    assert "pipeline" not in _zero(Config(engine=Engine.FSDP2, zero=3, dp=8), SimpleNamespace(
        memory=SimpleNamespace(device_peak=0)))


def test_selective_recompute_is_never_planned_where_no_launcher_runs_it():
    # With eager attention selective recompute pays off, but DeepSpeed plans run under DeepSpeed/HF/accelerate,
    # which checkpoint whole layers only: the search used to pick "full 1/sel 10" here, which nothing runs.
    plan = api.solve("meta-llama/Llama-3.2-1B", "1xT4", engine="deepspeed", seq_len=2048, attention="eager",
                     time_limit=20)
    assert Checkpoint.SELECTIVE not in plan.decisions.checkpoint
    assert Checkpoint.FULL in plan.decisions.checkpoint
    assert set(plan.launchers) == {"deepspeed", "hf", "accelerate"}
    # FSDP2 runs under torchrun, which recomputes selectively per layer: selective stays available there.
    outers = space_for("meta-llama/Llama-3.2-1B", "1xT4", engine=Engine.FSDP2).outers
    assert outers and all(o.selective for o in outers)


GPT2 = {"seq_len": 512, "global_batch": 64, "time_limit": 5}


def test_fp8_is_planned_only_with_a_launcher_that_runs_it():
    from solver.plan.capability import unsupported

    # DeepSpeed has no fp8 config field: no launcher runs its fp8 plans; Megatron's (Transformer Engine) run fp8.
    plan = api.solve("gpt2", "8xH100", launcher="megatron", precision=("fp8",), **GPT2)
    assert plan.launchers == ("megatron",) and plan.decisions.precision is Precision.FP8, plan.launchers
    deepspeed = dataclasses.replace(plan.decisions, engine=Engine.DEEPSPEED, zero=1)
    for launcher in ("deepspeed", "hf", "accelerate"):
        assert any("fp8 with DeepSpeed" in p or "fp8 (TrainingArguments" in p
                   for p in unsupported(launcher, deepspeed)), launcher
    for pins in ({"launcher": "deepspeed"}, {"engine": "deepspeed"}):
        with pytest.raises(FitplanError):
            api.solve("gpt2", "8xH100", precision=("fp8",), **pins, **GPT2)
    # FSDP2 runs fp8 through torchao float8 under torchrun and accelerate (not through TrainingArguments).
    fsdp = api.solve("gpt2", "8xH100", engine="fsdp2", tp=1, precision=("fp8",), **GPT2)
    assert set(fsdp.launchers) == {"torchrun", "accelerate"}, fsdp.launchers


def test_accelerate_fp8_config_names_the_torchao_backend_and_launch_refuses_without_it(tmp_path):
    import subprocess
    import sys

    from accelerate.commands.config.config_args import load_config_from_file

    from solver.cli.commands import emit_files

    plan = api.solve("gpt2", "8xH100", engine="fsdp2", tp=1, precision=("fp8",), **GPT2)
    emit_files(plan, "accelerate", tmp_path)
    loaded = load_config_from_file(str(tmp_path / "accelerate_config.yaml"))
    assert str(loaded.mixed_precision) == "fp8"
    assert loaded.fp8_config == {"backend": "AO"}
    from accelerate.utils.dataclasses import FP8BackendType

    assert FP8BackendType(loaded.fp8_config["backend"]) is FP8BackendType.AO
    (tmp_path / "train.py").write_text("print('trained')\n")
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(tmp_path / "accelerate_config.yaml"), str(tmp_path / "train.py")],
                          capture_output=True, text=True, timeout=120, check=False)
    has_backend = any(__import__("importlib").util.find_spec(m) for m in ("torchao", "transformer_engine", "msamp"))
    if not has_backend:  # never a silent bf16 run
        assert done.returncode != 0 and "FP8 is not available" in done.stderr and "trained" not in done.stdout


def test_torchrun_script_runs_fp8_through_torchao_or_stops(tmp_path):
    import importlib.util
    import subprocess
    import sys

    from solver.cli.commands import emit_files
    from tests.graphs.reference import write_config
    from tests.graphs.tiny_configs import tiny_values

    model_dir = write_config(tmp_path / "tiny", tiny_values("llama"))
    plan = api.solve(str(model_dir), "1xH100", engine="ddp", precision=("fp8",), seq_len=64, global_batch=2,
                     time_limit=5)
    assert plan.decisions.precision.value == "fp8" and "torchrun" in plan.launchers
    emit_files(plan, "torchrun", tmp_path / "out")
    script = (tmp_path / "out" / "train_fitplan.py").read_text()
    assert "convert_to_float8_training" in script
    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed: the script converts instead of stopping (fp8 matmuls need a GPU)")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(tmp_path / "out" / "train_fitplan.py"), "--model", str(model_dir), "--from-config",
                           "--steps", "1"], capture_output=True, text=True, timeout=240, check=False, env=env)
    assert done.returncode != 0
    assert "fp8 through torchao float8, which is not importable" in done.stdout + done.stderr
    assert "step 1" not in done.stdout  # it never trained in bf16 instead


def test_lora_with_tensor_parallelism_is_priced_but_never_planned():
    # The cost model splits adapters as PEFT's LoraParallelLinear does; no emitted launcher runs that split.
    from graphs import LoraSpec

    cluster = parse_cluster("8xH100")
    graph = lower_resolved(resolve("meta-llama/Llama-3.2-1B"), lora=LoraSpec(rank=16))
    assert 8 in graph.tp_degrees  # measured, so `estimate` prices it
    space = outer_space(graph, cluster, Workload(seq_len=2048, global_batch=32), Pins())
    assert space.outers and all(o.tp == 1 for o in space.outers)
    with pytest.raises(FitplanError):
        api.solve("meta-llama/Llama-3.2-1B", "8xH100", seq_len=2048, global_batch=32, lora=LoraSpec(rank=16), tp=8)
