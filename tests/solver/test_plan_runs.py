"""The plan is what its emitted files run: combinations an engine refuses are never planned (issue 12)."""

from __future__ import annotations

import pytest

from costmodels import Config, Engine, Offload, Optimizer, Workload, parse_cluster
from graphs import FitplanError, resolve
from graphs.lower import lower_resolved
from solver import api
from solver.space import Pins, outer_space


def space_for(model: str, gpus: str, **pins):
    cluster = parse_cluster(gpus)
    graph = lower_resolved(resolve(model))
    return outer_space(graph, cluster, Workload(seq_len=2048, global_batch=cluster.world_size * 4), Pins(**pins))


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
    assert any("torch.compile: off (DeepSpeed ZeRO-3" in line for line in plan.advice), plan.advice
    pinned = api.solve("meta-llama/Llama-3.1-8B", "8xH100", engine="deepspeed", zero=3, compile="on", seq_len=2048,
                       time_limit=20)
    assert pinned.decisions.compile and any("no speed-up is credited" in line for line in pinned.advice)
