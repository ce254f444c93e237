"""Op-level selective activation checkpointing (SAC) as torchtitan runs it, observed on fake CPU tensors.

PyTorch's `create_selective_checkpoint_contexts(policy)` keeps the outputs of the ops the policy marks
MUST_SAVE and recomputes the rest in backward. torchtitan's policy (`SelectiveAC` in
`torchtitan/distributed/activation_checkpoint.py`, 0.3.0) saves matmuls (every second one recomputed), attention
kernels and a few other compute/communication ops. The saved outputs live in SAC's cache, which saved-tensor
hooks never see: `SacRecorder` books them on the layer that saved them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .recorder import Recorder, _tensors

aten = torch.ops.aten

# The CPU trace runs SDPA as `_scaled_dot_product_flash_attention_for_cpu`; GPUs run the CUDA flash (or cuDNN,
# or FlexAttention) kernel, which the partitioner's `compute_intensive_ops` (torch/_functorch/partitioners.py
# `get_default_op_list`) and so torchtitan's save list contain; the CPU kernel is in neither. Both return
# (output, fp32 logsumexp of shape (b, h, s)) as their tensor outputs, so the policy is asked about the GPU op.
GPU_EQUIVALENT_OPS: dict[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: aten._scaled_dot_product_flash_attention.default,
}
_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

Policy = Callable[..., CheckpointPolicy]


class SacRecorder(Recorder):
    """A `Recorder` that also books the outputs SAC keeps (told by `observed_policy`) as saved by the scope."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__(existing)
        self.pending_save: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.pending_save is not None and func is self.pending_save:
            self.pending_save = None
            self.keep(out)
        return out

    def keep(self, out: Any) -> None:
        """Book every tensor of an op's output as saved by the current scope."""
        for tensor in _tensors(out):
            self.pack_saved(tensor)


def observed_policy(policy: Policy, recorder: SacRecorder | None) -> Policy:
    """`policy` asked about each op's GPU counterpart, with each forward save booked by `recorder`.

    torch >= 2.13 asks the policy after running the op and hands it the output (`ctx.op_output`); earlier
    releases ask before running it, and the op then reaches the recorder (the next mode down) first."""

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = policy(ctx, GPU_EQUIVALENT_OPS.get(func, func), *args, **kwargs)
        if recorder is not None and decision in _SAVE and not ctx.is_recompute:
            if hasattr(ctx, "op_output"):
                recorder.keep(ctx.op_output)
            else:
                recorder.pending_save = func
        return decision

    return decide


@contextlib.contextmanager
def observing(recorder: SacRecorder | None) -> Iterator[None]:
    """Route torchtitan's `SelectiveAC` contexts through `observed_policy` while a pass runs."""
    import torchtitan.distributed.activation_checkpoint as titan_ac

    original = titan_ac.create_selective_checkpoint_contexts

    def contexts(policy: Policy, allow_cache_entry_mutation: bool = False) -> Any:
        return original(observed_policy(policy, recorder), allow_cache_entry_mutation)

    titan_ac.create_selective_checkpoint_contexts = contexts
    try:
        yield
    finally:
        titan_ac.create_selective_checkpoint_contexts = original


def titan_policy() -> Policy:
    """A fresh torchtitan op-SAC policy (its per-call matmul counters start at zero), as `SelectiveAC` builds it
    for one block; call once per checkpointed forward (`context_fn`)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    captured: list[Policy] = []
    block = torch.nn.Module()
    wrapper = SelectiveAC(SelectiveAC.Config())._wrap_block(block)
    with _capturing(captured):
        wrapper.checkpoint_fn.keywords["context_fn"]()
    return captured[0]


@contextlib.contextmanager
def _capturing(captured: list[Policy]) -> Iterator[None]:
    import torchtitan.distributed.activation_checkpoint as titan_ac

    original = titan_ac.create_selective_checkpoint_contexts

    def contexts(policy: Policy, allow_cache_entry_mutation: bool = False) -> Any:
        captured.append(policy)
        return original(policy, allow_cache_entry_mutation)

    titan_ac.create_selective_checkpoint_contexts = contexts
    try:
        yield
    finally:
        titan_ac.create_selective_checkpoint_contexts = original


def save_ops() -> set[Any]:
    """The ops whose outputs op-level SAC keeps: torchtitan 0.3.0's `_get_default_save_ops` (the partitioner's
    compute-intensive ops, attention kernels, `max` for low-precision scales, linear, topk, and the
    reduce-scatter / all-to-all collectives), without torchtitan."""
    from torch._functorch.partitioners import get_default_op_list

    ops: set[Any] = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
            aten._scaled_dot_product_fused_attention_overrideable.default, aten.max.default,
            torch._higher_order_ops.flex_attention, aten.linear.default, aten.topk.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default}
    compiled = getattr(torch._higher_order_ops, "inductor_compiled_code", None)
    return ops | ({compiled} if compiled is not None else set())


_MM_OPS = (aten.mm.default, aten.linear.default)


def op_sac_policy(ops: set[Any] | None = None) -> Policy:
    """torchtitan's op-SAC policy for one checkpointed forward: keep the outputs of `save_ops`, but recompute
    every second matmul (counted separately in forward and recompute), and keep device-to-host copies. The
    transcription the HF path and the generated torchrun script use; `titan_policy` is torchtitan's own.
    fp8 matmuls (`_scaled_mm`) are kept on every call: the rule counts only `mm` and `linear`."""
    keep = save_ops() if ops is None else ops
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func == aten._to_copy.default and "cuda" in str(args[0].device) and str(kwargs.get("device")) == "cpu":
            return CheckpointPolicy.MUST_SAVE
        phase = "recompute" if ctx.is_recompute else "forward"
        if func in _MM_OPS:
            counts[phase] += 1
        if func in keep:
            if func in _MM_OPS and counts[phase] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_sac_context_fn(recorder: SacRecorder | None = None) -> Callable[[], Any]:
    """A `context_fn` for `torch.utils.checkpoint.checkpoint` applying `op_sac_policy` (a fresh one per
    checkpointed forward, as torchtitan does), observed by `recorder` when given."""

    def context_fn() -> Any:
        return create_selective_checkpoint_contexts(observed_policy(op_sac_policy(), recorder))

    return context_fn


__all__ = ["GPU_EQUIVALENT_OPS", "SacRecorder", "observed_policy", "observing", "op_sac_context_fn", "op_sac_policy",
           "save_ops", "titan_policy"]
