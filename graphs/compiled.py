"""A decoder layer as torch.compile runs it in training: AOTAutograd traces forward and backward into one joint
graph, Inductor's partitioner (its joint-graph passes, then the min-cut rematerialisation partitioner) decides
which forward values backward keeps and which it recomputes, and the compiled forward saves exactly those.

`CompiledLayer` does the same on fake tensors, without Dynamo (which refuses fake parameters) and without
generating kernels: `aot_function` over the layer's functional call, with `torch._inductor.compile_fx.partition_fn`
as the partitioner and the partitioned graphs run as they are. What it saves for backward is what the compiled
layer saves (the tests compare it with a real `torch.compile(backend="inductor")` run on CPU), so the lowering's
saved-tensor hooks measure a compiled plan's activations like an eager one's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def _inductor_partition() -> Callable[..., Any]:
    from torch._inductor.compile_fx import partition_fn

    return partition_fn


def _as_is(graph: torch.fx.GraphModule, _: Any) -> Callable[..., Any]:
    return graph


class CompiledLayer(torch.nn.Module):
    """`layer` run through AOTAutograd with Inductor's partitioner (forward and backward graphs run as traced)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch._functorch.aot_autograd import aot_function

        names, params = zip(*self.layer.named_parameters(), strict=True)
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def call(weights: list[torch.Tensor], tensors: list[torch.Tensor]) -> Any:
            filled = list(leaves)
            for i, tensor in zip(where, tensors, strict=True):
                filled[i] = tensor
            layer_args, layer_kwargs = tree_unflatten(filled, spec)
            return torch.func.functional_call(self.layer, dict(zip(names, weights, strict=True)), layer_args,
                                              layer_kwargs)

        compiled = aot_function(call, fw_compiler=_as_is, bw_compiler=_as_is, partition_fn=_inductor_partition())
        return compiled(list(params), [leaves[i] for i in where])
