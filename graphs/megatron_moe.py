"""megatron-core's MoE layers on fake tensors: the Mixtral-style router and experts as a Megatron-LM run builds them.

The emitted Megatron launch (`solver/plan/launchers/megatron.py`) runs megatron-core's `MoELayer` with the all-to-all
token dispatcher, dropless (no capacity factor), top-k softmax routing with the load-balancing aux loss, and
`SequentialMLP` experts (no `--moe-grouped-gemm`): one MLP per expert, run on its slice of the permuted tokens.
Three things in that code need values or a GPU, which a fake-tensor trace on a CPU has not; each is answered here:
- `permute`/`unpermute` select the routed pairs with `masked_select` over the routing map, whose output length is
  data-dependent. Dropless top-k routing selects exactly `top_k` experts per token, so the length is
  tokens x top_k: `DroplessRouting` returns a tensor of that length below autograd, which saves what the real op
  saves (the mask) and records the real op's kernel;
- the dispatcher's tokens-per-expert counts are read back to the host (`.tolist()` to split the tokens between
  the experts). They are answered with the balanced split (tokens x top_k over the experts, as even as integers
  allow). Every expert's saved tensors are per token, so their total over the experts is the same for any
  routing: only the momentary peak inside one expert's MLP depends on the split;
- megatron-core 0.16 without Transformer Engine: the dispatcher's device-to-host side stream
  (`MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`, a few bytes of counts copied to host memory, no GPU bytes) and
  the router GEMM's `te_general_gemm`, left undefined when TE is absent (it then runs `torch.mm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .architectures import router_pre_softmax

aten = torch.ops.aten


def moe_settings(text: Any, *, experts: int, top_k: int, ffn_hidden: int) -> dict[str, Any]:
    """megatron-core `TransformerConfig` fields of a Mixtral-style MoE, as the Megatron launcher emits them:
    dropless all-to-all dispatch, softmax top-k router with the aux loss at the model's `router_aux_loss_coef`,
    SequentialMLP experts."""
    return {"num_moe_experts": experts, "moe_router_topk": top_k, "moe_ffn_hidden_size": ffn_hidden,
            "moe_token_dispatcher_type": "alltoall", "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": aux_loss_coeff(text),
            "moe_router_pre_softmax": router_pre_softmax(text.model_type, getattr(text, "norm_topk_prob", True)),
            "moe_grouped_gemm": False, "moe_permute_fusion": False}


def every_layer_routed(text: Any) -> bool:
    """Whether every decoder layer is an MoE layer, the only layout lowered here (Qwen3-MoE's
    `decoder_sparse_step` and `mlp_only_layers` can make some dense)."""
    return int(getattr(text, "decoder_sparse_step", 1) or 1) == 1 and not getattr(text, "mlp_only_layers", None)


def aux_loss_coeff(text: Any) -> float:
    """The load-balancing loss coefficient the model was trained with (`router_aux_loss_coef`, 0.02 for Mixtral)."""
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)


def balanced_counts(pairs: int, experts: int) -> list[int]:
    """`pairs` token-expert pairs spread over `experts` as evenly as integers allow."""
    return [pairs // experts + (e < pairs % experts) for e in range(experts)]


class DroplessRouting(TorchDispatchMode):
    """Answers the data-dependent reads of dropless top-k routing on fake tensors (see the module docstring):
    `masked_select` over a routing map (bool, one dim the expert count) returns tokens x top_k elements, and host
    reads of registered tokens-per-expert counts return their balanced values. Enter it inside the fake mode and
    outside any recorder, so that recorders see the op and its output."""

    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self._counts: dict[int, list[int]] = {}

    def register_counts(self, counts: torch.Tensor, values: list[int]) -> None:
        """Host reads of `counts` (or any view of its storage) return `values`, by storage offset."""
        self._counts[counts.untyped_storage()._cdata] = values

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.masked_select.default and isinstance(args[1], FakeTensor):
            source, mask = args
            if mask.dtype != torch.bool or mask.dim() != 2 or self.experts not in mask.shape:
                raise ValueError(f"masked_select over a {tuple(mask.shape)} {mask.dtype} mask is not a routing map "
                                 f"of {self.experts} experts")
            pairs = mask.numel() // self.experts * self.top_k
            return torch.empty(pairs, dtype=source.dtype, device=source.device)
        if func is aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            values = self._counts.get(args[0].untyped_storage()._cdata)
            if values is not None:
                return values[args[0].storage_offset()]
        return func(*args, **kwargs)


@contextlib.contextmanager
def moe_runtime() -> Iterator[None]:
    """megatron-core 0.16's MoE code on a CPU-only torch (inside `megatron.cpu_runtime`): the dispatcher's side
    stream and host synchronisation skipped, `te_general_gemm` defined as absent, and the tokens-per-expert counts
    registered with the active `DroplessRouting` when there is one. Everything is restored on exit."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher as dispatchers

    alltoall = dispatchers.MoEAlltoAllTokenDispatcher
    saved = (alltoall.cuda_dtoh_stream, alltoall.preprocess, alltoall._maybe_dtoh_and_synchronize,
             moe_utils.__dict__.get("te_general_gemm", _ABSENT))
    original_preprocess = alltoall.preprocess

    def preprocess(self: Any, routing_map: torch.Tensor) -> torch.Tensor:
        counts = original_preprocess(self, routing_map)
        routing = _active_routing()
        if routing is not None and isinstance(counts, FakeTensor):
            routing.register_counts(counts, balanced_counts(routing_map.shape[0] * self.config.moe_router_topk,
                                                            self.num_experts))
        return counts

    alltoall.cuda_dtoh_stream = object()  # never used: the synchronisation below is skipped
    alltoall.preprocess = preprocess
    alltoall._maybe_dtoh_and_synchronize = lambda self, point, tokens_per_expert=None: tokens_per_expert
    moe_utils.te_general_gemm = None
    _reset_step_state()
    try:
        yield
    finally:
        _reset_step_state()
        alltoall.cuda_dtoh_stream, alltoall.preprocess, alltoall._maybe_dtoh_and_synchronize, gemm = saved
        if gemm is _ABSENT:
            del moe_utils.te_general_gemm
        else:
            moe_utils.te_general_gemm = gemm


_ABSENT = object()


def step_state(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a Megatron-LM run of an MoE model keeps from its first step on (call under the fake mode, inside
    `moe_runtime`): the aux loss's backward scale (`MoEAuxLossAutoScaler.set_loss_scale`, which Megatron-LM's
    schedule sets every step) and the layer-wise aux-loss logging buffer (`save_to_aux_losses_tracker`: fp32, one
    value per layer). Returns them, for recorders to treat as existing; nothing for a dense model."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

    config = model.config
    if not config.num_moe_experts:
        return []
    _reset_step_state()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(()))
    kept = [MoEAuxLossAutoScaler.main_loss_backward_scale]
    if config.moe_aux_loss_coeff:
        buffer = torch.zeros(config.num_layers)
        get_moe_layer_wise_logging_tracker()["load_balancing_loss"] = {"values": buffer}
        kept.append(buffer)
    return kept


def _reset_step_state() -> None:
    """Forget megatron-core's MoE state across steps (`step_state`): tensors of another fake mode cannot be mixed."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    get_moe_layer_wise_logging_tracker().clear()


def _active_routing() -> DroplessRouting | None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, DroplessRouting)), None)


__all__ = ["DroplessRouting", "aux_loss_coeff", "balanced_counts", "every_layer_routed",
           "moe_runtime", "moe_settings", "step_state"]
