"""Op-level selective activation checkpointing in the emitted torchrun script: the script (which imports nothing
from fitplan) keeps exactly what `graphs.sac`'s policy keeps, the policy the lowering traces and prices."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoModelForCausalLM

from graphs import Checkpoint
from graphs.sac import GPU_EQUIVALENT_OPS, observed_policy, op_sac_policy, save_ops
from solver import solve
from solver.cli.commands import emit_files
from tests.gloo import torchrun
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> tuple[object, object]:
    """The plan (every layer in op-level SAC) and its emitted train_fitplan.py loaded as a module."""
    folder = tmp_path_factory.mktemp("sac")
    model_dir = write_config(folder / "tiny-llama", tiny_values("llama"))
    plan = solve(str(model_dir), "1xCPU", seq_len=32, global_batch=2, time_limit=5, checkpoint="op_selective",
                 launcher="torchrun")
    emit_files(plan, "torchrun", folder / "out")
    path: Path = folder / "out" / "train_fitplan.py"
    assert "fitplan" not in {line.split()[1].split(".")[0] for line in path.read_text().splitlines()
                             if line.startswith(("import ", "from "))}  # self-contained
    spec = importlib.util.spec_from_file_location("train_fitplan_sac", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return plan, module


def test_plan_pinned_to_op_selective_checkpoints_every_layer_that_way(script):
    plan, module = script
    assert set(plan.decisions.checkpoint) == {Checkpoint.OP_SELECTIVE}
    assert module.PLAN["decisions"]["checkpoint"] == ["op_selective"] * 3


def test_script_saves_the_ops_graphs_sac_saves(script):
    # and the CPU flash kernel, which the lowering asks the policy about as the GPU one (GPU_EQUIVALENT_OPS)
    _, module = script
    assert module.sac_save_ops() == save_ops() | set(GPU_EQUIVALENT_OPS)


def _recording(policy, log: list):
    def decide(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        log.append((str(func), ctx.is_recompute, decision))
        return decision
    return decide


def _step(model: torch.nn.Module) -> None:
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def test_script_policy_decides_each_op_as_graphs_sac_does_in_a_real_step(script, monkeypatch):
    # A real forward and backward of the tiny Llama on CPU, checkpointed once by the script's own
    # `apply_checkpointing` and once through transformers with `graphs.sac.op_sac_policy`: the same ops are kept
    # and recomputed (torch 2.13 asks the policy in forward only; the recompute replays its decisions), the CPU
    # flash kernel decided as the GPU one in both.
    _, module = script
    values = dict(tiny_values("llama"))
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    reference = copy.deepcopy(model)
    model.train()
    reference.train()

    emitted: list = []
    original = module.sac_policy
    monkeypatch.setattr(module, "sac_policy", lambda keep: _recording(original(keep), emitted))
    module.apply_checkpointing(model)
    _step(model)

    expected: list = []
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False,
        "context_fn": lambda: create_selective_checkpoint_contexts(
            _recording(observed_policy(op_sac_policy(), None), expected))})
    _step(reference)

    assert emitted == expected
    decisions = {decision.name for _, _, decision in emitted}
    assert decisions == {"MUST_SAVE", "PREFER_RECOMPUTE"}
    assert len([op for op, _, decision in emitted if "mm" in op or "linear" in op]) == 3 * 7  # q k v o gate up down
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_emitted_script_trains_two_ranks_with_op_level_sac(engine, tmp_path):
    # The emitted script as torchrun runs it (2 gloo ranks, random weights): op-SAC layers under DDP and FSDP2.
    model_dir = write_config(tmp_path / "tiny-llama", tiny_values("llama"))
    plan = solve(str(model_dir), "2xCPU", seq_len=32, global_batch=4, time_limit=5, checkpoint="op_selective",
                 launcher="torchrun", engine=engine, offload="none", param_offload="none")
    emit_files(plan, "torchrun", tmp_path / "out")
    done = torchrun(tmp_path / "out" / "train_fitplan.py", "--model", str(model_dir), "--from-config", "--steps",
                    "2", "--report", str(tmp_path / "r"), ranks=2)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    losses = [float(x) for x in re.findall(r"loss (\S+)", done.stdout)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert all(json.loads((tmp_path / "r" / f"rank{rank}.json").read_text()) for rank in range(2))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_check_of_an_op_sac_plan_measures_saved_bytes_equal_to_the_estimate(engine, tmp_path):
    # `fitplan check`: the emitted script counts what SAC keeps (its cache, outside autograd's hooks) beside the
    # saved tensors, on two gloo ranks; the lowering's op-SAC costs must equal it exactly.
    from typer.testing import CliRunner

    from solver.cli.app import app

    model_dir = write_config(tmp_path / "tiny-llama", tiny_values("llama"))
    plan = solve(str(model_dir), "2xCPU", seq_len=64, global_batch=4, time_limit=5, checkpoint="op_selective",
                 engine=engine, offload="none", param_offload="none", tp=1)
    (tmp_path / "plan.json").write_text(plan.dumps())
    result = CliRunner().invoke(app, ["check", str(tmp_path / "plan.json"), "--steps", "2", "--device", "cpu",
                                      "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)["rows"]}
    saved = rows["saved activations (one micro-batch)"]
    assert saved["exact"] and saved["measured"] == saved["estimated"] > 0
