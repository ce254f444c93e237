"""A compiled plan's activation memory against a real compiled model (issue 10).

The reference is what the generated torchrun script runs when the plan compiles: every decoder layer compiled on
its own (`layer.compile()`, Inductor generating and running CPU kernels), measured through saved-tensor hooks over
a real forward (the storages kept for backward, parameters and inputs left out). MemTracker cannot be the
reference here: a dispatch mode over a compiled region sends it back to eager. What compiling saves, measured,
equals what the estimate credits: the compiled lowering's activations (`lower(..., compiled=True)`) against the
eager one's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.masking_utils as masking_utils
from transformers import AutoConfig, AutoModelForCausalLM

from costmodels import Config, Engine, Precision, Workload, estimate, lowering_for, parse_cluster
from graphs import Checkpoint, lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

B, S = 2, 96


def saved_bytes(values: dict, *, compiled: bool) -> int:
    """Bytes of the distinct storages a real forward keeps for backward (the model's own parameters left out)."""
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32,
                                                 attn_implementation="sdpa")
        model.train()
        if compiled:
            for layer in model.model.layers:
                layer.compile()  # as train_fitplan.py compiles a plan that compiles
        ids = torch.randint(0, config.vocab_size, (B, S))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # compiles (first call)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return sum(kept.values())
    finally:
        masking_utils.find_packed_sequence_indices = original
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_what_compiling_saves_is_what_a_compiled_model_saves(arch, tmp_path):
    values = tiny_values(arch)
    config = Config(engine=Engine.DDP, precision=Precision.FP32, micro_batch=B, compile=True,
                    checkpoint=(Checkpoint.NONE,) * values["num_hidden_layers"])
    dtype, autocast = lowering_for(config)
    folder = str(write_config(tmp_path / arch, values))
    workload, cluster = Workload(seq_len=S, global_batch=B), parse_cluster("1xCPU")
    credited = [estimate(lower(folder, dtype=dtype, autocast=autocast, attention="sdpa", compiled=compiled),
                         cluster, workload, config).memory.activations for compiled in (False, True)]
    measured = [saved_bytes(values, compiled=compiled) for compiled in (False, True)]
    assert measured[1] < measured[0]
    assert credited[0] - credited[1] == measured[0] - measured[1]
