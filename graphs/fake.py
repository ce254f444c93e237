"""Build transformers models without memory and run them on fake tensors, each library quirk handled here.

Models are built on the meta device (fast: no per-op Python dispatch), then the few modules that get traced
are moved to `FakeTensorMode`, whose CPU kernels decide what autograd saves. Running on meta directly would
change kernel choices (SDPA takes the math path; some ops differ), so tracing stays on fake tensors.
Remote code is never run.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
import transformers.masking_utils as masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .errors import UnsupportedModel

# Config fields that hold the attention-probability dropout, across architectures.
ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass (used to tell recompute from forward)."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def quirks(on_recompute: Callable[[], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
    """Patch transformers for fake-tensor tracing and install the selective-recompute hook.

    - transformers 5.24 `masking_utils.find_packed_sequence_indices` returns a mask under FakeTensor
      (`is_tracing()` is true), so SDPA gets a materialised (b,1,s,s) mask that real runs never build
      (feasibility study §3). Returning None restores the real `is_causal` path.
    - Selective recompute (Korthikanti et al. 2022: recompute the attention core only) wraps the attention
      function of modules flagged `_fitplan_selective` in a non-reentrant checkpoint.
    """
    original_find = masking_utils.find_packed_sequence_indices
    original_get = type(ALL_ATTENTION_FUNCTIONS).get_interface

    def get_interface(self: Any, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return _selective(original_get(self, name, default), on_recompute)

    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    type(ALL_ATTENTION_FUNCTIONS).get_interface = get_interface
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*loss_type=None.*")
            warnings.filterwarnings("ignore", category=UserWarning, module="torch.utils.checkpoint")
            yield
    finally:
        masking_utils.find_packed_sequence_indices = original_find
        type(ALL_ATTENTION_FUNCTIONS).get_interface = original_get


def _selective(attention: Callable[..., Any],
               on_recompute: Callable[[], contextlib.AbstractContextManager[None]]) -> Callable[..., Any]:
    def attention_with_recompute(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, mask: torch.Tensor | None, **kwargs: Any) -> Any:
        if not (getattr(module, "_fitplan_selective", False) and torch.is_grad_enabled()):
            return attention(module, query, key, value, mask, **kwargs)

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None) -> Any:
            with on_recompute() if in_backward() else contextlib.nullcontext():
                return attention(module, q, k, v, m, **kwargs)

        return checkpoint(core, query, key, value, mask, use_reentrant=False)

    return attention_with_recompute


def full_checkpoint_function(on_recompute: Callable[[], contextlib.AbstractContextManager[None]],
                             **checkpoint_kwargs: Any) -> Callable[..., Any]:
    """A `_gradient_checkpointing_func` for transformers layers that marks the backward-time recompute
    (`checkpoint_kwargs`, e.g. a SAC `context_fn`, go to `torch.utils.checkpoint.checkpoint`)."""

    def run_checkpointed(function: Callable[..., Any], *args: Any) -> Any:
        def replay(*inner: Any) -> Any:
            with on_recompute() if in_backward() else contextlib.nullcontext():
                return function(*inner)

        # transformers 5 defaults to non-reentrant checkpointing (`{"use_reentrant": False}`).
        return checkpoint(replay, *args, use_reentrant=False, **checkpoint_kwargs)

    return run_checkpointed


def is_moe(config: PretrainedConfig) -> bool:
    return bool(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
                or getattr(config, "n_routed_experts", None))


@contextlib.contextmanager
def _outside_deepspeed_zero3() -> Iterator[None]:
    """Build the model as a plain module even where the caller's process holds a DeepSpeed ZeRO-3 config (a live
    `TrainingArguments(deepspeed=...)`: transformers then builds every model under `deepspeed.zero.Init`, which
    partitions it and asserts the caller's batch sizes); the caller's config is put back afterwards."""
    from transformers.integrations import deepspeed as hf_deepspeed

    kept = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = kept


def build_model(config: PretrainedConfig, *, dtype: str, attention: str | None) -> torch.nn.Module:
    """Instantiate the causal LM on the meta device (no memory, no init work)."""
    config = copy.deepcopy(config)  # transformers 5 `from_config` mutates the config it is given
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if attention:
        kwargs["attn_implementation"] = attention
    if is_moe(config):
        # Eager experts call aten.nonzero, which has no fake-tensor shape (feasibility study §4); torch 2.13's
        # grouped_mm takes bf16 only, so other dtypes use batched_mm (one bmm over the routed tokens).
        kwargs["experts_implementation"] = "grouped_mm" if dtype == "bfloat16" else "batched_mm"
    try:
        with torch.device("meta"), _outside_deepspeed_zero3():
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as err:
        raise UnsupportedModel(
            f"transformers {transformers.__version__} cannot build {type(config).__name__} "
            f"(model_type '{config.model_type}') as a causal LM with attention={attention!r}: {err}",
            "Pick another --attention (sdpa or eager), or check that the model is a decoder-only causal LM.",
        ) from err
    if model.config._attn_implementation != "eager":
        # GPUs run SDPA as flash / memory-efficient attention, which applies attention dropout inside the
        # kernel and saves no mask. CPU SDPA with dropout falls back to the math path (s^2 terms, fp32
        # upcast), so trace with attention dropout 0 to get the kernel that GPUs use.
        for module in model.modules():
            for name in ("attention_dropout", "attn_dropout"):
                value = getattr(module, name, None)
                if isinstance(value, float):
                    setattr(module, name, 0.0)
                elif isinstance(value, torch.nn.Dropout):
                    value.p = 0.0
        for name in ATTENTION_DROPOUT_FIELDS:
            if isinstance(getattr(model.config, name, None), float):
                setattr(model.config, name, 0.0)
    model.train()
    return model


def to_fake(module: torch.nn.Module, mode: FakeTensorMode, *, param_dtype: torch.dtype | None = None) -> None:
    """Replace every parameter and buffer by a fake tensor of the same shape, keeping tied ones tied; parameters
    in `param_dtype` when given (FSDP2's mixed-precision `param_dtype`: buffers such as RoPE caches keep theirs)."""
    memo: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                if id(param) not in memo:
                    source = param.detach().to(param_dtype) if param_dtype is not None else param
                    memo[id(param)] = torch.nn.Parameter(_fake_cpu(mode, source), requires_grad=param.requires_grad)
                sub._parameters[name] = memo[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                if id(buffer) not in memo:
                    memo[id(buffer)] = _fake_cpu(mode, buffer)
                sub._buffers[name] = memo[id(buffer)]


def _fake_cpu(mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    return mode.fake_tensor_converter.from_meta_and_device(mode, tensor.detach(), torch.device("cpu"))
