"""Cluster strings, options and files: layouts, catalog defaults, recorded assumptions and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodels.cluster import Cluster, InvalidCluster, describe_cluster, load_cluster_file, parse_cluster
from costmodels.hardware import GB, GIB, UnknownGPU, find_gpu
from graphs.errors import FitplanError


@pytest.mark.parametrize(
    ("spec", "nodes", "per_node", "gpu_id"),
    [
        ("8xA100", 1, 8, "a100-sxm-80gb"),
        ("1xA10G", 1, 1, "a10g-24gb"),
        ("8xH100-80GB", 1, 8, "h100-sxm-80gb"),
        ("16xH100", 2, 8, "h100-sxm-80gb"),
        ("2x8xH100", 2, 8, "h100-sxm-80gb"),
        ("4xL4", 1, 4, "l4-24gb"),
        ("A100", 1, 1, "a100-sxm-80gb"),
        ("2xCPU", 1, 2, "cpu"),
        ("8XA100", 1, 8, "a100-sxm-80gb"),
        ("8×A100", 1, 8, "a100-sxm-80gb"),
        (" 2 x 8 x h100 ", 2, 8, "h100-sxm-80gb"),
        ("8x RTX 4090", 2, 4, "rtx-4090-24gb"),  # typical 4-GPU workstation
        ("8xT4", 2, 4, "t4-16gb"),  # AWS g4dn.12xlarge holds 4
        ("16xMI250X", 2, 8, "mi250x-gcd"),  # 8 GCDs per Frontier node
        ("1x16xH100", 1, 16, "h100-sxm-80gb"),  # an explicit layout is taken as written
    ],
)
def test_parse_cluster_reads_accepted_forms(spec, nodes, per_node, gpu_id):
    cluster = parse_cluster(spec)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu.id) == (nodes, per_node, gpu_id)
    assert cluster.world_size == nodes * per_node


def test_parse_cluster_splits_16xH100_into_two_nodes_of_8():
    cluster = parse_cluster("16xH100")
    assert (cluster.nodes, cluster.gpus_per_node) == (2, 8)
    assert any("2 nodes of 8" in note for note in cluster.assumptions)


def test_parse_cluster_A100_records_the_80gb_sxm_assumption():
    cluster = parse_cluster("A100")
    assert cluster.gpu.id == "a100-sxm-80gb"
    assert any("A100 SXM4 80GB" in note for note in cluster.assumptions)


def test_parse_cluster_exact_id_records_no_name_assumption():
    assert not any("means" in note for note in parse_cluster("8xa100-sxm-80gb").assumptions)


def test_parse_cluster_takes_defaults_from_the_typical_dgx_h100_node():
    # DGX H100: 8x 400 Gb/s NDR per node = 50 GB/s per GPU per direction, 2 TB DDR5, 112 cores (DGX BasePOD).
    cluster = parse_cluster("16xH100")
    assert cluster.inter_node_bandwidth == pytest.approx(50 * GB)
    assert cluster.cpu_ram_per_node == 2048 * GIB
    assert cluster.cpu_cores_per_node == 112
    assert cluster.nvme_bandwidth == 0
    assert any("inter-node" in note for note in cluster.assumptions)
    assert any("NVMe" in note for note in cluster.assumptions)


def test_parse_cluster_dgx_a100_inter_node_is_25_gb_per_gpu():
    # DGX A100: 8x HDR 200 Gb/s per node = 25 GB/s per GPU per direction.
    assert parse_cluster("2x8xA100").inter_node_bandwidth == pytest.approx(25 * GB)


def test_parse_cluster_options_override_defaults_without_assumptions():
    cluster = parse_cluster("16xH100", inter_node_gbps=12.5, cpu_ram_gib=512, cpu_cores=64, nvme_gbps=6)
    assert cluster.inter_node_bandwidth == pytest.approx(12.5 * GB)
    assert cluster.cpu_ram_per_node == 512 * GIB
    assert cluster.cpu_cores_per_node == 64
    assert cluster.nvme_bandwidth == pytest.approx(6 * GB)
    assert not any("inter-node" in note or "host" in note or "NVMe" in note for note in cluster.assumptions)


@pytest.mark.parametrize(
    ("options", "nodes", "per_node"),
    [({"gpus_per_node": 4}, 3, 4), ({"nodes": 3}, 3, 4), ({"nodes": 3, "gpus_per_node": 4}, 3, 4)],
)
def test_parse_cluster_layout_options_split_a_count_that_is_not_whole_nodes(options, nodes, per_node):
    cluster = parse_cluster("12xH100", **options)
    assert (cluster.nodes, cluster.gpus_per_node) == (nodes, per_node)


def test_parse_cluster_bare_name_with_layout_options_uses_them():
    cluster = parse_cluster("H100", nodes=2, gpus_per_node=8)
    assert (cluster.nodes, cluster.gpus_per_node) == (2, 8)


@pytest.mark.parametrize("spec", ["0xA100", "2x0xA100", "12xH100", "x8", "", "   ", "8x", "8x8", "8xx8"])
def test_parse_cluster_bad_string_raises_invalid_cluster_with_hint(spec):
    with pytest.raises(InvalidCluster) as info:
        parse_cluster(spec)
    assert isinstance(info.value, FitplanError)
    assert info.value.hint


def test_parse_cluster_unknown_gpu_raises_unknown_gpu_with_hint():
    with pytest.raises(UnknownGPU) as info:
        parse_cluster("8xFOO")
    assert "a100-sxm-80gb" in info.value.hint


def test_parse_cluster_12xH100_hint_suggests_a_whole_node_layout():
    with pytest.raises(InvalidCluster) as info:
        parse_cluster("12xH100")
    assert "3x4xH100" in info.value.hint
    assert "--gpus-per-node 4" in info.value.hint


def test_parse_cluster_hint_for_unreadable_string_lists_forms_and_catalog():
    with pytest.raises(InvalidCluster) as info:
        parse_cluster("x8")
    assert "2x8xH100" in info.value.hint
    assert "h100-sxm-80gb" in info.value.hint


@pytest.mark.parametrize(
    "options",
    [{"nodes": 0}, {"gpus_per_node": -1}, {"inter_node_gbps": -1.0}, {"cpu_ram_gib": 0}, {"nodes": 3},
     {"nodes": 2, "gpus_per_node": 4}, {"inter_node_gbps": 0.0}],
)
def test_parse_cluster_rejects_invalid_or_conflicting_options(options):
    spec = "16xH100" if "inter_node_gbps" in options else "2x8xH100" if "nodes" in options else "8xH100"
    with pytest.raises(InvalidCluster):
        parse_cluster(spec, **options)


def test_cluster_validates_fields_naming_value_and_rule():
    good = parse_cluster("8xA100")
    with pytest.raises(ValueError, match="nodes=0"):
        Cluster(gpu=good.gpu, nodes=0, gpus_per_node=8, inter_node_bandwidth=0.0,
                cpu_ram_per_node=GIB, cpu_cores_per_node=8)
    with pytest.raises(ValueError, match="inter_node_bandwidth"):
        Cluster(gpu=good.gpu, nodes=2, gpus_per_node=8, inter_node_bandwidth=0.0,
                cpu_ram_per_node=GIB, cpu_cores_per_node=8)
    with pytest.raises(ValueError, match="cpu_cores_per_node"):
        Cluster(gpu=good.gpu, nodes=1, gpus_per_node=8, inter_node_bandwidth=0.0,
                cpu_ram_per_node=GIB, cpu_cores_per_node=True)


def test_cluster_is_hashable_and_equal_for_equal_input():
    assert parse_cluster("16xH100") == parse_cluster("16xH100")
    assert len({parse_cluster("16xH100"), parse_cluster("16xH100"), parse_cluster("2x8xH100")}) == 2


def test_describe_cluster_is_one_line_naming_the_gpu():
    line = describe_cluster(parse_cluster("16xH100"))
    assert "\n" not in line
    assert "H100 SXM5 80GB" in line


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_cluster_file_reads_yaml_cluster_string_with_overrides(tmp_path):
    path = _write(tmp_path, "c.yaml", "gpus: 16xH100\ninter_node_gbps: 25\nnvme_gbps: 6.5\n")
    cluster = load_cluster_file(path)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu.id) == (2, 8, "h100-sxm-80gb")
    assert cluster.inter_node_bandwidth == pytest.approx(25 * GB)
    assert cluster.nvme_bandwidth == pytest.approx(6.5 * GB)


def test_load_cluster_file_reads_json_catalog_name_and_layout(tmp_path):
    path = _write(tmp_path, "c.json", json.dumps({"gpu": "A100-40GB", "nodes": 2, "gpus_per_node": 8}))
    cluster = load_cluster_file(str(path))
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu.id) == (2, 8, "a100-sxm-40gb")


def test_load_cluster_file_reads_a_fully_custom_gpu(tmp_path):
    text = """
