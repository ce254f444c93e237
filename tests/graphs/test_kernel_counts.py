"""Kernel counts the lowering records, against an independent count over one direct fake-tensor training pass.

The reference counts dispatched ATen ops that write device memory: an op whose schema mutates an argument, or
one whose output is a new storage (not a view of an input), less uninitialised allocations (`empty*`). The
lowering's rule (`graphs.recorder.launches_kernel`) is stated differently: ops that move bytes, less host queries.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers.masking_utils as masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoConfig, AutoModelForCausalLM

from graphs import lower

from .reference import write_config
from .tiny_configs import tiny_values

_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _WritingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        writes = func._schema.is_mutable or any(t.untyped_storage()._cdata not in inputs for t in outputs)
        if writes and func._overloadpacket.__name__ not in _UNINITIALISED:
            self.count += 1
        return out


def _reference_kernels(values: dict[str, Any], *, b: int, s: int) -> int:
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # as the lowering's runner does
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
            model.train()
            ids = torch.randint(0, config.vocab_size, (b, s))
            counter = _WritingOps()
            with counter:
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        masking_utils.find_packed_sequence_indices = original
    return counter.count


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_kernel_count_per_step_equals_writing_ops_of_a_direct_fake_tensor_pass(arch, tmp_path):
    values = tiny_values(arch)
    graph = lower(str(write_config(tmp_path, values)), dtype="float32", use_cache=False)
    lowered = sum(work.kernels(1, 1) for layer in graph.nodes()
                  for work in (layer.cost().forward, layer.cost().backward))
    # Exact: both count every op of the same pass; the shape does not change the op sequence.
    assert lowered == _reference_kernels(values, b=2, s=16)


def test_kernel_counts_are_constant_and_equal_across_identical_layers(tmp_path):
    graph = lower(str(write_config(tmp_path, tiny_values("llama"))), dtype="float32", use_cache=False)
    layers = graph.decoder_layers()
    counts = {(layer.cost().forward.kernels, layer.cost().backward.kernels) for layer in layers}
    assert len(counts) == 1
    forward, backward = counts.pop()
    assert forward.terms == ((((0, 0, 0)), forward(1, 1)),) and forward(1, 1) > 0
    assert backward(7, 4096, 2) == backward(1, 1)  # no b, s or 1/t terms
