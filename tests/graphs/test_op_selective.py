"""Op-level SAC on the HF path: the lowering against the transformers model checkpointed through its own API
with torchtitan's own policy, measured by MemTracker, at a shape the probes never used."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan")

import transformers.masking_utils as masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
from transformers import AutoConfig, AutoModelForCausalLM

from graphs import Checkpoint, lower
from graphs.fake import is_moe
from graphs.sac import op_sac_policy, titan_policy
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values
from tests.graphs.titan_reference import cpu_selective_ac

ARCHS = ["llama", "qwen2", "qwen3"]
B, S = 3, 80


def hf_layer_retained(values: dict, *, b: int, s: int, backward: bool = False) -> list[int]:
    """Bytes each decoder layer's forward leaves alive (MemTracker), every layer checkpointed by transformers'
    `gradient_checkpointing_enable` with torchtitan's `SelectiveAC` context (CPU flash kernel on its list)."""
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    context_fn = cpu_selective_ac()._wrap_block(torch.nn.Module()).checkpoint_fn.keywords["context_fn"]
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # else a (b,1,s,s) mask appears
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            experts = {"experts_implementation": "grouped_mm"} if is_moe(config) else {}  # as the lowering
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                     attn_implementation="sdpa", **experts)
            model.train()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                               "context_fn": context_fn})
            layers = model.model.layers
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                ids = torch.randint(0, config.vocab_size, (b, s))
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            if backward:
                loss.backward()
            snaps = [tracker.memory_tracking[layer].snapshots for layer in layers]
    finally:
        masking_utils.find_packed_sequence_indices = original
    return [_total(st["Post-Forward"][-1]) - _total(st["Pre-Forward"][-1]) for st in snaps]


def _total(snapshot: dict) -> int:
    return sum(per_device["Total"] for per_device in snapshot.values())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_op_selective_saved_bytes_match_torch_sac_with_torchtitans_policy(arch, tmp_path):
    # A checkpointed layer keeps its input (saved by the checkpoint, made before it ran) and SAC's cache, and
    # leaves its output alive; input and output have the same size, so MemTracker's delta is the saved bytes.
    values = tiny_values(arch)
    graph = lower(str(write_config(tmp_path / arch, values)), dtype="bfloat16", use_cache=False,
                  op_selective=True)
    lowered = [layer.cost(Checkpoint.OP_SELECTIVE).saved(B, S) for layer in graph.decoder_layers()]
    assert lowered == hf_layer_retained(values, b=B, s=S)
    none = graph.node("layers.1").cost(Checkpoint.NONE)
    assert 0 < graph.node("layers.1").cost(Checkpoint.OP_SELECTIVE).recompute.flops(B, S) < none.forward.flops(B, S)


def test_op_sac_policy_decides_like_torchtitans_own_policy():
    # The same op stream through both: seven projections (HF Llama) with attention and elementwise ops between,
    # in forward and in recompute, plus a device-to-host copy.
    aten = torch.ops.aten
    meta = torch.empty(4, 4, device="meta")
    stream = [aten.mm.default, aten.mm.default, aten.mul.Tensor, aten.mm.default,
              aten._scaled_dot_product_flash_attention.default, aten.mm.default, aten.silu.default,
              aten.mm.default, aten.mm.default, aten.add.Tensor, aten.mm.default, aten.linear.default,
              aten.topk.default, aten.max.default, aten._to_copy.default]
    ours, theirs = op_sac_policy(), titan_policy()
    decisions = []
    for recompute in (False, True):
        ctx = SelectiveCheckpointContext(is_recompute=recompute)
        for op in stream:
            kwargs = {"device": "cpu"} if op is aten._to_copy.default else {}
            mine, reference = ours(ctx, op, meta, meta, **kwargs), theirs(ctx, op, meta, meta, **kwargs)
            decisions.append(mine)
            assert mine == reference, op
    assert decisions.count(CheckpointPolicy.MUST_SAVE) > 0 and decisions.count(CheckpointPolicy.PREFER_RECOMPUTE) > 0


@pytest.mark.slow
def test_op_selective_is_left_out_where_torchs_sac_refuses_the_model(tmp_path):
    # Mixtral's router divides its top-k weights in place; torchtitan's policy keeps topk's output, and torch's
    # SAC refuses the mutation. The same model run through transformers' own API fails the same way.
    values = tiny_values("mixtral")
    graph = lower(str(write_config(tmp_path / "mixtral", values)), dtype="bfloat16", use_cache=False,
                  op_selective=True)
    assert Checkpoint.OP_SELECTIVE not in graph.checkpoint_modes()
    assert Checkpoint.FULL in graph.checkpoint_modes()
    with pytest.raises(RuntimeError, match="selective activation checkpoint has been mutated"):
        hf_layer_retained(values, b=B, s=S, backward=True)


def test_fp8_matmuls_are_kept_on_every_call_so_op_sac_reruns_no_fp8_casts():
    # torchao's float8 linears run `_scaled_mm`, which is on the save list (compute-intensive) but not counted as a
    # matmul by the every-second rule: op-level SAC recomputes no fp8 matmul, so it reruns none of the casts that
    # feed them (costmodels.timing charges the forward casts again for full recompute only).
    aten = torch.ops.aten
    meta = torch.empty(4, 4, device="meta")
    ours, theirs = op_sac_policy(), titan_policy()
    for recompute in (False, True):
        ctx = SelectiveCheckpointContext(is_recompute=recompute)
        for _ in range(4):
            assert ours(ctx, aten._scaled_mm.default, meta, meta) == CheckpointPolicy.MUST_SAVE
            assert theirs(ctx, aten._scaled_mm.default, meta, meta) == CheckpointPolicy.MUST_SAVE
