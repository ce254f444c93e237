"""A cluster: which GPU, how many, in how many nodes, and the links and host resources around them.

`parse_cluster("2x8xH100")` takes what a string leaves out from the GPU's typical node in the catalog and
records each such default in `Cluster.assumptions`; `load_cluster_file` reads the same from JSON or YAML.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, ClassVar

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from costmodels.config import require_positive_int
from costmodels.hardware import GB, GIB, GPU, GPURecord, NodeRecord, find_gpu, gpu_from_record, load_gpus
from costmodels.identity_memo import IdentityMemo
from costmodels.profile import InvalidProfile, Profile
from graphs.errors import FitplanError
from graphs.files import UnreadableFile, check_depth, parse_yaml, read_text

# COUNTxGPU, NODESxPER_NODExGPU or GPU. A name starts with a letter, so "8xA100" never reads as a name.
_SPEC = re.compile(r"\s*(?:(\d+)\s*[x×]\s*)?(?:(\d+)\s*[x×]\s*)?([a-z][\w .\-]*?)\s*", re.IGNORECASE)
_FILE_HINT = ("A cluster file holds 'gpus' (e.g. 2x8xH100) or 'gpu' (a catalog name or a custom record as in "
              "costmodels/data/gpus.json), and optional keys of parse_cluster (nodes, gpus_per_node, ...).")


# Bounds of the options, far above any real node, so a typo is refused rather than planned (or overflowing):
# the largest 8-socket hosts take 32 TiB of RAM and 960 cores; NDR InfiniBand moves 50 GB/s per port and a PCIe 5
# x16 NVMe array about 64 GB/s; the largest clusters hold ~100,000 GPUs.
MAX_NODES = 2**17
MAX_GPUS_PER_NODE = 1024
MAX_CPU_RAM_GIB = 65536.0
MAX_CPU_CORES = 4096
MAX_GBPS = 10_000.0


class InvalidCluster(FitplanError):
    """A cluster string, option or file that cannot be read."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """The hardware a plan runs on: identical GPUs, `gpus_per_node` in each of `nodes` nodes."""

    gpu: GPU
    """The GPU in every slot."""
    nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """GPUs in each node."""
    inter_node_bandwidth: float
    """Compute-fabric bytes/s per GPU per direction (may be 0 for one node)."""
    cpu_ram_per_node: int
    """Host RAM per node, bytes."""
    cpu_cores_per_node: int
    """Physical CPU cores per node."""
    nvme_bandwidth: float = 0.0
    """NVMe read bytes/s per node; 0 means no NVMe offload."""
    assumptions: tuple[str, ...] = ()
    """Defaults the parser chose, in words, for display and the plan's JSON."""
    profile: Profile | None = None
    """Rates measured on this machine by `fitplan measure`; they replace datasheet constants (see profile.py)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "cpu_ram_per_node", "cpu_cores_per_node"):
            require_positive_int(name, getattr(self, name))
        for name in ("inter_node_bandwidth", "nvme_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{name}={value!r} must be a non-negative number of bytes/s")
        if self.nodes > 1 and self.inter_node_bandwidth <= 0:
            raise ValueError(f"inter_node_bandwidth={self.inter_node_bandwidth!r} must be > 0 across nodes")

    @property
    def world_size(self) -> int:
        """Total GPUs (torch ranks)."""
        return self.nodes * self.gpus_per_node


# The representatives `node_view` returns, by their own value (one per GPU, node shape, links and host).
_VIEWS: dict[Cluster, Cluster] = {}
_VIEW_OF: IdentityMemo[Cluster] = IdentityMemo(limit=256)


def node_view(cluster: Cluster) -> Cluster:
    """One representative of every cluster that differs from `cluster` only in its node count and notes: what a
    cost that reads a node's GPUs, links and host, never `nodes`, is cached on, so that the clusters of a sweep
    (`fitplan choose`: 16, 24, ... 64 GPUs in nodes of 8) share it. Of a cluster's fields the cost models read
    `nodes` only for its world size (`estimator.check`, MFU); `tests/costmodels/test_node_view.py` checks that
    the per-node costs cached on the view agree across node counts."""
    def representative() -> Cluster:
        view = replace(cluster, nodes=1, assumptions=())
        return _VIEWS.setdefault(view, view)

    return _VIEW_OF.get((cluster,), (), representative)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterOptions:
    """What a cluster string leaves out; None takes the GPU's typical node from the catalog."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    nodes: Annotated[int, Field(ge=1, le=MAX_NODES)] | None = None
    """Number of nodes."""
    gpus_per_node: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)] | None = None
    """GPUs in each node."""
    inter_node_gbps: Annotated[float, Field(ge=0, le=MAX_GBPS, allow_inf_nan=False)] | None = None
    """Compute-fabric GB/s per GPU per direction."""
    cpu_ram_gib: Annotated[float, Field(gt=0, le=MAX_CPU_RAM_GIB, allow_inf_nan=False)] | None = None
    """Host RAM per node, GiB."""
    cpu_cores: Annotated[int, Field(ge=1, le=MAX_CPU_CORES)] | None = None
    """Physical CPU cores per node."""
    nvme_gbps: Annotated[float, Field(ge=0, le=MAX_GBPS, allow_inf_nan=False)] | None = None
    """NVMe read GB/s per node; 0 for none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterFile(ClusterOptions):
    """A cluster file (JSON or YAML): exactly one of `gpus` and `gpu`, plus options."""

    gpus: str | None = None
    """A cluster string as on the command line, e.g. "2x8xH100"."""
    gpu: str | GPURecord | None = None
    """A catalog GPU name or a custom GPU record; nodes and gpus_per_node (default 1) give the count."""


def parse_cluster(spec: str, *, nodes: int | None = None, gpus_per_node: int | None = None,
                  inter_node_gbps: float | None = None, cpu_ram_gib: float | None = None,
                  nvme_gbps: float | None = None, cpu_cores: int | None = None) -> Cluster:
    """The cluster "8xA100", "16xH100", "2x8xH100" or "A100" names; each option overrides a default."""
    given = dict(nodes=nodes, gpus_per_node=gpus_per_node, inter_node_gbps=inter_node_gbps,
                 cpu_ram_gib=cpu_ram_gib, nvme_gbps=nvme_gbps, cpu_cores=cpu_cores)
    try:
        options = TypeAdapter(ClusterOptions).validate_python(given)
    except ValidationError as err:
        raise InvalidCluster(f"Invalid cluster options: {_problems(err)}.", "Options are positive.") from err
    return _from_spec(spec, options)


def load_cluster_file(path: str | Path) -> Cluster:
    """The cluster a JSON or YAML file describes (see `ClusterFile`); every error names the file."""
    path = Path(path)
    try:
        content = TypeAdapter(ClusterFile).validate_python(_read_mapping(path))
    except ValidationError as err:
        raise InvalidCluster(f"Cluster file {path} is invalid: {_problems(err)}.", _FILE_HINT) from err
    if (content.gpus is None) == (content.gpu is None):
        raise InvalidCluster(f"Cluster file {path} must give exactly one of 'gpus' and 'gpu'.", _FILE_HINT)
    try:
        if isinstance(content.gpu, GPURecord):
            return _from_record(content.gpu, content, origin=str(path))
        return _from_spec(content.gpus or str(content.gpu), content)
    except FitplanError as err:
        raise type(err)(f"In cluster file {path}: {err.message}", err.hint) from err


def with_profile(cluster: Cluster, profile: Profile, *, origin: str) -> Cluster:
    """`cluster` timed with `profile`'s measurements; the profile must describe the cluster's GPU."""
    if profile.gpu != cluster.gpu.id:
        raise InvalidProfile(f"Profile {origin} was measured on {profile.gpu} ({profile.device_name}), "
                             f"not on the cluster's {cluster.gpu.id}.",
                             "Use a profile measured on this GPU, or drop --profile.")
    note = f"timing from profile {origin} ({profile.device_name} x{profile.devices}, {profile.created[:10]})"
    return replace(cluster, profile=profile, assumptions=(*cluster.assumptions, note))


def describe_cluster(cluster: Cluster) -> str:
    """One line for display: "2 nodes x 8 x H100 SXM5 80GB (16 GPUs of 80 GiB; nvlink4 ...)"."""
    gpu, nodes = cluster.gpu, cluster.nodes
    parts = [f"{cluster.world_size} GPU{'s' * (cluster.world_size > 1)} of {gpu.memory_bytes / GIB:g} GiB",
             f"{gpu.intra_node_kind} {gpu.intra_node_bandwidth / GB:g} GB/s per direction"]
    if nodes > 1:
        parts.append(f"inter-node {cluster.inter_node_bandwidth / GB:g} GB/s per GPU per direction")
    return f"{nodes} node{'s' * (nodes > 1)} x {cluster.gpus_per_node} x {gpu.name} ({'; '.join(parts)})"


def _forms_hint() -> str:
    return ("Write COUNTxGPU (8xA100, 16xH100), NODESxPER_NODExGPU (2x8xH100) or a GPU name alone (A100 = "
            f"one GPU); 'x', 'X' and '×' all separate. Catalog GPUs: {', '.join(load_gpus())}.")


def _from_spec(spec: str, options: ClusterOptions) -> Cluster:
    match = _SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if match is None or re.match(r"[x×]\s*\d", match.group(3), re.IGNORECASE):
        raise InvalidCluster(f"Cannot read cluster {spec!r}.", _forms_hint())
    if any(count is not None and int(count) < 1 for count in match.groups()[:2]):
        raise InvalidCluster(f"Cluster {spec!r} has a zero count; counts must be at least 1.", _forms_hint())
    gpu = find_gpu(name := match.group(3))
    assumptions = [] if name.lower() in {gpu.id, gpu.name.lower()} else \
        [f"{name} means {gpu.name} (name the exact GPU, e.g. {gpu.id}, for another)"]
    layout = _layout(spec.strip(), match.groups(), options, gpu, assumptions)
    return _assemble(gpu, layout, options, assumptions)


def _from_record(record: GPURecord, options: ClusterOptions, *, origin: str) -> Cluster:
    ram, cores, inter = options.cpu_ram_gib, options.cpu_cores, options.inter_node_gbps
    layout = (options.nodes or 1, options.gpus_per_node or 1)
    if record.node_typical is None:  # then the options alone say what the host and network are
        if ram is None or cores is None or (inter is None and layout[0] > 1):
            raise InvalidCluster(f"Custom GPU {record.name} has no node_typical: host and network unknown.",
                                 "Give node_typical, or cpu_ram_gib, cpu_cores and inter_node_gbps.")
        record = replace(record, node_typical=NodeRecord(
            name="options", gpus_per_node=1, inter_node_gbps_per_gpu=0, host_ram_gib=ram, cpu_cores=cores))
    try:
        gpu = gpu_from_record(replace(record, source=record.source or f"custom GPU in {origin}"))
    except ValueError as err:
        raise InvalidCluster(str(err), _FILE_HINT) from err
    return _assemble(gpu, layout, options, [f"custom GPU {gpu.name} from {origin}"])


def _layout(spec: str, groups: tuple[str | None, ...], options: ClusterOptions, gpu: GPU,
            assumptions: list[str]) -> tuple[int, int]:
    """Nodes and GPUs per node from the string's counts, the options or the typical node (noted)."""
    first, second, name = groups
    nodes, per_node = options.nodes, options.gpus_per_node
    if first is not None and second is not None:
        explicit = (int(first), int(second))
        if (nodes or explicit[0], per_node or explicit[1]) != explicit:
            raise InvalidCluster(f"{spec!r} conflicts with nodes={nodes}, gpus_per_node={per_node}.",
                                 "Give the layout once, in the string or in the options.")
        return explicit
    if first is None:  # a GPU name alone: one GPU unless the options say more
        return nodes or 1, per_node or 1
    count = int(first)
    if nodes is not None or per_node is not None:
        p = per_node if per_node is not None else count // (nodes or 1)
        n = nodes if nodes is not None else count // p
        if n * p != count:
            raise InvalidCluster(f"{spec!r} does not split into nodes={n} of gpus_per_node={p}.",
                                 "Pick options whose product is the GPU count.")
        return n, p
    typical = gpu.typical_node
    if typical is None or count <= typical.gpus_per_node:
        if count > 1 and typical is not None:
            assumptions.append(f"{count} GPUs in one node (up to {typical.gpus_per_node}: {typical.name}; "
                               "--gpus-per-node to change)")
        return 1, count
    per = typical.gpus_per_node
    if count % per:
        fit = max(d for d in (1, 2, 4, 8, 16, 32, 64) if d <= per and count % d == 0)
        raise InvalidCluster(f"{spec} is not a whole number of {per}-GPU nodes.",
                             f"Write {count // fit}x{fit}x{name} or pass --gpus-per-node {fit}.")
    assumptions.append(f"{count} GPUs = {count // per} nodes of {per} ({typical.name}; --gpus-per-node to change)")
    return count // per, per


