"""graphs: a model name to its layer graph, with exact per-layer parameters, activations and FLOPs.

Knows nothing of GPUs. `lower(model)` is the entry point; the catalog of published configs ships as data.
The names load on first use (`exports.py`): importing one does not import the lowering code.
"""

from __future__ import annotations

from .exports import lazy_exports

_WHERE = {
    "Checkpoint": "graphs.layer",
    "FitplanError": "graphs.errors",
    "Layer": "graphs.layer",
    "LayerGraph": "graphs.graph",
    "LoraSpec": "graphs.adapters",
    "MalformedConfig": "graphs.errors",
    "MoE": "graphs.layer",
    "ModeCost": "graphs.layer",
    "ModelDims": "graphs.graph",
    "ParamTensor": "graphs.layer",
    "PeakPoly": "graphs.poly",
    "Poly": "graphs.poly",
    "Quantization": "graphs.adapters",
    "ResolvedModel": "graphs.sources",
    "Role": "graphs.layer",
    "UnknownModel": "graphs.errors",
    "UnsupportedModel": "graphs.errors",
    "Work": "graphs.layer",
    "catalog_ids": "graphs.catalog",
    "load_entry": "graphs.catalog",
    "lower": "graphs.lowering",
    "resolve": "graphs.sources",
}
__all__ = [
    "Checkpoint",
    "FitplanError",
    "Layer",
    "LayerGraph",
    "LoraSpec",
    "MalformedConfig",
    "MoE",
    "ModeCost",
    "ModelDims",
    "ParamTensor",
    "PeakPoly",
    "Poly",
    "Quantization",
    "ResolvedModel",
    "Role",
    "UnknownModel",
    "UnsupportedModel",
    "Work",
    "catalog_ids",
    "load_entry",
    "lower",
    "resolve",
]
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
