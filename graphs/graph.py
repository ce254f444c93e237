"""`LayerGraph`: a lowered model as a networkx DiGraph of layers in execution order, with model-wide facts."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .adapters import LoraSpec
from .layer import Checkpoint, Layer, ModeCost, MoE, ParamTensor, Role, Work
from .poly import ZERO, Poly

if TYPE_CHECKING:  # networkx loads when a graph is built (0.1 s): `from graphs import LayerGraph` stays light
    import networkx as nx


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDims:
    """The architecture numbers that cost models and alignment checks read."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    experts: int = 0
    top_k: int = 0

    def moe_by_kind(self, expert_params: dict[int, int]) -> dict[int, MoE]:
        """The MoE facts of each layer kind whose routed experts hold `expert_params[kind]` elements (kinds with
        none are dense)."""
        if not self.experts:
            return {}
        return {kind: MoE(experts=self.experts, top_k=self.top_k, expert_params=count)
                for kind, count in expert_params.items() if count}


@dataclass(frozen=True, kw_only=True, eq=False)
class LayerGraph:
    """A model lowered for one dtype/attention/LoRA setting. Nodes carry `Layer` records under "layer"."""

    model: str
    """The name the user gave (catalog id, path or cached Hub id)."""
    source: str
    """Where the config came from: "catalog", "local" or "hf-cache"."""
    model_type: str
    architecture: str
    """The transformers class, e.g. LlamaForCausalLM."""
    layer_class: str = ""
    """The decoder-layer class, e.g. LlamaDecoderLayer (what FSDP wraps and checkpointing flags)."""
    dtype: str
    """Parameter dtype of the traced model (and compute dtype unless `autocast`)."""
    autocast: str | None
    """Compute dtype under torch.autocast (fp32 weights), or None."""
    attention: str
    """Attention implementation traced ("sdpa" runs as flash/memory-efficient attention on GPUs)."""
    lora: LoraSpec | None
    dims: ModelDims
    inputs: Poly = ZERO
    """Bytes of one micro-batch of token ids and labels."""
    shared: Poly = ZERO
    """Model-wide tensors the layers need in backward (e.g. rotary cos/sin), alive through the whole pass."""
    checkpoint_shared: Poly = ZERO
    """Model-wide tensors only checkpointed layers keep for backward (e.g. an attention mask): alive through
    the whole pass when some layer is checkpointed, else only through forward."""
    forward_shared: Poly = ZERO
    """Model-wide tensors the layers read but do not save (e.g. an eager attention mask): forward only."""
    layer_buffers: Poly = ZERO
    """Bytes of module buffers each decoder layer holds for the whole run (torchtitan's per-layer RoPE cache of
    `training.seq_len` positions): a rank holds them once, for the layers it runs, whatever its micro-batches."""
    tp_splits_activations: bool = False
    """Whether activations inside attention/MLP were measured per TP rank (a clean column/row-wise plan)."""
    tp_degrees: tuple[int, ...] = (1,)
    """Tensor-parallel degrees the model's TP plan and head counts allow."""
    published_params: int | None = None
    versions: tuple[tuple[str, str], ...] = ()
    runtime: str = "hf"
    """The code path traced: "hf" (transformers modeling code) or "torchtitan" (`graphs/titan.py`)."""
    layers: tuple[Layer, ...] = ()
    """Every node in execution order: each feeds the next (the data flow `graph` draws)."""
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def graph(self) -> nx.DiGraph:
        """The data flow as a networkx DiGraph, one node per layer (its `Layer` under "layer"): built when asked,
        since the cost models walk `nodes()` and a cached solve need not import networkx."""
        if "graph" not in self._memo:
            self._memo["graph"] = chain_graph(list(self.layers))
        return self._memo["graph"]

    def nodes(self) -> list[Layer]:
        """All nodes in execution order."""
        return list(self.layers)

    @property
    def liger(self) -> bool:
        """Traced with Liger-Kernel's patch (`graphs/liger.py`): its version is among the traced libraries'."""
        return any(package == "liger-kernel" for package, _ in self.versions)

    def node(self, name: str) -> Layer:
        if "by_name" not in self._memo:
            self._memo["by_name"] = {layer.name: layer for layer in self.layers}
        return self._memo["by_name"][name]

    def decoder_layers(self) -> list[Layer]:
        if "decoders" not in self._memo:  # the search asks for them per configuration
            self._memo["decoders"] = [layer for layer in self.nodes() if layer.role is Role.DECODER]
        return list(self._memo["decoders"])

    def params(self) -> list[ParamTensor]:
        return [p for layer in self.nodes() for p in layer.params]

    def tensor_groups(self, *, trainable: bool | None = None) -> tuple[tuple[ParamTensor, int], ...]:
        """Parameter tensors grouped by what their cost depends on (shape, TP split, role, dtype), with counts:
        a 70B model's ~700 tensors are a dozen groups, which keeps cost evaluation fast."""
        key = f"groups:{trainable}"
        if key not in self._memo:
            self._memo[key] = group_tensors(p for p in self.params() if trainable in (None, p.trainable))
        return self._memo[key]

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params())

    @property
    def trainable_count(self) -> int:
        return sum(p.numel for p in self.params() if p.trainable)

    def checkpoint_modes(self) -> tuple[Checkpoint, ...]:
        """Modes every decoder layer supports (the search asks per configuration)."""
        if "modes" not in self._memo:
            layers = self.decoder_layers()
            self._memo["modes"] = tuple(m for m in Checkpoint if all(m in layer.checkpoint_modes for layer in layers))
        return self._memo["modes"]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "source": self.source, "model_type": self.model_type,
            "architecture": self.architecture, "layer_class": self.layer_class, "dtype": self.dtype,
            "autocast": self.autocast,
            "attention": self.attention,
            "lora": self.lora.to_json() if self.lora else None, "dims": _slots_dict(self.dims),
            "inputs": self.inputs.to_json(), "shared": self.shared.to_json(),
            "checkpoint_shared": self.checkpoint_shared.to_json(), "forward_shared": self.forward_shared.to_json(),
            "tp_splits_activations": self.tp_splits_activations, "tp_degrees": list(self.tp_degrees),
            "published_params": self.published_params, "versions": dict(self.versions),
            # Layers of one kind share their costs: store them once per kind (fast cache loads).
            "kind_modes": {str(layer.kind): _modes_json(layer) for layer in reversed(self.decoder_layers())},
            "nodes": [_layer_json(layer) for layer in self.nodes()],
            # Written only when not "hf", so graphs cached before the field existed still round-trip.
            **({"runtime": self.runtime} if self.runtime != "hf" else {}),
            # Written only when some layer holds buffers, likewise.
            **({"layer_buffers": self.layer_buffers.to_json()} if self.layer_buffers else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerGraph:
        kind_modes = {int(kind): _modes_from_json(modes) for kind, modes in data["kind_modes"].items()}
        layers = [_layer_from_json(item, kind_modes) for item in data["nodes"]]
        return cls(
            model=data["model"], source=data["source"], model_type=data["model_type"],
            architecture=data["architecture"], layer_class=data["layer_class"], dtype=data["dtype"],
            autocast=data["autocast"],
            attention=data["attention"],
            lora=LoraSpec.from_json(data["lora"]) if data["lora"] else None, dims=ModelDims(**data["dims"]),
            inputs=Poly.from_json(data["inputs"]), shared=Poly.from_json(data["shared"]),
            checkpoint_shared=Poly.from_json(data["checkpoint_shared"]),
            forward_shared=Poly.from_json(data["forward_shared"]),
            layer_buffers=Poly.from_json(data["layer_buffers"]) if "layer_buffers" in data else ZERO,
            tp_splits_activations=data["tp_splits_activations"], tp_degrees=tuple(data["tp_degrees"]),
            published_params=data["published_params"], versions=tuple(sorted(data["versions"].items())),
            runtime=data.get("runtime", "hf"), layers=tuple(layers))


def group_tensors(tensors: Iterable[ParamTensor]) -> tuple[tuple[ParamTensor, int], ...]:
    """Identical-cost tensors counted once: (a representative, how many)."""
    counts: dict[tuple[Any, ...], list[Any]] = {}
    for t in tensors:
        key = (t.shape, t.tp_dim, t.trainable, t.itemsize, t.stored_bytes)
        if key in counts:
            counts[key][1] += 1
        else:
            counts[key] = [t, 1]
    return tuple((t, n) for t, n in counts.values())


def chain_graph(layers: list[Layer]) -> nx.DiGraph:
    """A DiGraph with one node per layer and an edge along each data-flow step."""
    import networkx as nx

    graph = nx.DiGraph()
    for layer in layers:
        graph.add_node(layer.name, layer=layer)
    for before, after in itertools.pairwise(layers):
        graph.add_edge(before.name, after.name)
    return graph


def _slots_dict(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__slots__}


def _layer_json(layer: Layer) -> dict[str, Any]:
    return {
        "name": layer.name, "role": layer.role.value, "index": layer.index, "kind": layer.kind,
        "params": [{**_slots_dict(p), "shape": list(p.shape)} for p in layer.params],
        "modes": None if layer.kind is not None else _modes_json(layer),
        "boundary": layer.boundary.to_json(), "tp_allreduces": layer.tp_allreduces,
        "moe": _slots_dict(layer.moe) if layer.moe else None,
    }


def _modes_json(layer: Layer) -> dict[str, Any]:
    return {mode.value: cost.to_json() for mode, cost in layer.modes}


def _modes_from_json(data: dict[str, Any]) -> tuple[tuple[Checkpoint, ModeCost], ...]:
    return tuple((Checkpoint(mode), ModeCost.from_json(cost)) for mode, cost in data.items())


def _layer_from_json(data: dict[str, Any], kind_modes: dict[int, tuple[tuple[Checkpoint, ModeCost], ...]]) -> Layer:
    return Layer(
        name=data["name"], role=Role(data["role"]), index=data["index"], kind=data["kind"],
        params=tuple(ParamTensor(**{**p, "shape": tuple(p["shape"])}) for p in data["params"]),
        modes=kind_modes[data["kind"]] if data["modes"] is None else _modes_from_json(data["modes"]),
        boundary=Poly.from_json(data["boundary"]), tp_allreduces=data["tp_allreduces"],
        moe=MoE(**data["moe"]) if data["moe"] else None,
    )


__all__ = ["LayerGraph", "ModelDims", "Work", "chain_graph"]
