"""`lower(model)`: resolve a model name and measure its layer graph on fake tensors (cached on disk).

Probes trace a few representative layers at four shapes (see `fit.py`); every decoder layer of a kind gets the
costs of its kind's trace layers. Nothing is allocated and nothing is downloaded.
"""

from __future__ import annotations

import functools

from .adapters import LoraSpec
from .assemble import assemble, eager_work
from .cache import cached_or_lowered
from .errors import UnsupportedModel
from .graph import LayerGraph
from .lowering_keys import PROBE_BATCH, PROBE_SEQ, WIDEN_FACTOR, hf_key
from .sources import ResolvedModel, resolve


def lower(model: str, *, dtype: str = "bfloat16", autocast: str | None = None, attention: str | None = None,
          lora: LoraSpec | None = None, use_cache: bool = True, op_selective: bool = False,
          runtime: str = "hf", compiled: bool = False, liger: bool = False,
          kbit: tuple[str, ...] | None = None) -> LayerGraph:
    """Lower `model` (catalog id, local path or cached Hub id) to its `LayerGraph`.

    `dtype` is the parameter dtype; `autocast` ("bfloat16"/"float16") runs forward under torch.autocast, as
    plain PyTorch mixed precision does with fp32 weights. `op_selective` also traces op-level SAC
    (`Checkpoint.OP_SELECTIVE`, torchtitan's policy as the generated torchrun script would pass it).
    `runtime` is the code that will run the plan: "hf" (transformers) or "torchtitan" (`titan.py`). `compiled`
    traces the un-checkpointed layers as torch.compile trains them (`compiled.py`: Inductor's partitioner decides
    what they save). `liger` traces the model as transformers' `use_liger_kernel` patches it (`liger.py`: Liger's
    RMSNorm, SwiGLU and RoPE kernels in the layers; the head keeps HF's loss, which costmodels replaces).
    `kbit` (4-bit bases only): the base as PEFT's `prepare_model_for_kbit_training` leaves it (every other 16-bit
    parameter in fp32), then the modules whose names contain one of these strings cast back to `dtype`, as the
    runtime that calls it does (`kbit.py`); None: not prepared.
    """
    if runtime == "torchtitan":
        if liger:
            raise ValueError("liger=True patches the transformers modeling code, not torchtitan's")
        return _lower_titan(model, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                            use_cache=use_cache)
    if runtime != "hf":
        raise ValueError(f"runtime={runtime!r} must be 'hf' or 'torchtitan'")
    resolved = resolve(model)
    return lower_resolved(resolved, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                          use_cache=use_cache, op_selective=op_selective, compiled=compiled, liger=liger, kbit=kbit)


def _lower_titan(model: str, *, dtype: str, autocast: str | None, attention: str | None, lora: LoraSpec | None,
                 use_cache: bool) -> LayerGraph:
    """torchtitan's model code: its own attention and checkpoint modes, FSDP2 mixed precision (no autocast)."""
    from .titan import lower_titan

    if lora is not None or autocast is not None or attention is not None:
        raise UnsupportedModel("torchtitan runs its own attention, without LoRA or torch.autocast",
                               "Drop --lora-rank / --attention, or plan for another launcher.")
    return lower_titan(model, dtype=dtype, use_cache=use_cache)


@functools.lru_cache(maxsize=64)
def lower_resolved(resolved: ResolvedModel, *, dtype: str = "bfloat16", autocast: str | None = None,
                   attention: str | None = None, lora: LoraSpec | None = None, use_cache: bool = True,
                   op_selective: bool = False, compiled: bool = False, liger: bool = False,
                   kbit: tuple[str, ...] | None = None) -> LayerGraph:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
    if autocast not in (None, "bfloat16", "float16"):
        raise ValueError(f"autocast={autocast!r} must be None, bfloat16 or float16")
    if liger and compiled:
        raise ValueError("liger=True with compiled=True: torch.compile over Liger's Triton kernels is not traced")
    if kbit is not None and (lora is None or not lora.four_bit):
        raise ValueError("kbit (PEFT's prepare_model_for_kbit_training) applies to 4-bit bases only (QLoRA)")
    key = hf_key(resolved, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                 op_selective=op_selective, compiled=compiled, liger=liger, kbit=kbit)

    def traced() -> LayerGraph:
        graph = _measure(resolved, dtype=dtype, autocast=autocast, attention=attention, lora=lora,
                         op_selective=op_selective, compiled=compiled, liger=liger, kbit=kbit)
        if compiled:
            graph = eager_work(graph, lower_resolved(resolved, dtype=dtype, autocast=autocast, attention=attention,
                                                     lora=lora, use_cache=use_cache, op_selective=op_selective,
                                                     kbit=kbit))
        return graph

    return cached_or_lowered(key, traced, use_cache=use_cache)


def _measure(resolved: ResolvedModel, *, dtype: str, autocast: str | None, attention: str | None,
             lora: LoraSpec | None, op_selective: bool = False, compiled: bool = False,
             liger: bool = False, kbit: tuple[str, ...] | None = None) -> LayerGraph:
    from . import measure

    config = measure.transformers_config(resolved)
    options = {"dtype": dtype, "autocast": autocast, "attention": attention, "lora": lora, "b0": PROBE_BATCH,
               "s0": PROBE_SEQ, "widen": WIDEN_FACTOR, "compiled": compiled, "liger": liger,
               "kbit": kbit}
    try:
        study = measure.study(config, **options, op_selective=op_selective)
    except UnsupportedModel as err:
        if not (op_selective and _sac_refused(err)):
            raise
        # torch's SAC refuses to run a model that changes in place a tensor the policy keeps (Mixtral's router
        # divides its kept topk output), so op-level SAC cannot run it: the graph goes without that mode.
        study = measure.study(config, **options, op_selective=False)
    return assemble(resolved, study, dtype=dtype, autocast=autocast, lora=lora)


def _sac_refused(err: Exception) -> bool:
    """torch.utils.checkpoint's error for a tensor cached by selective checkpointing and then mutated."""
    return "cached during selective activation checkpoint has been mutated" in str(err.__cause__)


__all__ = ["lower"]
