"""`fitplan check`: a 2-process gloo run of a tiny Llama plan from its own emitted torchrun script, measured
against the plan's estimate; on CPU the state and saved-activation bytes must be equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from solver import solve
from solver.cli.app import app
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

runner = CliRunner()
BYTES = ("parameters", "gradients", "optimizer states", "saved activations (one micro-batch)")


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """engine -> plan.json of the tiny Llama on two CPU ranks (FSDP2 with full checkpointing, DDP without)."""
    model = write_config(tmp_path_factory.mktemp("tiny-llama"), tiny_values("llama"))
    folder = tmp_path_factory.mktemp("plans")
    result = {}
    for engine, checkpoint in (("fsdp2", "full"), ("ddp", "none")):
        plan = solve(str(model), "2xCPU", seq_len=64, global_batch=4, time_limit=5, engine=engine,
                     checkpoint=checkpoint, offload="none", param_offload="none", tp=1)
        result[engine] = folder / f"{engine}.json"
        result[engine].write_text(plan.dumps())
    # FSDP2's CPUOffloadPolicy: the states live on the host, where check must count them (issue 38 item 11)
    plan = solve(str(model), "2xCPU", seq_len=64, global_batch=4, time_limit=5, engine="fsdp2", checkpoint="full",
                 offload="cpu", param_offload="cpu", tp=1)
    result["fsdp2-offload"] = folder / "fsdp2-offload.json"
    result["fsdp2-offload"].write_text(plan.dumps())
    return result


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_check_on_two_gloo_ranks_measures_bytes_equal_to_the_estimate(engine, plans):
    result = runner.invoke(app, ["check", str(plans[engine]), "--steps", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {row["name"]: row for row in report["rows"]}
    assert (report["ranks"], report["device"]) == (2, "cpu")
    for name in BYTES:  # exact: the run is the reference, and both count whole tensors
        assert rows[name]["exact"] and rows[name]["measured"] == rows[name]["estimated"] > 0, name
    assert report["exact_ok"]
    assert rows["step time"]["measured"] > 0
    assert "peak allocated" not in rows  # a CUDA-only measurement


@pytest.mark.slow
@pytest.mark.distributed
def test_check_of_an_offloading_plan_compares_the_states_on_the_host(plans):
    result = runner.invoke(app, ["check", str(plans["fsdp2-offload"]), "--steps", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)["rows"]}
    for name in ("parameters (on the host)", "gradients (on the host)", "optimizer states (on the host)"):
        assert rows[name]["exact"] and rows[name]["measured"] == rows[name]["estimated"] > 0, name


def test_check_that_reports_a_difference_exits_5_after_printing_it(plans, monkeypatch):
    import solver.hardware.check as check

    differing = check.CheckReport(plan="p.json", device="cpu", ranks=2, steps=2, rows=(
        check.Row(name="parameters", measured=10, estimated=0, unit="bytes", exact=True),
        check.Row(name="step time", measured=2.0, estimated=1.0, unit="s", exact=False)))
    monkeypatch.setattr(check, "check_plan", lambda *args, **kwargs: differing)
    for extra in ([], ["--json"]):
        result = runner.invoke(app, ["check", str(plans["ddp"]), "--device", "cpu", *extra])
        assert result.exit_code == 5, result.output
        assert "parameters" in result.stderr and "Check failed" in result.stderr
    assert json.loads(result.stdout)["exact_ok"] is False
    same = check.CheckReport(plan="p.json", device="cpu", ranks=2, steps=2, rows=differing.rows[1:])
    monkeypatch.setattr(check, "check_plan", lambda *args, **kwargs: same)
    assert runner.invoke(app, ["check", str(plans["ddp"]), "--device", "cpu"]).exit_code == 0


def test_check_with_another_rank_count_exits_2(plans):
    result = runner.invoke(app, ["check", str(plans["ddp"]), "--nproc", "4", "--device", "cpu"])
    assert result.exit_code == 2 and "2 ranks" in " ".join(result.stderr.split())


def test_check_of_a_file_that_is_no_plan_exits_2(tmp_path):
    (tmp_path / "x.json").write_text("not json")
    result = runner.invoke(app, ["check", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "x.json" in result.stderr and "Error" in result.stderr
