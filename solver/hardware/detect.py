"""`--gpus auto`: the local GPUs as a `Cluster`, from torch.cuda and NVML (`pip install 'fitplan[gpu]'`).

The device name maps to a catalog GPU; the driver's memory, the NVLink/PCIe links NVML reports and the host's
RAM and cores replace the catalog's typical node. Each detected value is recorded in `Cluster.assumptions`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace
from typing import Any

from costmodels import Cluster, UnknownGPU, load_gpus
from costmodels.hardware import GB, GIB, GPU, name_key
from graphs import FitplanError

# Prefixes drivers put before the product name ("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-32GB").
_VENDOR_PREFIXES = ("nvidia", "tesla", "geforce", "amdinstinct", "amd")
# Per-direction PCIe x16 bandwidth by generation, GB/s (PCI-SIG: 8, 16, 32, 64 GT/s x 16 lanes, 128b/130b).
PCIE_X16_GBPS = {3: 15.75, 4: 31.5, 5: 63.0, 6: 121.0}


class NoGPU(FitplanError):
    """`--gpus auto` on a machine where torch sees no GPU."""


def detect_cluster() -> Cluster:
    """The GPUs of this node as a one-node cluster (torch.cuda for the count, NVML for names, memory, links)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise NoGPU(f"--gpus auto found no GPU: torch {torch.__version__} sees no CUDA device "
                    f"(built with CUDA {torch.version.cuda or 'none'}).",
                    "Name the cluster instead (e.g. --gpus 8xH100), or run on the GPU node with a CUDA build of torch.")
    count = torch.cuda.device_count()
    names = {torch.cuda.get_device_name(i) for i in range(count)}
    if len(names) > 1:
        raise FitplanError(f"--gpus auto found different GPUs ({', '.join(sorted(names))}).",
                           "fitplan plans for identical GPUs: pick some with CUDA_VISIBLE_DEVICES.")
    name = names.pop()
    nvml = _nvml()
    memory = _memory(nvml) if nvml else torch.cuda.get_device_properties(0).total_memory
    nvlinks = _nvlinks(nvml) if nvml else None
    gpu = catalog_gpu(name, memory=memory, nvlinks=nvlinks)
    notes = [f"detected {count} x {name} ({memory / GIB:.1f} GiB each, as the driver reports) = {gpu.name}"]
    gpu = replace(gpu, memory_bytes=memory)
    if nvml is None:
        notes.append("links from the catalog (NVML not installed: pip install 'fitplan[gpu]')")
    elif nvlinks == 0 and gpu.intra_node_kind.startswith("nvlink"):
        gen = _pcie_generation(nvml) or 4
        gpu = replace(gpu, intra_node_kind=f"pcie{min(max(gen, 3), 5)}", nvswitch=False,
                      intra_node_bandwidth=PCIE_X16_GBPS.get(gen, 31.5) * GB)
        notes.append(f"no active NVLink: GPUs talk over PCIe Gen{gen}")
    elif nvlinks:
        notes.append(f"{nvlinks} active NVLink links per GPU")
    ram, cores = host_memory_bytes(), physical_cores()
    notes.append(f"host {ram / GIB:.0f} GiB RAM and {cores} CPU cores (this machine)")
    return Cluster(gpu=gpu, nodes=1, gpus_per_node=count, inter_node_bandwidth=0.0, cpu_ram_per_node=ram,
                   cpu_cores_per_node=cores, assumptions=tuple(notes))


def catalog_gpu(name: str, *, memory: int, nvlinks: int | None = None) -> GPU:
    """The catalog GPU a driver-reported name means: its product family, then the nearest memory size and form
    factor ("PCIe" in the name, or SXM when the name says so or NVLink is active)."""
    key = name_key(name)
    for prefix in _VENDOR_PREFIXES:
        key = key.removeprefix(prefix)
    families = {gpu.id: min((name_key(n) for n in (*gpu.aliases, gpu.id)), key=len) for gpu in load_gpus().values()}
    matched = [f for f in families.values() if f in key]
    if not matched:
        raise UnknownGPU(f"--gpus auto found {name!r}, which is not in the GPU catalog.",
                         "Give a cluster file with a custom GPU record (see costmodels/data/gpus.json).")
    family = max(matched, key=len)  # "l40s" over "l4", "h100pcie" over "h100"
    form = "pcie" if "pcie" in key else ("sxm" if "sxm" in key or "hbm" in key or nvlinks else None)
    candidates = [gpu for gpu in load_gpus().values()
                  if any(family in name_key(n) for n in (gpu.id, gpu.name, *gpu.aliases))]
    return min(candidates, key=lambda g: (form is not None and form not in g.id and form not in name_key(g.name),
                                          abs(g.memory_bytes - memory)))


def driver_version() -> str | None:
    """The NVIDIA driver version NVML reports, or None without NVML."""
    nvml = _nvml()
    return None if nvml is None else _text(nvml.nvmlSystemGetDriverVersion())


def host_memory_bytes() -> int:
    """Physical RAM of this machine, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def physical_cores() -> int:
    """Physical CPU cores (distinct (socket, core) pairs in /proc/cpuinfo), else the logical count."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            pairs, socket = set(), ""
            for line in handle:
                field, _, value = line.partition(":")
                if field.strip() == "physical id":
                    socket = value.strip()
                elif field.strip() == "core id":
                    pairs.add((socket, value.strip()))
        return len(pairs) or os.cpu_count() or 1
    except OSError:
        return os.cpu_count() or 1


def _nvml() -> Any:
    """The initialised pynvml module (from nvidia-ml-py), or None when it is missing or finds no driver."""
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError when no driver is loaded
        return None
    return nvml


def _memory(nvml: Any) -> int:
    return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0)).total)


def _nvlinks(nvml: Any) -> int:
    """Active NVLink links of GPU 0 (0 on PCIe-only GPUs, where NVML raises NotSupported)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    active = 0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            active += nvml.nvmlDeviceGetNvLinkState(handle, link) == getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        except Exception:  # NVMLError_NotSupported / InvalidArgument past the last link
            break
    return active


def _pcie_generation(nvml: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(nvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