gpu:
  id: my-accel
  name: My Accelerator
  vendor: nvidia
  arch: hopper
  memory_gib: 96
  hbm_bandwidth_gbps: 4000
  tflops_dense: {fp32: 60, tf32: 400, fp16: 800, bf16: 800, fp8: 1600}
  intra_node: {kind: nvlink4, uni_gbps: 450, nvswitch: true}
  host_link: {pcie_gen: 5, uni_gbps: 63}
nodes: 2
gpus_per_node: 4
inter_node_gbps: 50
cpu_ram_gib: 1024
cpu_cores: 64
"""
    cluster = load_cluster_file(_write(tmp_path, "custom.yml", text))
    assert cluster.gpu.memory_bytes == 96 * GIB
    assert cluster.gpu.peak_flops("bf16") == pytest.approx(800e12)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.cpu_cores_per_node) == (2, 4, 64)
    assert "custom.yml" in cluster.gpu.source
    assert cluster.gpu != find_gpu("H100")


def test_load_cluster_file_custom_gpu_without_node_or_host_options_raises(tmp_path):
    record = {
        "id": "z", "name": "Z", "vendor": "amd", "arch": "cdna3", "memory_gib": 10, "hbm_bandwidth_gbps": 10,
        "tflops_dense": {"fp32": 1, "tf32": None, "fp16": 1, "bf16": 1, "fp8": None},
        "intra_node": {"kind": "xgmi", "uni_gbps": 10, "nvswitch": False},
        "host_link": {"pcie_gen": 4, "uni_gbps": 31},
    }
    path = _write(tmp_path, "z.json", json.dumps({"gpu": record}))
    with pytest.raises(InvalidCluster, match=r"z\.json"):
        load_cluster_file(path)


@pytest.mark.parametrize(
    ("name", "text", "pattern"),
    [
        ("bad.yaml", "gpus: [unclosed\n", "not valid"),
        ("bad.json", "{\"gpus\": ", "not valid"),
        ("extra.yaml", "gpus: 8xA100\ncolour: green\n", "unknown key 'colour'"),
        ("both.yaml", "gpus: 8xA100\ngpu: A100\n", "exactly one"),
        ("neither.yaml", "nodes: 2\n", "exactly one"),
        ("list.yaml", "- 8xA100\n", "mapping"),
        ("negative.json", json.dumps({"gpus": "8xA100", "cpu_cores": -4}), "cpu_cores"),
        ("spec.yaml", "gpus: 12xH100\n", "whole number"),
    ],
)
def test_load_cluster_file_malformed_raises_naming_the_file(tmp_path, name, text, pattern):
    path = _write(tmp_path, name, text)
    with pytest.raises(InvalidCluster) as info:
        load_cluster_file(path)
    assert name in info.value.message
    assert pattern in info.value.message
    assert info.value.hint


def test_load_cluster_file_unknown_gpu_keeps_its_class_and_names_the_file(tmp_path):
    path = _write(tmp_path, "u.yaml", "gpus: 8xFOO\n")
    with pytest.raises(UnknownGPU, match=r"u\.yaml"):
        load_cluster_file(path)


def test_load_cluster_file_missing_file_raises_naming_it(tmp_path):
    with pytest.raises(InvalidCluster, match=r"nope\.yaml"):
        load_cluster_file(tmp_path / "nope.yaml")