def _assemble(gpu: GPU, layout: tuple[int, int], options: ClusterOptions, assumptions: list[str]) -> Cluster:
    node, o = gpu.typical_node, options
    if node is None:
        raise InvalidCluster(f"{gpu.name} has no typical node.", "Give node_typical in its record.")
    if o.inter_node_gbps is None and layout[0] > 1:
        bandwidth = f"{node.inter_node_gbps_per_gpu:g} GB/s per GPU per direction"
        assumptions.append(f"inter-node {bandwidth} ({node.name}; --inter-node-gbps to change)")
    share = min(1.0, layout[1] / node.gpus_per_node)  # a smaller host carries its share of the typical node
    ram = typical_share(node.host_ram_gib, share) if o.cpu_ram_gib is None else o.cpu_ram_gib
    cores = max(1, int(node.cpu_cores * share)) if o.cpu_cores is None else o.cpu_cores
    said = [f"{ram:g} GiB RAM"] * (o.cpu_ram_gib is None) + [f"{cores} CPU cores"] * (o.cpu_cores is None)
    if said:
        whose = node.name if share == 1 else f"{layout[1]}/{node.gpus_per_node} of {node.name}"
        flags = " and ".join(["--cpu-ram-gib"] * (o.cpu_ram_gib is None) + ["--cpu-cores"] * (o.cpu_cores is None))
        assumptions.append(f"host {' and '.join(said)} per node ({whose}; {flags} to change)")
    if o.nvme_gbps is None:
        assumptions.append(f"NVMe {node.nvme_gbps:g} GB/s per node ({node.name}; --nvme-gbps to change)"
                           if node.nvme_gbps else "no NVMe offload (NVMe bandwidth unknown; --nvme-gbps allows it)")
    inter = node.inter_node_gbps_per_gpu if o.inter_node_gbps is None else o.inter_node_gbps
    nvme = node.nvme_gbps if o.nvme_gbps is None else o.nvme_gbps
    try:
        return Cluster(gpu=gpu, nodes=layout[0], gpus_per_node=layout[1], inter_node_bandwidth=inter * GB,
                       cpu_ram_per_node=round(ram * GIB), cpu_cores_per_node=cores, nvme_bandwidth=nvme * GB,
                       assumptions=tuple(assumptions))
    except ValueError as err:
        raise InvalidCluster(f"Invalid cluster: {err}.", _forms_hint()) from err


