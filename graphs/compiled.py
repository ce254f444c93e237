"""A decoder layer as torch.compile runs it in training: AOTAutograd traces forward and backward into one joint
graph, Inductor's partitioner (its joint-graph passes, then the min-cut rematerialisation partitioner) decides
which forward values backward keeps and which it recomputes, and the compiled forward saves exactly those.

`compile_forward` does the same on fake tensors, without Dynamo (which refuses fake parameters) and without
generating kernels: `aot_function` over the layer's own forward with its parameters as inputs, with
`torch._inductor.compile_fx.partition_fn` as the partitioner and the partitioned graphs run as they are. What it
saves for backward is what the compiled layer saves (the tests compare it with a real
`torch.compile(backend="inductor")` run on CPU), so the lowering's saved-tensor hooks measure a compiled plan's
activations like an eager one's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def _inductor_partition() -> Callable[..., Any]:
    from torch._inductor.compile_fx import partition_fn

    return partition_fn


def _as_is(graph: torch.fx.GraphModule, _: Any) -> Callable[..., Any]:
    """Run the partitioned graph as traced (boxed: AOTAutograd frees each input as the graph consumes it)."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(graph)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _signature(leaves: list[Any]) -> tuple[Any, ...]:
    """What a traced graph is specialised on: each tensor's shape, dtype and grad flag, every other value."""
    return tuple((tuple(leaf.shape), leaf.dtype, leaf.requires_grad) if isinstance(leaf, torch.Tensor) else
                 ("value", repr(leaf)) for leaf in leaves)


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Nothing outside sees the tracing: no dispatch mode (the recorder would log the joint graph's ops) and no
    global module hook (the scope tracker would follow the traced submodules), and what the discarded first run
    saves for backward goes to hooks of its own."""
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import _disable_current_modes

    hooks = [nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks,
             nn_module._global_backward_pre_hooks, nn_module._global_backward_hooks]
    saved = [dict(registry) for registry in hooks]
    for registry in hooks:
        registry.clear()
    try:
        with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            yield
    finally:
        for registry, entries in zip(hooks, saved, strict=True):
            registry.update(entries)


def compile_forward(layer: torch.nn.Module) -> None:
    """Make `layer` run as torch.compile would train it: its forward becomes the partitioned forward graph
    (traced once per input signature, outside any recording), its backward the partitioned backward graph.
    The module keeps its parameters, buffers, name and hooks; only `forward` is replaced."""
    from torch._functorch.aot_autograd import aot_function
    from torch.nn.utils.stateless import _reparametrize_module

    original = type(layer).forward
    traced: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Buffers go in as inputs too (a torchtitan block's RoPE cache): a traced constant may not be fake.
        names, params = zip(*layer.named_parameters(), *layer.named_buffers(), strict=True)
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        key = (str(spec), *_signature(leaves))  # the call's structure and its values
        tensors = [leaves[i] for i in where]
        if key not in traced:
            def call(weights: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
                filled = list(leaves)
                for i, tensor in zip(where, inputs, strict=True):
                    filled[i] = tensor
                layer_args, layer_kwargs = tree_unflatten(filled, spec)
                with _reparametrize_module(layer, dict(zip(names, weights, strict=True))):
                    return original(layer, *layer_args, **layer_kwargs)

            traced[key] = aot_function(call, fw_compiler=_as_is, bw_compiler=_as_is,
                                       partition_fn=_inductor_partition())
            with _untraced():
                traced[key](list(params), tensors)  # trace (forward and backward graphs) and discard
        return traced[key](list(params), tensors)

    layer.forward = forward
