"""The probe shapes every lowering traces at, and each runtime's cache key: computable without importing the tracing
code (torch and the runtimes' libraries), so a lowering found in the cache imports none of it."""

from __future__ import annotations

from importlib.metadata import version

from .adapters import LoraSpec
from .cache import cache_key
from .sources import ResolvedModel

# Probe shapes: (b0, s0), (b0, 2*s0), (b0, 3*s0), (2*b0, s0) and the widened model. Small shapes trace as fast as
# large ones and are exact because every size is a monomial in b and s (checked when fitting, `fit.py`).
PROBE_BATCH = 2
PROBE_SEQ = 32
WIDEN_FACTOR = 2
# Bump when a runtime's lowering changes what it records, so that its stale cache entries are ignored.
TITAN_FORMAT = 2  # 2: RoPE caches as per-layer module buffers (LayerGraph.layer_buffers)
MEGATRON_FORMAT = 4


def hf_key(resolved: ResolvedModel, *, dtype: str, autocast: str | None, attention: str | None,
           lora: LoraSpec | None, op_selective: bool, compiled: bool, liger: bool,
           kbit: tuple[str, ...] | None = None) -> str:
    """The cache entry of a lowering of the Hugging Face modeling code (`lowering.lower_resolved`); `kbit` (PEFT's
    prepare_model_for_kbit_training and the modules cast back) is a variant of its own."""
    prepared = () if kbit is None else ("kbit:" + ",".join(kbit),)
    return cache_key(resolved.as_dict(), dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                     probes=(PROBE_BATCH, PROBE_SEQ, WIDEN_FACTOR) + ((1,) if op_selective else ()),
                     variants=(("compiled",) if compiled else ("liger",) if liger else ()) + prepared)


def titan_key(resolved: ResolvedModel, *, dtype: str, loss: str, compiled: bool) -> str:
    """The cache entry of a lowering of torchtitan's model code (`titan.lower_titan_resolved`)."""
    return cache_key(resolved.as_dict(), dtype=dtype, autocast=None, attention=f"torchtitan/{loss}", lora=None,
                     probes=(PROBE_BATCH, PROBE_SEQ, WIDEN_FACTOR, TITAN_FORMAT, titan_version_tag()),
                     variants=("compiled",) if compiled else ())


def megatron_key(resolved: ResolvedModel, *, dtype: str, kernels: str) -> str:
    """The cache entry of a lowering of megatron-core's GPT layers (`megatron.lower_megatron_resolved`)."""
    return cache_key(resolved.as_dict(), dtype=dtype, autocast=None, attention=f"megatron/{kernels}", lora=None,
                     probes=(PROBE_BATCH, PROBE_SEQ, WIDEN_FACTOR, MEGATRON_FORMAT, version("megatron-core")))


def titan_version_tag() -> int:
    """torchtitan's release as 1000 x major + minor (its model code changes between minor releases)."""
    major, minor, *_ = (int(p) for p in version("torchtitan").split(".")[:3] if p.isdigit())
    return 1000 * major + minor
