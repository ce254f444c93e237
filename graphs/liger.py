"""A model as transformers' `use_liger_kernel` runs it: Liger-Kernel's patch applied, its Triton kernels recorded.

transformers 5.24 `Trainer.train` calls liger-kernel's `_apply_liger_kernel_to_instance(model, **liger_kernel_config)`
(integrations/liger.py `apply_liger_kernel`); liger-kernel 0.8.5's per-model patch (monkey_patch.py
`apply_liger_kernel_to_llama` and its siblings) swaps the RMSNorms' forward for `LigerRMSNorm.forward`, the MLP's
for `LigerSwiGLUMLP.forward` and the modeling module's `apply_rotary_pos_emb` for `liger_rotary_pos_emb`. Their
autograd Functions save other tensors than the eager ops: `LigerRMSNormFunction` saves X, W and an fp32 rstd per
row (ops/rms_norm.py `forward`), `LigerSiLUMulFunction` its two inputs and recomputes silu in backward
(ops/swiglu.py), `LigerRopeFunction` only cos and sin, rotating q and k in place (ops/rope.py).

The lowering runs that patched code itself on fake tensors. Only the Triton launches cannot run there: each
`kernel[grid](...)` becomes one recorded op over the tensors it is passed (`triton_launch`), so the host code's
own allocations, views and `save_for_backward` calls are what the recorder sees, and each kernel counts as one
launch moving its arguments' bytes once (twice for the arguments it rewrites in place). The head keeps HF's
loss here; `costmodels/loss.py` prices Liger's fused linear cross-entropy in its place.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

# The kernels `use_liger_kernel` runs as fitplan emits it (solver/plan/launchers/hf.py `liger_kernel_config`):
# liger-kernel 0.8.5's defaults for Llama-style models (rope, rms_norm, swiglu and fused_linear_cross_entropy on,
# cross_entropy off), spelled out so that a model type whose patch defaults differ (granite turns cross_entropy on)
# runs the same kernels. `_apply_liger_kernel_to_instance` drops the keys a model's patch does not take; the patch's
# other defaults (gemma's geglu, llama4's layer_norm) apply in the lowering and in the run alike.
LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False}
# Triton kernels that rewrite some arguments in place (positional index): they read and write those bytes.
# ops/rope.py `_triton_rope(q, q_row_stride, k, k_row_stride, ...)` rotates q and k in place (forward and backward);
# ops/swiglu.py `_swiglu_backward_kernel(dc, a, b, ...)` stores da into a and db into b.
_IN_PLACE = {"_triton_rope": (0, 2), "_swiglu_backward_kernel": (1, 2), "_swiglu_backward_kernel_tiled": (1, 2)}


def liger_version() -> str | None:
    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return None


@functools.cache
def triton_launch() -> Callable[[list[Any]], None]:
    """The op `fitplan::triton_launch(tensors)`: one Triton kernel launch over `tensors` (each once per read or
    write), with no computation, only a record (defined on first use: importing this module needs no torch)."""
    import torch

    # The schema is spelled out: this module's annotations are strings (`from __future__ import annotations`).
    @torch.library.custom_op("fitplan::triton_launch", mutates_args=(), schema="(Tensor[] tensors) -> ()")
    def launch(tensors: list[torch.Tensor]) -> None:
        return None

    @launch.register_fake
    def _(tensors: list[torch.Tensor]) -> None:
        return None

    return launch


class _Launch:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records one `triton_launch`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid: Any) -> Any:
        return self._run

    def _run(self, *args: Any, **kwargs: Any) -> None:
        import torch

        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        tensors += [args[i] for i in _IN_PLACE.get(self.name, ()) if isinstance(args[i], torch.Tensor)]
        triton_launch()(tensors)


@contextlib.contextmanager
def liger_kernels(model: Any) -> Iterator[None]:
    """Apply Liger's patch to `model` (the base model under PEFT's wrapper, as transformers unwraps it) and trace
    with its Triton kernels recorded; the modeling modules' globals the patch rebinds and the kernels are restored
    on exit, so other lowerings in the process run unpatched code."""
    from .errors import UnsupportedModel

    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as err:  # fitplan's `dev` extra has it; users planning Liger need it anyway to run it
        raise UnsupportedModel(f"Liger's kernels cannot be traced: liger-kernel is not installed ({err}).",
                               "pip install liger-kernel (the run needs it too), or plan another --loss.") from err

    modules = {name: dict(vars(module)) for name, module in list(sys.modules.items())
               if module is not None and name.startswith("transformers.")}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        with _recorded_kernels():
            try:
                _apply_liger_kernel_to_instance(model=base, fused_linear_cross_entropy=False, **LIGER_KERNELS)
            except (AssertionError, AttributeError, TypeError, ValueError) as err:
                raise UnsupportedModel(f"liger-kernel {liger_version()} cannot patch {type(base).__name__}: {err}",
                                       "Plan without Liger's kernels (--loss hf).") from err
            yield
    finally:
        for name, saved in modules.items():
            namespace = vars(sys.modules[name])
            for key in set(namespace) - set(saved):
                del namespace[key]
            namespace.update({key: value for key, value in saved.items() if namespace.get(key) is not value})


@contextlib.contextmanager
def _recorded_kernels() -> Iterator[None]:
    """Every Triton kernel of liger-kernel's ops modules replaced by a `_Launch` (the host functions look them up
    as module globals at call time)."""
    import liger_kernel.ops  # noqa: F401  (imports the ops modules the patches call)
    from triton.runtime.jit import KernelInterface

    replaced: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("liger_kernel.ops"):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, KernelInterface):
                replaced.append((module, attribute, value))
                setattr(module, attribute, _Launch(attribute))
    try:
        yield
    finally:
        for module, attribute, value in replaced:
            setattr(module, attribute, value)


__all__ = ["LIGER_KERNELS", "liger_kernels", "liger_version"]
