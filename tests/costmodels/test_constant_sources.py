"""Efficiency constants of costmodels/ are cited data or fitted (issue 11): each replaced constant read back
against its source's figure, and a scan that no float constant is left marked as an assumption unnoticed."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from costmodels import parse_cluster
from costmodels.alignment import MISALIGNED, alignment_factor, tile_fraction
from costmodels.collectives import Group, all_reduce_seconds, tp_group
from costmodels.compilation import COMPILED_MEMORY_BOUND_SPEEDUP, compiled_memory_bound_speedup
from costmodels.compute import DEFAULT_MAMF, MAMF
from costmodels.hardware import find_gpu, load_gpus
from costmodels.offload import host_memory_bandwidth

COSTMODELS = Path(__file__).resolve().parents[2] / "costmodels"
# Module-level float constants whose comment says they are an assumption or not sourced, each with why it stays.
# A new one fails the scan until it is sourced, fitted, or listed here with its reason.
KNOWN_UNSOURCED: dict[tuple[str, str], str] = {}


def test_mamf_table_reads_back_the_measured_gh200_row_and_the_floor_for_unmeasured_gpus() -> None:
    # ml-engineering's MAMF table: GH200 828.6 of 989 TFLOPS; floor of the NVIDIA rows: GB200 1822 of 2500.
    # Tolerance: the table stores three decimals.
    assert MAMF["gh200-96gb"] == pytest.approx(828.6 / 989, abs=5e-4)
    assert pytest.approx(1822 / 2500, abs=5e-4) == DEFAULT_MAMF
    catalog_ids = set(load_gpus())
    assert set(MAMF) <= catalog_ids, "a MAMF row names a GPU the catalog does not have"
    assert "l4-24gb" not in MAMF  # not measured in the table: priced at the floor


def test_tiny_all_reduce_inside_a_node_costs_the_nccl_tests_latency() -> None:
    # nccl-tests all_reduce_perf, 8 B over the 8 NVSwitch GPUs of one node: 12.49 us (DeepEP issue 303).
    # 1% tolerance: the bandwidth term of 8 bytes adds well under a nanosecond.
    cluster = parse_cluster("8xH100")
    assert all_reduce_seconds(cluster, tp_group(cluster, 8), 8) == pytest.approx(12.49e-6, rel=0.01)


def test_tiny_all_reduce_between_two_nodes_costs_the_nccl_tests_latency() -> None:
    # nccl-tests issue 150: 8 B all_reduce between two A100 80GB nodes over HDR InfiniBand, one GPU each: 19.90 us.
    cluster = parse_cluster("2x8xA100-80GB")
    group = Group(2, spans_nodes=True, per_node=1)
    assert all_reduce_seconds(cluster, group, 8) == pytest.approx(19.90e-6, rel=0.01)


def test_host_memory_bandwidth_of_dgx_a100_is_the_stream_triad_of_its_cpus() -> None:
    # 2x EPYC 7742, 16 channels DDR4-3200 = 409.6 GB/s peak; Azure HBv2 (the same Rome CPUs) STREAM Triad ~260 GB/s.
    assert host_memory_bandwidth("a100-sxm-80gb") == pytest.approx(260e9, rel=0.01)
    # DGX H100: 2x Xeon 8480C, 16 channels DDR5-4800 = 614.4 GB/s at the DDR5 STREAM fraction (715 / 921.6).
    assert host_memory_bandwidth("h100-sxm-80gb") == pytest.approx(614.4e9 * 715 / 921.6, rel=0.01)
    # A node whose CPU the catalog does not name: the measured DDR4 server.
    assert host_memory_bandwidth("l4-24gb") == pytest.approx(260e9, rel=0.01)


def test_host_memory_nodes_name_catalog_gpus() -> None:
    data = json.loads((COSTMODELS / "data" / "host_memory.json").read_text())
    assert set(data["nodes"]) <= set(load_gpus())


def test_compiled_speedup_is_the_geometric_mean_of_the_fused_kernel_benchmarks() -> None:
    rows = json.loads((COSTMODELS / "data" / "fused_kernels.json").read_text())["rows"]
    ratios = [r["eager_ms"] / r["fused_ms"] for r in rows]
    expected = math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert compiled_memory_bound_speedup() == pytest.approx(expected, rel=1e-12)
    assert compiled_memory_bound_speedup() == COMPILED_MEMORY_BOUND_SPEEDUP
    assert min(ratios) < COMPILED_MEMORY_BOUND_SPEEDUP < max(ratios)
    assert {r["kernel"] for r in rows} == {"rms_norm", "rope"}  # memory-bound kernels only, no matmuls inside


def test_untiled_dimension_costs_its_idle_share_of_the_last_tile() -> None:
    a100 = find_gpu("a100-sxm-80gb")
    # 4104 = 64 x 64 + 8: 65 tiles of 64 hold 4160 columns, 4104 of them useful.
    assert tile_fraction(4104, 64) == pytest.approx(4104 / 4160, rel=1e-12)
    assert alignment_factor(a100, "bf16", (4096, 4104)) == pytest.approx(4104 / 4160, rel=1e-12)
    assert alignment_factor(a100, "bf16", (4096, 4160)) == 1.0


def test_misaligned_dimension_runs_at_the_measured_align1_kernel_speed() -> None:
    # pytorch issue 181718 (RTX 4090, bf16 N x N x N): align1 kernels at odd N average 111.3 TFLOP/s, the 8-aligned
    # N = 2040 runs 155.9. 1% tolerance: the table's TFLOP/s carry one decimal.
    rtx4090 = find_gpu("rtx-4090-24gb")
    assert alignment_factor(rtx4090, "bf16", (2055, 2055, 2055)) == pytest.approx(111.3 / 155.9, rel=0.01)
    assert tile_fraction(2040, 64) > MISALIGNED


def _float_constants(path: Path) -> list[tuple[str, str]]:
    """(name, comment) of each module-level float constant: the comment lines above it (those above the first of
    a group of constants for the rest of the group) and any comment on its own line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for node in ast.parse("\n".join(lines)).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            continue
        name = node.targets[0].id
        if not name.isupper() or not isinstance(_value(node.value), float):
            continue
        row = node.lineno - 2
        comment = [lines[node.lineno - 1].partition("#")[2]]
        while row >= 0 and (lines[row].startswith("#") or (lines[row][:1].isupper() and "=" in lines[row])):
            if lines[row].startswith("#"):
                comment.append(lines[row])
            elif comment[1:]:
                break
            row -= 1
        found.append((name, " ".join(comment)))
    return found