def typical_share(host_ram_gib: float, share: float) -> float:
    """Host RAM of a node with `share` of the typical node's GPUs: proportional, as cloud instance families
    scale (e.g. AWS g5: 8 A10G with 768 GiB, 4 with 192-384 GiB, 1 with 16-256 GiB), rounded down to 8 GiB."""
    return host_ram_gib if share >= 1 else max(8.0, 8 * math.floor(host_ram_gib * share / 8))


def _read_mapping(path: Path) -> object:
    try:  # a regular file of at most 16 MiB, nested at most 32 levels (graphs.files)
        text = read_text(path, what="cluster file")
        data = json.loads(text) if path.suffix.lower() == ".json" else parse_yaml(text, where=f"Cluster file {path}")
        check_depth(data, where=f"Cluster file {path}")
    except UnreadableFile as err:
        raise InvalidCluster(err.message, _FILE_HINT) from err
    except (RecursionError, ValueError, yaml.YAMLError) as err:  # JSONDecodeError is a ValueError
        raise InvalidCluster(f"Cluster file {path} is not valid JSON or YAML: {err}", _FILE_HINT) from err
    if not isinstance(data, dict):
        raise InvalidCluster(f"Cluster file {path} must hold a mapping of keys.", _FILE_HINT)
    return data


def _problems(err: ValidationError) -> str:
    unknown = ("extra_forbidden", "unexpected_keyword_argument")  # the latter for stdlib dataclasses
    found = [(".".join(map(str, e["loc"])), e["msg"], e["type"], repr(e.get("input"))[:40]) for e in err.errors()]
    return "; ".join(f"unknown key {at!r}" if t in unknown else f"{at}: {m} (got {got})" for at, m, t, got in found)
