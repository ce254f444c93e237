"""Hybrid sharding as the torchrun script runs it (issue 34): the emitted train_fitplan.py puts FSDP2 on a 2-D
(replicate, shard) mesh, trains on four gloo ranks as two replicas of two shards, and each rank holds the parameter
bytes the plan priced (half the model, where plain FSDP2 over four ranks holds a quarter)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from solver import solve
from solver.cli.commands import emit_files
from tests.gloo import torchrun
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

RANKS = 4


def run_script(script: Path, model_dir: Path, report: Path) -> tuple[list[dict], list[float]]:
    """The emitted script under torchrun on RANKS gloo processes for two steps: each rank's report and the losses."""
    done = torchrun(script, "--model", str(model_dir), "--from-config", "--steps", "2", "--report", str(report),
                    ranks=RANKS, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reports = [json.loads((report / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    return reports, [float(x) for x in re.findall(r"loss (\S+)", done.stdout)]


@pytest.mark.distributed
def test_hsdp_plan_runs_as_emitted_and_each_rank_holds_one_replica_groups_shard(tmp_path):
    model_dir = write_config(tmp_path / "tiny-llama", tiny_values("llama"))
    pins = dict(engine="fsdp2", zero=3, tp=1, pp=1, precision=("fp32",), offload="none", param_offload="none")
    plan = solve(str(model_dir), f"{RANKS}xCPU", seq_len=32, global_batch=8, time_limit=5, dp_replicate=2, **pins)
    flat = solve(str(model_dir), f"{RANKS}xCPU", seq_len=32, global_batch=8, time_limit=5, dp_replicate=1, **pins)
    assert (plan.decisions.dp, plan.decisions.dp_replicate) == (RANKS, 2)
    emit_files(plan, "torchrun", tmp_path / "out")
    reports, losses = run_script(tmp_path / "out" / "train_fitplan.py", model_dir, tmp_path / "report")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    held = [r["param_bytes"] for r in reports]
    assert max(held) == plan.estimate.memory.parameters, held
    assert flat.estimate.memory.parameters < plan.estimate.memory.parameters  # a quarter, not a half
