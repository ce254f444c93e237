"""`fitplan choose`: the sweep equals solving each cluster alone, costs follow the price table, the Pareto front
and the two picks match brute force, price files (maps and SkyPilot-style catalogs) parse, bad input exits 2."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from importlib import resources

import pytest
from typer.testing import CliRunner

from costmodels import find_gpu
from graphs import FitplanError
from solver import Infeasible, solve
from solver.choose import (
    Point,
    cheapest_within,
    choose,
    clusters,
    fastest_within,
    gpu_counts,
    pareto_front,
    parse_duration,
    plan_point,
    unit_price,
)
from solver.cli.app import app
from solver.hardware.prices import GpuPrice, InvalidPrices, bundled_prices, load_prices

MODEL = "meta-llama/Llama-3.2-1B"
TOKENS = 2e9
# offload pinned off so that one T4 cannot hold the 1B model's states: the sweep has an infeasible point too. A
# generous time limit: each point must be proven OPTIMAL on a loaded machine, or the sweep and the lone solve may
# stop at different incumbents (a clean-clone CI beside other work once did, 4xT4 with pipelines open).
OPTIONS = {"seq_len": 2048, "global_batch": 16, "offload": "none", "time_limit": 120}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep():
    return choose(MODEL, TOKENS, gpu_types=["H100", "T4"], max_gpus=8, **OPTIONS)


def test_sweep_points_equal_solving_each_cluster_alone(sweep):
    assert [p.spec for p in sweep.points] == [f"{n}x{g}" for g in ("h100-sxm-80gb", "t4-16gb") for n in (1, 2, 4, 8)]
    assert any(not p.feasible for p in sweep.points) and any(p.feasible for p in sweep.points)
    for point in sweep.points:
        if not point.feasible:
            with pytest.raises(Infeasible) as alone:
                solve(MODEL, point.spec, **OPTIONS)
            assert point.reason == alone.value.message
            continue
        plan = solve(MODEL, point.spec, **OPTIONS)
        assert point.summary == plan.decisions.summary()
        # Same input, same deterministic solve: the numbers are identical, not just close.
        assert point.step_seconds == plan.estimate.time.step_time
        assert point.tokens_per_second == plan.estimate.tokens_per_second
        assert point.global_batch == plan.inputs.global_batch == OPTIONS["global_batch"]
        assert point.seq_len == plan.inputs.seq_len == OPTIONS["seq_len"]


def test_costs_follow_the_bundled_price_table_exactly(sweep):
    data = json.loads(resources.files("solver.hardware").joinpath("data/prices.json").read_text())
    per_gpu = {find_gpu(r["gpu"]).id: r["instance_usd_per_hour"] / r["gpus_per_instance"] for r in data["prices"]}
    for point in sweep.points:
        assert point.usd_per_gpu_hour == per_gpu[point.gpu]
        if point.feasible:
            hours = TOKENS / point.tokens_per_second / 3600
            assert point.hours == pytest.approx(hours, rel=1e-12)  # float rounding only
            assert point.cost_usd == pytest.approx(hours * point.gpus * per_gpu[point.gpu], rel=1e-12)
    assert any("EXAMPLE" in note for note in sweep.notes)  # the output says the prices are dated examples


def test_minimum_gpus_is_the_smallest_count_with_a_plan(sweep):
    for gpu, least in sweep.minimum_gpus.items():
        fitting = [p.gpus for p in sweep.points if p.gpu == gpu and p.feasible]
        assert least == min(fitting, default=None)
    assert sweep.minimum_gpus["t4-16gb"] == 2  # one T4 cannot hold the states without offload


def _dominated(p: Point, points: list[Point]) -> bool:
    return any(q.hours <= p.hours and q.cost_usd <= p.cost_usd and (q.hours < p.hours or q.cost_usd < p.cost_usd)
               for q in points if q.feasible)


def _random_points(seed: int, n: int = 40) -> list[Point]:
    """Points on a coarse grid, so that ties and exact duplicates happen."""
    rng = random.Random(seed)
    base = Point(gpu="h100-sxm-80gb", gpu_name="H100", gpus=1, spec="1xH100", feasible=True, status="OPTIMAL",
                 usd_per_gpu_hour=1.0, price_kind="on-demand")
    return [replace(base, gpus=i + 1, hours=float(rng.randint(1, 12)), cost_usd=float(rng.randint(1, 12)),
                    feasible=rng.random() > 0.2) for i in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_pareto_front_equals_brute_force_on_random_points(seed):
    points = _random_points(seed)
    expected = [p for p in points if p.feasible and not _dominated(p, points)]
    front = pareto_front(points)
    assert sorted(p.gpus for p in front) == sorted(p.gpus for p in expected)
    assert [p.hours for p in front] == sorted(p.hours for p in front)  # fastest first


def test_pareto_front_of_the_sweep_equals_brute_force(sweep):
    points = list(sweep.points)
    expected = {p.spec for p in points if p.feasible and not _dominated(p, points)}
    assert {p.spec for p in sweep.front} == expected


@pytest.mark.parametrize("seed", range(10))
def test_deadline_and_budget_picks_equal_brute_force(seed):
    points = _random_points(seed)
    feasible = [p for p in points if p.feasible]
    for limit in (0.5, 3.0, 6.0, 12.0, None):
        meeting = [p for p in feasible if limit is None or p.hours <= limit]
        pick = cheapest_within(points, limit)
        assert (pick is None) == (not meeting)
        if pick is not None:
            assert pick.cost_usd == min(p.cost_usd for p in meeting)
            assert pick.hours == min(p.hours for p in meeting if p.cost_usd == pick.cost_usd)
        affordable = [p for p in feasible if limit is None or p.cost_usd <= limit]
        pick = fastest_within(points, limit)
        assert (pick is None) == (not affordable)
        if pick is not None:
            assert pick.hours == min(p.hours for p in affordable)
            assert pick.cost_usd == min(p.cost_usd for p in affordable if p.hours == pick.hours)


def test_gpu_counts_go_up_to_a_node_then_whole_nodes():
    assert gpu_counts(8, 64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert gpu_counts(4, 13) == [1, 2, 4, 8, 12]
    assert gpu_counts(8, 3) == [1, 2]
    t4 = find_gpu("T4")  # a 4-GPU node in the catalog
    assert [n for g, n in clusters(["T4", "t4"], 8) if g == t4] == [1, 2, 4, 8]  # duplicates solved once


@pytest.mark.parametrize(("text", "hours"), [("24h", 24), ("90m", 1.5), ("2d", 48), ("3600s", 1), ("1.5", 1.5),
                                             ("36 hours", 36)])
def test_durations_read_in_hours(text, hours):
    assert parse_duration(text) == pytest.approx(hours)


@pytest.mark.parametrize("text", ["", "tomorrow", "0h", "-1h", "5w"])
def test_bad_durations_are_user_errors(text):
    with pytest.raises(FitplanError):
        parse_duration(text)


def test_simple_price_map_reads_numbers_and_spot(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("H100: 2.99\nA100-80GB: {on_demand: 1.79, spot: 0.9}\n")
    table = load_prices(path)
    assert table["h100-sxm-80gb"].usd_per_gpu_hour == 2.99 and table["h100-sxm-80gb"].spot_usd_per_gpu_hour is None
    assert table["a100-sxm-80gb"].spot_usd_per_gpu_hour == 0.9
    assert unit_price(table["a100-sxm-80gb"], spot=True) == (0.9, "spot")
    assert unit_price(table["h100-sxm-80gb"], spot=True) == (2.99, "on-demand")


# The columns of SkyPilot's catalogs (skypilot-org/skypilot-catalog README, schema v5 vms.csv).
SKYPILOT_CSV = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,\
AvailabilityZone
m5.large,,,2.0,8.0,,0.096,0.04,us-east-1,use1-az1
p4d.24xlarge,A100,8.0,96.0,1152.0,,32.7726,12.0,us-east-1,use1-az1
p4d.24xlarge,A100,8.0,96.0,1152.0,,40.0,,eu-west-1,euw1-az1
p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,,40.96575,,us-east-1,use1-az1
g5.xlarge,A10G,1.0,4.0,16.0,,1.006,0.4,us-east-1,use1-az1
g5.12xlarge,A10G,4.0,48.0,192.0,,5.672,1.2,us-east-1,use1-az1
inf2.xlarge,Inferentia2,1.0,4.0,16.0,,0.7582,,us-east-1,use1-az1
"""