def _value(expr: ast.expr) -> object:
    try:
        return ast.literal_eval(expr)
    except ValueError:  # an expression, e.g. 12.49e-6 / 14: evaluated when it holds literals only
        if not all(isinstance(n, (ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop))
                   for n in ast.walk(expr)):
            return None
        return eval(compile(ast.Expression(expr), "<constant>", "eval"), {})  # literals only, checked above


def test_no_float_constant_in_costmodels_is_left_an_unsourced_assumption() -> None:
    flagged = {(path.name, name) for path in sorted(COSTMODELS.glob("*.py")) for name, comment in _float_constants(path)
               if "assumption" in comment.lower() or "not sourced" in comment.lower()}
    changed = sorted(flagged ^ set(KNOWN_UNSOURCED))
    assert not changed, f"unsourced float constants changed (source, fit or list them): {changed}"


def test_the_scan_sees_a_constant_marked_as_an_assumption(tmp_path: Path) -> None:
    module = tmp_path / "sample.py"
    module.write_text("# Per-hop latency (an assumption).\nLATENCY = 5e-6\nOTHER = 15e-6\n\n# Cited.\nCITED = 0.5\n")
    comments = dict(_float_constants(module))
    assert "assumption" in comments["LATENCY"] and "assumption" in comments["OTHER"]
    assert "assumption" not in comments["CITED"]
