"""graphs: a model name to its layer graph, with exact per-layer parameters, activations and FLOPs.

Knows nothing of GPUs. `lower(model)` is the entry point; the catalog of published configs ships as data.
"""

from .adapters import LoraSpec, Quantization
from .catalog import catalog_ids, load_entry
from .errors import FitplanError, MalformedConfig, UnknownModel, UnsupportedModel
from .graph import LayerGraph, ModelDims
from .layer import Checkpoint, Layer, ModeCost, MoE, ParamTensor, Role, Work
from .lower import lower
from .poly import PeakPoly, Poly
from .sources import ResolvedModel, resolve

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
