"""The GPU catalog: one frozen `GPU` per device kind, in SI units, validated from `data/gpus.json`.

The file keeps vendor units (GiB, GB/s, dense TFLOP/s) and a cited source per record. Clusters: `cluster.py`.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import ClassVar, Literal

from pydantic import ConfigDict, NonNegativeFloat, PositiveFloat, PositiveInt, TypeAdapter, ValidationError

from graphs.errors import FitplanError

# Vendors print GiB-sized device memory as "GB" (ml-engineering compute/accelerator): labels are read as GiB,
# and used only where no driver-reported figure (`memory_mib`) was found.
GIB, MIB = 2**30, 2**20
# Bandwidths in the data file are decimal GB/s, and FLOP rates are decimal TFLOP/s.
GB, TERA = 1e9, 1e12

Dtype = Literal["fp32", "tf32", "fp16", "bf16", "fp8"]
DTYPES: tuple[Dtype, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")
Arch = Literal["volta", "turing", "ampere", "ada", "hopper", "blackwell", "cdna2", "cdna3", "cpu"]
LinkKind = Literal["nvlink2", "nvlink3", "nvlink4", "nvlink5", "nvlink-bridge",
                   "pcie3", "pcie4", "pcie5", "xgmi", "loopback"]
_RECORD_CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class UnknownGPU(FitplanError):
    """The GPU name is neither a catalog id nor an alias."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IntraNodeRecord:
    """The GPU-to-GPU link inside a node."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    kind: LinkKind
    """Link generation, e.g. "nvlink4", "pcie4", "xgmi"."""
    uni_gbps: PositiveFloat
    """GB/s per GPU per direction (vendors usually print both directions summed)."""
    nvswitch: bool
    """True when a switch gives every pair of GPUs the full bandwidth."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLinkRecord:
    """The GPU-to-CPU link."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    pcie_gen: PositiveInt | None
    """PCIe generation of the x16 slot; null for a non-PCIe host link."""
    uni_gbps: PositiveFloat
    """GB/s per direction."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRecord:
    """The node this GPU usually comes in; the defaults of `parse_cluster`."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    name: str
    """Reference system, with what is assumed rather than sourced."""
    gpus_per_node: PositiveInt
    """GPUs in one node."""
    inter_node_gbps_per_gpu: NonNegativeFloat
    """Compute-fabric GB/s per GPU per direction (node NIC bandwidth / GPUs)."""
    host_ram_gib: PositiveFloat
    """CPU RAM per node, GiB."""
    cpu_cores: PositiveInt
    """Physical CPU cores per node."""
    nvme_gbps: NonNegativeFloat = 0.0
    """NVMe read GB/s per node; 0 when not known."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GPURecord:
    """One record of `data/gpus.json`, or a custom GPU in a cluster file."""
    __pydantic_config__: ClassVar[ConfigDict] = _RECORD_CONFIG
    id: str
    """Stable lowercase id, e.g. "a100-sxm-80gb"."""
    name: str
    """Display name."""
    aliases: tuple[str, ...] = ()
    """Other names users type; matched ignoring case, spaces, '-' and '_'."""
    vendor: Literal["nvidia", "amd", "cpu"]
    """Vendor."""
    arch: Arch
    """Architecture family."""
    memory_gib: PositiveFloat
    """Device memory as the vendor labels it ("80GB"), read as GiB; the capacity only when `memory_mib` is null."""
    memory_mib: PositiveInt | None = None
    """Total memory as the driver reports it, MiB: CUDA's total (torch `total_memory`, deviceQuery) where a report
    was found, else nvidia-smi `memory.total` (rocm-smi for AMD); null where no driver figure was found."""
    memory_source: str = ""
    """Where `memory_mib` comes from (the page or issue showing it), or why the label is used instead."""
    hbm_bandwidth_gbps: PositiveFloat
    """Device memory bandwidth, GB/s (HBM or GDDR)."""
    tflops_dense: dict[Dtype, NonNegativeFloat | None]
    """Dense (not 2:4 sparse) peak TFLOP/s for each of fp32, tf32, fp16, bf16, fp8; null where unsupported."""
    intra_node: IntraNodeRecord
    """GPU-to-GPU link."""
    host_link: HostLinkRecord
    """GPU-to-CPU link."""
    node_typical: NodeRecord | None = None
    """The usual node, if there is one."""
    source: str = ""
    """Where the numbers come from."""
    note: str = ""
    """Caveats: uncertain, derived or conflicting figures."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GPU:
    """One accelerator kind (one torch device), in SI units."""
    id: str
    """Stable lowercase id, e.g. "a100-sxm-80gb"."""
    name: str
    """Display name, e.g. "A100 SXM4 80GB"."""
    aliases: tuple[str, ...]
    """Other names users type."""
    vendor: str
    """Vendor: nvidia, amd or cpu."""
    arch: Arch
    """Architecture family."""
    memory_bytes: int
    """Device memory, bytes: the driver-reported total where the catalog has one, else the vendor's label as GiB."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    flops: tuple[tuple[Dtype, float | None], ...]
    """Dense peak FLOP/s per dtype, None where unsupported; read it with `peak_flops`."""
    intra_node_kind: LinkKind
    """GPU-to-GPU link inside a node."""
    intra_node_bandwidth: float
    """GPU-to-GPU bytes/s per GPU per direction."""
    nvswitch: bool
    """True when a switch gives every pair of GPUs the full bandwidth."""
    host_bandwidth: float
    """GPU-to-CPU bytes/s per direction."""
    typical_node: NodeRecord | None
    """The usual node, in the data file's units (GB/s, GiB): `parse_cluster`'s defaults."""
    source: str
    """Where the numbers come from."""
    note: str = ""
    """Caveats: uncertain, derived or conflicting figures."""
    memory_source: str = ""
    """Where `memory_bytes` comes from: a cited driver report, or the datasheet label when none was found."""

    def peak_flops(self, dtype: str) -> float | None:
        """Dense peak FLOP/s for `dtype` ("fp32", "tf32", "fp16", "bf16", "fp8"), or None if unsupported."""
        flops = dict(self.flops)
        if dtype.lower() not in flops:
            raise ValueError(f"dtype {dtype!r} must be one of {', '.join(DTYPES)}")
        return flops[dtype.lower()]


