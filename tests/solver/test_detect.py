"""`--gpus auto` against a recorded torch.cuda/NVML answer (fake `pynvml` and `torch.cuda`), and on this GPU-less
machine, where it must exit 2 with a clear message."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from costmodels import find_gpu
from solver.api import cluster_from
from solver.cli.app import app
from solver.hardware import detect

RECORDED = json.loads((Path(__file__).parent / "data" / "nvml_8xh100.json").read_text())
HOST_RAM, HOST_CORES = 2 * 2**40, 112  # a DGX H100 host (2 TiB, 2 x 56 cores); monkeypatched, not read


class NVMLError(Exception):
    pass


def fake_nvml(answer: dict) -> types.ModuleType:
    """A `pynvml` module that returns `answer`, shaped as nvidia-ml-py's functions return it."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_NVLINK_MAX_LINKS = answer["nvlink_max_links"]
    nvml.NVML_FEATURE_ENABLED = 1
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: ("handle", index)
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=answer["memory_total_bytes"])
    nvml.nvmlSystemGetDriverVersion = lambda: answer["driver_version"]
    nvml.nvmlDeviceGetMaxPcieLinkGeneration = lambda handle: answer["pcie_max_generation"]

    def link_state(handle, link: int) -> int:
        if link >= answer["nvlink_max_links"]:
            raise NVMLError("invalid argument")
        if answer["nvlink_links_active"] == 0:
            raise NVMLError("not supported")  # what PCIe-only GPUs answer
        return int(link < answer["nvlink_links_active"])

    nvml.nvmlDeviceGetNvLinkState = link_state
    return nvml


@pytest.fixture
def gpu_node(monkeypatch):
    """Install a recorded answer: returns a function that takes overrides of the recorded fields."""
    def install(**overrides) -> dict:
        answer = {**RECORDED, **overrides}
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(answer))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: answer["device_count"])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: answer["name"])
        monkeypatch.setattr(detect, "host_memory_bytes", lambda: HOST_RAM)
        monkeypatch.setattr(detect, "physical_cores", lambda: HOST_CORES)
        return answer
    return install


def test_detect_recorded_8xh100_answer_builds_one_node_of_eight_h100_sxm(gpu_node):
    answer = gpu_node()
    cluster = cluster_from("auto")
    catalog = find_gpu("H100-SXM5-80GB")
    assert cluster.gpu.id == catalog.id
    assert (cluster.nodes, cluster.gpus_per_node, cluster.world_size) == (1, 8, 8)
    # Memory is what the driver reports (81559 MiB), as the catalog's cited driver figure is, not the 80 GiB label.
    assert cluster.gpu.memory_bytes == answer["memory_total_bytes"] == catalog.memory_bytes < 80 * 2**30
    assert (cluster.gpu.intra_node_kind, cluster.gpu.intra_node_bandwidth) == ("nvlink4", catalog.intra_node_bandwidth)
    assert (cluster.cpu_ram_per_node, cluster.cpu_cores_per_node) == (HOST_RAM, HOST_CORES)
    assert any("18 active NVLink" in note for note in cluster.assumptions)
    assert detect.driver_version() == answer["driver_version"]


def test_detect_sxm_gpu_without_active_nvlink_talks_over_pcie(gpu_node):
    gpu_node(nvlink_links_active=0, pcie_max_generation=4)
    cluster = detect.detect_cluster()
    assert cluster.gpu.intra_node_kind == "pcie4" and not cluster.gpu.nvswitch
    assert cluster.gpu.intra_node_bandwidth == detect.PCIE_X16_GBPS[4] * 1e9


@pytest.mark.parametrize(("reported", "memory_mib", "expected"), [
    # Names as torch.cuda.get_device_name / nvidia-smi print them.
    ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm-80gb"),
    ("NVIDIA H100 PCIe", 81559, "h100-pcie-80gb"),
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-sxm-40gb"),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-sxm-80gb"),
    ("NVIDIA A100 80GB PCIe", 81920, "a100-pcie-80gb"),
    ("NVIDIA H200", 143771, "h200-sxm-141gb"),
    ("NVIDIA A10G", 23028, "a10g-24gb"),
    ("NVIDIA L4", 23034, "l4-24gb"),
    ("NVIDIA L40S", 46068, "l40s-48gb"),
    ("Tesla V100-SXM2-16GB", 16384, "v100-sxm2-16gb"),
    ("Tesla T4", 15360, "t4-16gb"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090-24gb"),
    ("NVIDIA RTX A6000", 49140, "rtx-a6000-48gb"),
])
def test_catalog_gpu_maps_driver_names_to_catalog_ids(reported, memory_mib, expected):
    assert detect.catalog_gpu(reported, memory=memory_mib * 2**20).id == expected


def test_catalog_gpu_unknown_name_is_a_user_error():
    with pytest.raises(detect.UnknownGPU, match="not in the GPU catalog"):
        detect.catalog_gpu("NVIDIA Quadro K620", memory=2 * 2**30)


def test_gpus_auto_without_gpu_exits_2_with_clear_message(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 256, "max_position_embeddings": 128}))
    result = CliRunner().invoke(app, ["estimate", "--model", str(config), "--gpus", "auto"])
    assert result.exit_code == 2, result.output
    assert "--gpus auto found no GPU" in result.stderr
    with pytest.raises(detect.NoGPU):
        cluster_from("auto")