def test_skypilot_catalog_gives_the_cheapest_offer_per_gpu_hour(tmp_path):
    path = tmp_path / "vms.csv"
    path.write_text(SKYPILOT_CSV)
    table = load_prices(path)
    assert set(table) == {"a100-sxm-40gb", "a100-sxm-80gb", "a10g-24gb"}  # SkyPilot's "A100" is the 40 GB part
    assert table["a100-sxm-40gb"].usd_per_gpu_hour == pytest.approx(32.7726 / 8)
    assert table["a100-sxm-40gb"].spot_usd_per_gpu_hour == pytest.approx(12.0 / 8)
    assert table["a100-sxm-80gb"].spot_usd_per_gpu_hour is None
    assert table["a10g-24gb"].usd_per_gpu_hour == pytest.approx(1.006)  # 1.006 < 5.672 / 4
    assert table["a10g-24gb"].spot_usd_per_gpu_hour == pytest.approx(1.2 / 4)


def test_skypilot_rows_as_yaml_list_parse_like_the_csv(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text("- {InstanceType: g6.xlarge, AcceleratorName: L4, AcceleratorCount: 1, Price: 0.8048, "
                    "SpotPrice: 0.3}\n")
    price = load_prices(path)["l4-24gb"]
    assert (price.usd_per_gpu_hour, price.spot_usd_per_gpu_hour) == (0.8048, 0.3)


@pytest.mark.parametrize(("name", "text", "message"), [
    ("p.yaml", "H100: -1\n", "positive"),
    ("p.yaml", "H100: cheap\n", "positive"),
    ("p.yaml", "H100: yes\n", "positive"),
    ("p.yaml", "H100: {on_demand: 2, discount: 1}\n", "positive"),
    ("p.yaml", "H999: 2.0\n", "Unknown GPU"),
    ("p.yaml", "H100: [2.0\n", "not valid"),
    ("p.yaml", "", "empty"),
    ("p.json", "{\"H100\": 2.0", "not valid"),
    ("p.csv", "AcceleratorName,Price\nH100,2\n", "AcceleratorCount"),
    ("p.csv", "AcceleratorName,AcceleratorCount,Price\nH100,8,free\n", "row 2"),
    ("p.csv", "AcceleratorName,AcceleratorCount,Price\nH100,0,10\n", "AcceleratorCount"),
    ("p.csv", "AcceleratorName,AcceleratorCount,Price\nTPU-v4,8,10\n", "no row with a GPU"),
    ("p.yaml", "- {AcceleratorName: H100, Price: 2}\n", "lacks"),
])
def test_malformed_price_files_are_user_errors_naming_the_problem(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InvalidPrices) as error:
        load_prices(path)
    assert message in error.value.message


def test_missing_price_file_is_a_user_error(tmp_path):
    with pytest.raises(InvalidPrices, match="Cannot read"):
        load_prices(tmp_path / "absent.yaml")


def test_spot_prices_apply_where_known_and_notes_say_where_not():
    table = {**bundled_prices(), "l4-24gb": GpuPrice(gpu="l4-24gb", usd_per_gpu_hour=0.8, spot_usd_per_gpu_hour=0.25,
                                                     source="test")}
    choice = choose(MODEL, TOKENS, gpu_types=["L4", "A10G"], max_gpus=1, prices=table, spot=True, **OPTIONS)
    l4, a10g = choice.points
    assert (l4.price_kind, l4.usd_per_gpu_hour) == ("spot", 0.25)
    assert (a10g.price_kind, a10g.usd_per_gpu_hour) == ("on-demand", bundled_prices()["a10g-24gb"].usd_per_gpu_hour)
    assert any("no spot price for A10G" in note for note in choice.notes)
    if l4.feasible:
        assert l4.cost_usd == pytest.approx(l4.hours * 0.25, rel=1e-12)


def test_cli_choose_prints_json_with_front_and_picks_and_writes_the_plot(tmp_path):
    plot = tmp_path / "front.png"
    result = CliRunner().invoke(app, ["choose", "--model", MODEL, "--tokens", "1e9", "--gpu-types", "H100",
                                      "--max-gpus", "2", "--seq-len", "2048", "--deadline", "2d", "--budget", "1000",
                                      "--json", "--plot", str(plot)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [p["gpus"] for p in data["points"]] == [1, 2]
    assert data["front"] and data["cheapest"]["hours"] <= 48 and data["fastest"]["cost_usd"] <= 1000
    assert data["deadline_hours"] == 48
    assert plot.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu-types", "H999"], "Unknown GPU"),
    (["--gpu-types", "MI300X"], "No price"),
    (["--deadline", "soon"], "duration"),
    (["--tokens", "-5"], "--tokens"),
    (["--budget", "0"], "--budget"),
    (["--max-gpus", "0"], "--max-gpus"),
    (["--prices", "/nonexistent/prices.yaml"], "Cannot read"),
])
def test_cli_choose_bad_input_exits_2_with_message(args, message):
    base = {"--model": MODEL, "--tokens": "1e9", "--gpu-types": "H100", "--max-gpus": "1"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    result = CliRunner().invoke(app, ["choose", *[x for pair in base.items() for x in pair]])
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr


def test_the_sweeps_own_process_imports_no_search_before_its_workers_start():
    # The workers import the search (OR-Tools, pandas, the cost models' search side) where they solve; the sweep's
    # process starts them without paying those imports first (~2 s on a 2-core machine).
    probe = ("import json, sys, solver.choose, solver.cli.choose_report; "
             "print(json.dumps(sorted(m for m in ('ortools', 'pandas', 'solver.api', 'solver.search.solve') "
             "if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_a_sweep_sharing_per_node_costs_equals_each_cluster_solved_with_empty_caches():
    # One process solves the clusters in turn, so 8, 16 and 24 H100s (nodes of 8) share their per-node costs
    # (`costmodels.cluster.node_view`: kernel speeds, node times, the pipeline search's compute bounds); each point
    # must equal its cluster solved alone after every cache is emptied. Deterministic: no wall clock cuts a search.
    import costmodels.timing as timing
    import solver.search.solve as search

    options = {**OPTIONS, "deterministic": True, "time_limit": 60}
    shared = choose(MODEL, TOKENS, gpu_types=["H100"], max_gpus=24, workers=1, **options)
    assert [p.gpus for p in shared.points] == [1, 2, 4, 8, 16, 24]
    for point in shared.points:
        for memo in (search._COMPUTE, search._COSTS, search._SPACES):
            memo.clear()
        timing.clear_caches()
        gpu = find_gpu(point.gpu)
        alone = plan_point(MODEL, gpu, point.gpus, tokens=TOKENS, price=bundled_prices()[gpu.id], spot=False,
                           **options)
        assert alone == point