def gpu_from_record(record: GPURecord) -> GPU:
    """The GPU a validated record describes, in bytes, bytes/s and FLOP/s."""
    tflops = record.tflops_dense
    if set(tflops) != set(DTYPES):
        raise ValueError(f"GPU {record.id!r}: tflops_dense needs exactly the keys {', '.join(DTYPES)}")
    return GPU(
        id=record.id, name=record.name, aliases=record.aliases, vendor=record.vendor, arch=record.arch,
        memory_bytes=capacity_bytes(record), hbm_bandwidth=record.hbm_bandwidth_gbps * GB,
        flops=tuple((d, None if tflops[d] is None else tflops[d] * TERA) for d in DTYPES),
        intra_node_kind=record.intra_node.kind, intra_node_bandwidth=record.intra_node.uni_gbps * GB,
        nvswitch=record.intra_node.nvswitch, host_bandwidth=record.host_link.uni_gbps * GB,
        typical_node=record.node_typical, source=record.source, note=record.note, memory_source=record.memory_source,
    )


def capacity_bytes(record: GPURecord) -> int:
    """The capacity a process gets: the driver's MiB figure when cited, else the "GB" label read as GiB."""
    return record.memory_mib * MIB if record.memory_mib is not None else round(record.memory_gib * GIB)


def name_key(name: str) -> str:
    """The form names are matched in: lowercase, without spaces, '-' or '_'."""
    return re.sub(r"[\s\-_]", "", name.lower())


def catalog_from_json(text: str, *, origin: str) -> dict[str, GPU]:
    """GPUs keyed by id from catalog JSON; raises ValueError naming `origin` when the data is malformed."""
    try:
        gpus = [gpu_from_record(r) for r in TypeAdapter(list[GPURecord]).validate_python(json.loads(text))]
    except (ValueError, ValidationError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"GPU catalog {origin} is malformed: {err}") from err
    owners: dict[str, str] = {}
    for gpu in gpus:
        for name in (gpu.id, gpu.name, *gpu.aliases):
            if owners.setdefault(name_key(name), gpu.id) != gpu.id:
                raise ValueError(f"GPU catalog {origin}: {name!r} names both {gpu.id!r} and another GPU")
    return {gpu.id: gpu for gpu in gpus}


@lru_cache(maxsize=1)
def load_gpus() -> dict[str, GPU]:
    """Every catalog GPU keyed by id (cached: treat as read-only)."""
    text = resources.files("costmodels").joinpath("data/gpus.json").read_text(encoding="utf-8")
    return catalog_from_json(text, origin="costmodels/data/gpus.json")


def find_gpu(name: str) -> GPU:
    """The catalog GPU with this id, display name or alias, ignoring case, spaces, '-' and '_'."""
    index = {name_key(n): gpu for gpu in load_gpus().values() for n in (gpu.id, gpu.name, *gpu.aliases)}
    if (gpu := index.get(name_key(name))) is not None:
        return gpu
    typed = {name_key(n): n for g in load_gpus().values() for n in (*g.aliases, g.id)}
    close = [typed[k] for k in difflib.get_close_matches(name_key(name), list(typed), n=3, cutoff=0.5)]
    hint = f"Did you mean {' or '.join(close)}? " if close else ""
    raise UnknownGPU(f"Unknown GPU {name!r}.", f"{hint}Known GPUs: {', '.join(load_gpus())}.")
