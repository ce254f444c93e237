"""The GPU catalog: coverage, dense peak rates against published tables, units, lookup and validation."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from costmodels.hardware import DTYPES, GB, GIB, MIB, UnknownGPU, catalog_from_json, find_gpu, load_gpus
from graphs.errors import FitplanError

REQUIRED_IDS = [
    "a100-sxm-40gb", "a100-sxm-80gb", "a100-pcie-40gb", "a100-pcie-80gb", "h100-sxm-80gb", "h100-pcie-80gb",
    "h200-sxm-141gb", "b200-180gb", "l40s-48gb", "l4-24gb", "a10g-24gb", "rtx-a6000-48gb", "v100-sxm2-16gb",
    "v100-sxm2-32gb", "v100-pcie-16gb", "v100-pcie-32gb", "t4-16gb", "rtx-3090-24gb", "rtx-4090-24gb",
    "mi250x-gcd", "mi300x-192gb", "cpu", "h100-nvl-94gb", "gh200-96gb",
]

# Dense BF16 TFLOP/s (FP16 on Volta/Turing, which lack BF16) from the table in
# shared/notes/launchers-and-hardware.md section 1.1; the catalog must carry these exact values.
DOCUMENTED_DENSE_TFLOPS = {
    "a100-sxm-40gb": 312, "a100-sxm-80gb": 312, "a100-pcie-40gb": 312, "a100-pcie-80gb": 312,
    "h100-sxm-80gb": 989.4, "h100-pcie-80gb": 756, "h200-sxm-141gb": 989, "b200-180gb": 2250,
    "l40s-48gb": 362.05, "l4-24gb": 121, "a10g-24gb": 70, "rtx-a6000-48gb": 154.8, "rtx-3090-24gb": 71,
    "rtx-4090-24gb": 165.2, "mi250x-gcd": 191.5, "mi300x-192gb": 1307,
}

# torchtitan tools/utils.py get_peak_flops (BF16, dense), as quoted in the shared notes section 1.1.
TORCHTITAN_PEAK_FLOPS = {
    "a100-sxm-80gb": 312e12, "rtx-a6000-48gb": 154.85e12, "h100-sxm-80gb": 989e12, "h100-pcie-80gb": 756e12,
    "h200-sxm-141gb": 989e12, "b200-180gb": 2.25e15, "mi300x-192gb": 1300e12, "mi250x-gcd": 191.5e12,
    "l40s-48gb": 362e12,
}

ALIASES = {
    "A100": "a100-sxm-80gb", "a100": "a100-sxm-80gb", "A100-80GB": "a100-sxm-80gb",
    "A100-40GB": "a100-sxm-40gb", "A100-PCIe": "a100-pcie-80gb", "H100": "h100-sxm-80gb",
    "H100-80GB": "h100-sxm-80gb", "H100-PCIe": "h100-pcie-80gb", "h100 pcie": "h100-pcie-80gb",
    "H200": "h200-sxm-141gb", "B200": "b200-180gb",
    "A10G": "a10g-24gb", "L4": "l4-24gb", "L40S": "l40s-48gb", "A6000": "rtx-a6000-48gb",
    "V100": "v100-sxm2-32gb", "V100-16GB": "v100-sxm2-16gb", "V100-32GB": "v100-sxm2-32gb",
    "V100-PCIe": "v100-pcie-32gb", "T4": "t4-16gb", "RTX3090": "rtx-3090-24gb", "RTX 4090": "rtx-4090-24gb",
    "RTX4090": "rtx-4090-24gb", "MI250X": "mi250x-gcd", "MI300X": "mi300x-192gb", "CPU": "cpu",
    "a100-sxm-80gb": "a100-sxm-80gb", "A100 SXM4 80GB": "a100-sxm-80gb",
    "H100-NVL": "h100-nvl-94gb", "H100 NVL 94GB": "h100-nvl-94gb", "GH200": "gh200-96gb",
}


def test_catalog_contains_every_required_gpu():
    assert set(REQUIRED_IDS) <= set(load_gpus())


@pytest.mark.parametrize(("typed", "gpu_id"), sorted(ALIASES.items()))
def test_find_gpu_resolves_alias_ignoring_case_and_separators(typed, gpu_id):
    assert find_gpu(typed).id == gpu_id


def test_every_catalog_name_resolves_back_to_its_gpu():
    for gpu in load_gpus().values():
        for name in (gpu.id, gpu.name, *gpu.aliases, gpu.id.upper()):
            assert find_gpu(name) is gpu


@pytest.mark.parametrize(("gpu_id", "tflops"), sorted(DOCUMENTED_DENSE_TFLOPS.items()))
def test_dense_bf16_flops_equal_documented_dense_figure(gpu_id, tflops):
    # Exact up to float rounding of TFLOP/s -> FLOP/s.
    assert find_gpu(gpu_id).peak_flops("bf16") == pytest.approx(tflops * 1e12, rel=1e-12)


@pytest.mark.parametrize(("gpu_id", "flops"), sorted(TORCHTITAN_PEAK_FLOPS.items()))
def test_dense_bf16_flops_agree_with_torchtitan_get_peak_flops(gpu_id, flops):
    # 1% tolerance: torchtitan rounds (AMD's 1,307 to 1,300; 989.4 to 989). A sparse figure would be 2x off.
    assert find_gpu(gpu_id).peak_flops("bf16") == pytest.approx(flops, rel=0.01)


def test_volta_and_turing_have_fp16_but_no_bf16_or_tf32():
    for gpu_id in ("v100-sxm2-16gb", "v100-sxm2-32gb", "v100-pcie-16gb", "v100-pcie-32gb", "t4-16gb"):
        gpu = find_gpu(gpu_id)
        assert gpu.peak_flops("bf16") is None
        assert gpu.peak_flops("tf32") is None
        assert gpu.peak_flops("fp16") > 0


def test_fp8_exists_exactly_on_hopper_ada_blackwell_and_cdna3():
    for gpu in load_gpus().values():
        has_fp8 = gpu.peak_flops("fp8") is not None
        assert has_fp8 == (gpu.arch in {"hopper", "ada", "blackwell", "cdna3"}), gpu.id


def test_every_gpu_defines_every_dtype_and_fp32():
    for gpu in load_gpus().values():
        assert [dtype for dtype, _ in gpu.flops] == list(DTYPES)
        assert gpu.peak_flops("fp32") > 0


def _catalog_records() -> list[dict]:
    """The raw data file, read apart from the loader under test."""
    return json.loads(resources.files("costmodels").joinpath("data/gpus.json").read_text(encoding="utf-8"))


def test_capacity_is_what_the_driver_reports_not_the_marketing_label():
    # Figures quoted in issue 10: an A10G shows 23,028 MiB and an L4 about 22.5 GiB (nvidia-smi memory.total).
    assert find_gpu("A10G").memory_bytes == 23_028 * MIB
    assert find_gpu("L4").memory_bytes / GIB == pytest.approx(22.5, abs=0.01)
    assert find_gpu("H100").memory_bytes == 85_520_809_984  # torch total_memory on an H100 80GB HBM3
    assert find_gpu("A100-40GB").memory_bytes == 40_339 * MIB  # deviceQuery: 42,298,834,944 B
    assert find_gpu("A100").memory_bytes == 81_920 * MIB  # nvidia-smi on the SXM4 80GB part
    assert find_gpu("MI300X").memory_bytes == 206_141_652_992  # rocm-smi VRAM Total Memory (B)


def test_without_a_driver_figure_the_label_is_read_as_gib():
    assert find_gpu("MI250X").memory_bytes == 64 * GIB  # one GCD, half of the 128 GB package
    assert find_gpu("H200").memory_bytes == 141 * GIB
    assert find_gpu("GH200").memory_bytes == 96 * GIB


def test_every_catalog_capacity_names_its_source():
    for record in _catalog_records():
        gpu, source, mib = find_gpu(record["id"]), record.get("memory_source", ""), record.get("memory_mib")
        assert source and gpu.memory_source == source, record["id"]
        if record["vendor"] == "cpu":
            assert mib is None and "made-up" in source
        elif mib is None:
            assert "datasheet; driver figure not found" in source, record["id"]
            assert gpu.memory_bytes == round(record["memory_gib"] * GIB), record["id"]
        else:  # a cited driver report: a page or issue that shows this very number
            assert "github.com/" in source or ".html" in source, record["id"]
            assert str(mib) in source.replace(",", ""), record["id"]


def test_cited_driver_figures_are_whole_mib_between_the_decimal_and_binary_label():
    cited = [r for r in _catalog_records() if r.get("memory_mib") is not None]
    assert len(cited) >= 15
    for record in cited:
        capacity, label = find_gpu(record["id"]).memory_bytes, record["memory_gib"]
        assert capacity == record["memory_mib"] * MIB and capacity % MIB == 0, record["id"]
        # Drivers reserve some memory: never more than the label read as GiB, and not far below it read as GB.
        assert 0.95 * label * GB <= capacity <= label * GIB, record["id"]


def test_custom_gpu_record_may_carry_a_driver_figure():
    text = _catalog_text(memory_gib=24, memory_mib=23_028, memory_source="smi")
    gpu = catalog_from_json(text, origin="t.json")["x1"]
    assert (gpu.memory_bytes, gpu.memory_source) == (23_028 * MIB, "smi")


def test_bandwidths_are_bytes_per_second_per_direction():
    h100 = find_gpu("H100")
    assert h100.hbm_bandwidth == pytest.approx(3350 * GB)
    assert h100.intra_node_bandwidth == pytest.approx(450 * GB)  # NVLink 4: 900 GB/s is both directions
    assert h100.host_bandwidth == pytest.approx(63 * GB)
    assert h100.nvswitch
    assert find_gpu("V100").nvswitch is False  # DGX-1 hybrid cube mesh


def test_every_gpu_has_a_source_and_a_typical_node():
    for gpu in load_gpus().values():
        assert gpu.source, gpu.id
        assert gpu.typical_node is not None, gpu.id
        assert gpu.typical_node.gpus_per_node >= 1


def test_cpu_pseudo_device_says_it_is_for_tests_only():
    assert "tests only" in find_gpu("cpu").source


def test_load_gpus_is_cached():
    assert load_gpus() is load_gpus()


def test_gpu_is_hashable_for_use_as_cache_key():
    assert len({find_gpu("A100"), find_gpu("a100-sxm-80gb")}) == 1


def test_peak_flops_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="int4"):
        find_gpu("A100").peak_flops("int4")


def test_find_gpu_unknown_name_raises_with_close_matches_in_hint():
    with pytest.raises(UnknownGPU) as info:
        find_gpu("H10")
    assert isinstance(info.value, FitplanError)
    assert "H100" in info.value.hint
    assert "a100-sxm-80gb" in info.value.hint  # the full list of ids


def _catalog_text(**changes: object) -> str:
    record = {
        "id": "x1", "name": "X1", "aliases": ["X"], "vendor": "nvidia", "arch": "hopper", "memory_gib": 80,
        "hbm_bandwidth_gbps": 3000, "tflops_dense": {d: 1.0 for d in DTYPES},
        "intra_node": {"kind": "nvlink4", "uni_gbps": 450, "nvswitch": True},
        "host_link": {"pcie_gen": 5, "uni_gbps": 63}, "source": "test",
    }
    record.update(changes)
    return json.dumps([record])


def test_catalog_from_json_accepts_a_minimal_record():
    assert catalog_from_json(_catalog_text(), origin="t.json")["x1"].memory_bytes == 80 * GIB


@pytest.mark.parametrize(
    "changes",
    [
        {"colour": "green"},  # unknown key
        {"arch": "kepler"},
        {"memory_gib": -1},
        {"tflops_dense": {"fp32": 1.0}},  # dtypes missing
        {"intra_node": {"kind": "nvlink4", "uni_gbps": 450}},  # nvswitch missing
    ],
)
def test_catalog_from_json_rejects_malformed_record_naming_the_file(changes):
    with pytest.raises(ValueError, match=r"t\.json"):
        catalog_from_json(_catalog_text(**changes), origin="t.json")


def test_catalog_from_json_rejects_a_name_shared_by_two_gpus():
    records = json.loads(_catalog_text()) + json.loads(_catalog_text(id="x2", name="X2"))  # both alias "X"
    with pytest.raises(ValueError, match="names both"):
        catalog_from_json(json.dumps(records), origin="t.json")


def test_catalog_from_json_rejects_invalid_json():
    with pytest.raises(ValueError, match="malformed"):
        catalog_from_json("[{", origin="t.json")
