"""`fitplan measure --device cpu --quick`: the real harness (warm-up, repeats, gloo collectives on 2 processes)
writes a profile that `estimate --profile` and `solve --profile` use and `fitplan gpus` lists."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from costmodels.profile import load_profile
from graphs import catalog_ids, load_entry
from solver.hardware.measure import gemm_shapes, sizes_for, timed
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

runner = CliRunner()


def _app():
    from solver.cli.app import app

    return app


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple:
    """One quick CPU measurement, written to the default profile folder (no -o): (folder, CLI result)."""
    folder = tmp_path_factory.mktemp("profiles")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FITPLAN_PROFILE_DIR", str(folder))
        result = runner.invoke(_app(), ["measure", "--device", "cpu", "--quick", "--json"])
    return folder, result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("tiny-llama"), tiny_values("llama"))


@pytest.mark.distributed  # the collectives run on 2 gloo processes
@pytest.mark.slow  # shares one ~10 s CPU measurement (more on busy cores)
def test_measure_cpu_quick_writes_a_complete_profile(stored):
    folder, result = stored
    assert result.exit_code == 0, result.output
    profile = load_profile(folder / "cpu.json")
    assert json.loads(result.stdout)["gpu"] == "cpu"
    assert profile.gpu == "cpu" and profile.quick and profile.devices == 2
    sizes = sizes_for("cpu", quick=True)
    assert {p.dtype for p in profile.gemm} == set(sizes.dtypes)
    assert {(p.m, p.n, p.k) for p in profile.gemm} == set(gemm_shapes(sizes))
    assert {p.backend for p in profile.attention} >= {"math"}
    assert {(p.op, p.nbytes) for p in profile.collectives} == {
        (op, size) for op in ("all_reduce", "all_gather", "reduce_scatter") for size in sizes.collective_bytes}
    assert {fit.op for fit in profile.links} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert {"device_copy", "adamw_torch"} <= {r.name for r in profile.rates}
    timings = [p.time for p in (*profile.gemm, *profile.attention, *profile.collectives, *profile.rates)]
    assert all(t.repeats == sizes.repeats and t.median > 0 and t.spread >= 0 for t in timings)


@pytest.mark.distributed  # the collectives run on 2 gloo processes
@pytest.mark.slow  # shares one ~10 s CPU measurement (more on busy cores)
def test_estimate_with_the_measured_profile_uses_its_rates(stored, model_dir):
    folder, _ = stored
    base = ["estimate", "--model", str(model_dir), "--gpus", "2xCPU", "--seq-len", "64", "--json"]
    plain = runner.invoke(_app(), base)
    profiled = runner.invoke(_app(), [*base, "--profile", str(folder / "cpu.json")])
    assert plain.exit_code == 0 and profiled.exit_code == 0, profiled.output
    plain_time, profiled_time = (json.loads(r.stdout)["time"] for r in (plain, profiled))
    assert profiled_time["compute"] != plain_time["compute"]
    assert profiled_time["communication_total"] != plain_time["communication_total"]
    # Memory does not depend on measured rates on CPU (no CUDA context to measure).
    assert json.loads(profiled.stdout)["memory"] == json.loads(plain.stdout)["memory"]


@pytest.mark.distributed  # the collectives run on 2 gloo processes
@pytest.mark.slow  # shares one ~10 s CPU measurement (more on busy cores)
def test_solve_with_the_profile_records_it_in_the_plan(stored, model_dir):
    folder, _ = stored
    result = runner.invoke(_app(), ["solve", "--model", str(model_dir), "--gpus", "2xCPU", "--seq-len", "64",
                                    "--global-batch", "4", "--json", "--profile", str(folder / "cpu.json")])
    assert result.exit_code == 0, result.output
    assumptions = json.loads(result.stdout)["inputs"]["cluster"]["assumptions"]
    assert any("cpu.json" in note for note in assumptions)


@pytest.mark.distributed  # the collectives run on 2 gloo processes
@pytest.mark.slow  # shares one ~10 s CPU measurement (more on busy cores)
def test_gpus_lists_which_gpus_have_a_stored_profile(stored, monkeypatch):
    folder, _ = stored
    monkeypatch.setenv("FITPLAN_PROFILE_DIR", str(folder))
    rows = {row["id"]: row for row in json.loads(runner.invoke(_app(), ["gpus", "--json"]).stdout)}
    assert rows["cpu"]["profile"] == str(folder / "cpu.json")
    assert rows["h100-sxm-80gb"]["profile"] is None


@pytest.mark.distributed  # the collectives run on 2 gloo processes
@pytest.mark.slow  # shares one ~10 s CPU measurement (more on busy cores)
def test_profile_for_another_gpu_or_a_bad_file_exits_2(stored, model_dir, tmp_path):
    folder, _ = stored
    base = ["estimate", "--model", str(model_dir), "--seq-len", "64"]
    wrong = runner.invoke(_app(), [*base, "--gpus", "1xH100", "--profile", str(folder / "cpu.json")])
    assert wrong.exit_code == 2 and "measured on cpu" in " ".join(wrong.stderr.split())
    (tmp_path / "bad.json").write_text('{"gpu": "cpu"}')
    bad = runner.invoke(_app(), [*base, "--gpus", "2xCPU", "--profile", str(tmp_path / "bad.json")])
    # the console wraps long paths anywhere, so compare without whitespace
    assert bad.exit_code == 2 and "bad.jsonisinvalid" in "".join(bad.stderr.split())


def test_timed_runs_warmup_then_repeats_and_syncs_after_each():
    calls, syncs = [], []
    result = timed(lambda: calls.append(1), warmup=2, repeats=5, sync=lambda: syncs.append(len(calls)))
    assert len(calls) == 7 and result.repeats == 5
    assert syncs == [2, 3, 4, 5, 6, 7]  # once after warm-up, then after every timed call
    assert result.median >= 0 and result.spread >= 0


def test_gemm_shapes_come_from_catalog_hidden_and_ffn_sizes():
    pairs = {(load_entry(m).config.get("intermediate_size"), load_entry(m).config.get("hidden_size"))
             for m in catalog_ids()}
    for device in ("cpu", "cuda"):
        sizes = sizes_for(device, quick=False)
        shapes = gemm_shapes(sizes)
        assert {m for m, _, _ in shapes} == set(sizes.tokens)
        assert all((n, k) in pairs for _, n, k in shapes)


def test_measure_cuda_without_gpu_exits_2():
    result = runner.invoke(_app(), ["measure", "--device", "cuda", "--quick"])
    assert result.exit_code == 2 and "no CUDA GPU" in result.stderr
