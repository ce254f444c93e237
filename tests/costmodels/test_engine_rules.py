"""Each engine's rules value (costmodels/engines, issue 12) against what the runtimes themselves do: the sharding of
each ZeRO stage against DeepSpeed's own stage classes and FSDP2's `fully_shard`, the compile and offload stages
against the configurations fitplan accepts, and every refusal a `Config` raises comes from its engine's rules."""

from __future__ import annotations

import ast
import importlib
import itertools
from pathlib import Path

import pytest
import torch

from costmodels import Config, Engine, Offload
from costmodels.engines import RULES, rules_of
from costmodels.zero import dp_traffic
from graphs.megatron import one_rank_group


def test_every_engine_has_rules_in_a_module_of_its_own():
    assert set(RULES) == set(Engine)
    for engine, rules in RULES.items():
        assert importlib.import_module(f"costmodels.engines.{engine.value}").RULES is rules
        assert rules.engine is engine


def test_deepspeed_stages_shard_what_deepspeeds_stage_classes_partition():
    """DeepSpeed 0.19: stage 1 and 2 share DeepSpeedZeroOptimizer (partition_gradients only from stage 2),
    stage 3 is DeepSpeedZeroOptimizer_Stage3 (parameters partitioned too)."""
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    stages = zero_config.ZeroStageEnum
    rules = rules_of(Engine.DEEPSPEED)
    assert rules.sharded(stages.disabled) == (False, False, False)
    assert rules.sharded(stages.optimizer_states) == (False, False, True)
    assert rules.sharded(stages.gradients) == (False, True, True)
    assert rules.sharded(stages.weights) == (True, True, True)
    assert rules.reshards(stages.weights) and not rules.per_tensor_dim_shards


def test_fsdp2_shards_each_parameter_on_dim_zero_at_both_settings():
    """`fully_shard` turns every parameter into a DTensor sharded on dim 0 over the mesh, whether or not it
    reshards after forward (one rank on the fake backend stands in for the mesh: `graphs.megatron.one_rank_group`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    rules = rules_of(Engine.FSDP2)
    owned = not dist.is_initialized()
    if owned:
        one_rank_group()
    try:
        mesh = init_device_mesh("cpu", (1,))
        for stage in rules.stages:
            model = torch.nn.Linear(4, 4)
            fully_shard(model, mesh=mesh, reshard_after_forward=rules.reshards(stage))
            assert all(p.placements == (Shard(0),) for p in model.parameters())
            assert rules.sharded(stage) == (True, True, True) and rules.per_tensor_dim_shards
    finally:
        if owned:
            dist.destroy_process_group()


def test_traffic_follows_what_each_stage_shards():
    for rules, stage in ((r, s) for r in RULES.values() for s in r.stages):
        config = Config(engine=rules.engine, zero=stage, dp=4)
        traffic = dp_traffic(config, param_bytes=10, grad_bytes=7)
        params, grads, _ = rules.sharded(stage)
        assert (traffic.forward_gather == 10) == params
        assert (traffic.backward_gather == 10) == (params and rules.reshards(stage))
        assert (traffic.backward_reduce == 7) == (params or (grads and not rules.reduces_once_per_step))
        assert (traffic.step_reduce == 7) == (grads and not params and rules.reduces_once_per_step)
        assert (traffic.step_allreduce == 7) == (not params and not grads)
        assert dp_traffic(Config(engine=rules.engine, zero=stage, dp=1), param_bytes=10, grad_bytes=7) == \
            type(traffic)()


@pytest.mark.parametrize("engine", list(Engine))
def test_every_config_refusal_of_stage_and_offload_is_its_engines_rule(engine):
    rules = rules_of(engine)
    for stage, opt, param in itertools.product(range(4), list(Offload), list(Offload)):
        problems = rules.refusals(stage, optimizer_offload=opt.value, param_offload=param.value)
        try:
            Config(engine=engine, zero=stage, optimizer_offload=opt, param_offload=param)
        except ValueError as refusal:
            assert problems and str(refusal) == problems[0], (stage, opt, param)
        else:
            assert problems == [], (stage, opt, param)


def test_cost_modules_ask_the_engines_rules_instead_of_naming_an_engine():
    """Outside costmodels/engines/ no cost module names a particular engine (`Engine.DDP`, ...) except as the
    knob's default in config.py: the engines' differences live in their rules."""
    root = Path(__file__).resolve().parents[2] / "costmodels"
    named = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Engine":
                named.append(f"{path.name}:{node.lineno} Engine.{node.attr}")
    assert named == ["config.py:" + str(_default_line(root / "config.py")) + " Engine.DDP"]


def _default_line(path: Path) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line.rstrip().endswith(
        "= Engine.DDP"))


@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit", "PagedAdamW32bit"])
def test_bitsandbytes_optimizers_step_only_where_the_engine_says(name):
    """bitsandbytes 0.50's optimizers (its CPU kernels here) step plain parameters and fail on FSDP2's DTensor
    shards; every engine's `bnb_optimizers` agrees, and Config refuses the ones that fail."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    bnb = pytest.importorskip("bitsandbytes")
    from costmodels import Optimizer

    def steps(model: torch.nn.Module) -> bool:
        optimizer = getattr(bnb.optim, name)(model.parameters(), lr=1e-3)
        model(torch.randn(2, 64)).sum().backward()
        try:
            optimizer.step()
        except (RuntimeError, NotImplementedError):
            return False
        return True

    def model() -> torch.nn.Module:  # one tensor above bitsandbytes' 4096-element minimum for 8-bit states
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))

    owned = not dist.is_initialized()
    if owned:
        one_rank_group()
    try:
        sharded = model()
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        runs = {Engine.FSDP2: steps(sharded), Engine.DDP: steps(model())}
    finally:
        if owned:
            dist.destroy_process_group()
    optimizer = {"AdamW8bit": Optimizer.ADAMW_8BIT, "PagedAdamW8bit": Optimizer.PAGED_ADAMW_8BIT,
                 "PagedAdamW32bit": Optimizer.PAGED_ADAMW_32BIT}[name]
    assert runs == {Engine.FSDP2: False, Engine.DDP: True}
    for engine, ran in runs.items():
        assert rules_of(engine).bnb_optimizers is ran
        zero = rules_of(engine).stages[-1]
        if ran:
            Config(engine=engine, zero=zero, optimizer=optimizer)
        else:
            with pytest.raises(ValueError, match="bitsandbytes"):
                Config(engine=engine, zero=zero, optimizer=optimizer)
