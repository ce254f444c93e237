"""Activation offloading against torchtune's saved-tensor hooks, emulated on fake tensors.

`OffloadEmulation` follows torchtune 0.6.1 `OffloadActivations` without streams (`unpack_tensor_single_stream`):
every saved tensor of at least 1024 bytes that is not a parameter or buffer is copied to the host in forward
(the copy is not device memory) and copied back when backward unpacks it. The head and loss run outside it, as
torchtune's `NoOpManager` and recipe leave them. Device bytes are every storage's life from creation to release.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import replace

import pytest
import torch
import transformers.masking_utils as masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from costmodels import Config, Engine, Precision, Workload, lowering_for, parse_cluster
from costmodels.activation_offload import (
    MIN_OFFLOAD_BYTES,
    exposed_seconds,
    moved_bytes,
    offload_seconds,
    offload_terms,
    refusals,
)
from costmodels.activations import walk
from costmodels.memory import memory_terms
from graphs import Checkpoint, lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

B, S = 2, 128


class DeviceBytes(TorchDispatchMode):
    """Bytes of live storages that ops create under the mode (except while `host` is set), and their peak."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.host = False
        self.seen: set[int] = {t.untyped_storage()._cdata for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self.seen:
                storage = tensor.untyped_storage()
                key, size = storage._cdata, 0 if self.host else storage.nbytes()
                self.seen.add(key)
                self.live += size
                weakref.finalize(storage, self._free, key, size)
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)


class OffloadEmulation(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's pack/unpack rule; `moved[scope]` sums the bytes each layer sends to the host."""

    def __init__(self, device: DeviceBytes, scope: list[str]) -> None:
        self.moved: dict[str, int] = {}

        def pack(tensor: torch.Tensor):
            size = tensor.numel() * tensor.element_size()
            if size < MIN_OFFLOAD_BYTES or isinstance(tensor, torch.nn.Parameter):
                return False, tensor
            self.moved[scope[-1]] = self.moved.get(scope[-1], 0) + size
            device.host = True
            host = tensor.detach().clone()
            device.host = False
            return True, host

        def unpack(packed):
            moved, tensor = packed
            return tensor.clone() if moved else tensor

        super().__init__(pack, unpack)


def emulate(values: dict) -> tuple[int, dict[str, int]]:
    """(device peak of forward and backward, bytes each scope offloaded) of one offloaded, fully checkpointed
    fp32 step."""
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32,
                                                     attn_implementation="sdpa")
            model.train()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            scope = ["embed"]
            for i, layer in enumerate(model.model.layers):
                layer.register_forward_pre_hook(lambda *args, i=i: scope.append(f"layers.{i}"))
            model.model.norm.register_forward_pre_hook(lambda *args: scope.append("norm"))
            device = DeviceBytes(*model.parameters(), *model.buffers())
            with device:
                ids = torch.randint(0, config.vocab_size, (B, S))
                labels = torch.randint(0, config.vocab_size, (B, S))
                hooks = OffloadEmulation(device, scope)
                with hooks:
                    h = model.model(input_ids=ids, use_cache=False).last_hidden_state
                logits = model.lm_head(h)
                del h
                loss = ForCausalLMLoss(logits, labels, config.vocab_size)
                del logits
                loss.backward()
            return device.peak, hooks.moved
    finally:
        masking_utils.find_packed_sequence_indices = original


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    values = tiny_values("llama")
    layers = values["num_hidden_layers"]
    config = Config(engine=Engine.DDP, precision=Precision.FP32, micro_batch=B, checkpoint=(Checkpoint.FULL,) * layers)
    dtype, autocast = lowering_for(config)
    graph = lower(str(write_config(tmp_path_factory.mktemp("offload"), values)), dtype=dtype, autocast=autocast,
                  attention="sdpa")
    return values, config, graph, emulate(values)


def test_bytes_each_layer_moves_equal_the_hooks(case):
    """Checkpointed layers save their input once: exact. The final norm saves its input `h` and its reciprocal
    root twice each (`pow`/`mul`), which the hooks copy twice and the lowering counts once (one storage each);
    the embedding's token ids are model-wide inputs the model keeps on the device."""
    values, config, graph, (_, moved) = case
    predicted = dict(zip([layer.name for layer in graph.nodes()], moved_bytes(graph, config, b=B, s=S), strict=True))
    for name in [f"layers.{i}" for i in range(values["num_hidden_layers"])]:
        assert predicted[name] == moved[name], name
    h, rstd = B * S * values["hidden_size"] * 4, B * S * 4
    assert moved["norm"] == predicted["norm"] + h + rstd
    assert moved["embed"] == B * S * 8 and predicted["embed"] == 0
    assert predicted["head"] == predicted["loss"] == 0


def test_device_peak_is_within_one_layer_of_the_hooks(case):
    """The model returns a node's offloaded bytes for the whole of its backward (the hooks only while each
    autograd node runs) and keeps the model-wide tensors (the hooks leave only host copies of them after
    forward): it is above the emulation by less than a layer's moved bytes."""
    _, config, graph, (measured, moved) = case
    terms = offload_terms(memory_terms(graph, Workload(seq_len=S, global_batch=B), config), stash=False,
                          prefetch=False)
    nodes = [options[0][1] for options in terms.nodes]
    predicted = walk(nodes, start=terms.start, forward_only=terms.forward_only, fresh_grads=True, extra=terms.extra,
                     names=terms.names).bytes
    plain = memory_terms(graph, Workload(seq_len=S, global_batch=B), config)
    without = walk([options[0][1] for options in plain.nodes], start=plain.start, forward_only=plain.forward_only,
                   fresh_grads=True, extra=plain.extra, names=plain.names).bytes
    print(f"emulated {measured:,} B, modelled {predicted:,} B, without offload {without:,} B")
    assert measured <= predicted <= measured + max(moved.values())
    assert predicted < without
    streamed = offload_terms(memory_terms(graph, Workload(seq_len=S, global_batch=B), config))
    assert all(s[0] >= e[0] and s[2] >= e[2] for s, e in zip(streamed.extra, terms.extra, strict=True))


def test_exposed_seconds_overlap_each_direction_with_its_compute():
    link = 25e9
    assert exposed_seconds([(int(50e6), 0.004, 0.008)], link) == 0.0  # 2 ms of copy under 4 ms of compute
    assert exposed_seconds([(int(250e6), 0.004, 0.008)], link) == pytest.approx(0.006 + 0.002)


def test_offload_seconds_expose_only_what_the_link_cannot_hide(case):
    """On a link a million times faster than the H100's PCIe Gen5 the copies hide behind compute; on one a million
    times slower all but the compute shows."""
    from costmodels.timing import speed_for

    _, config, graph, _ = case
    cluster = parse_cluster("1xH100")
    speed = speed_for(graph, cluster, config, b=B, s=S)
    fast = replace(cluster, gpu=replace(cluster.gpu, host_bandwidth=cluster.gpu.host_bandwidth * 1e6))
    assert offload_seconds(graph, fast, config, speed, s=S) == 0.0
    slow = replace(cluster, gpu=replace(cluster.gpu, host_bandwidth=cluster.gpu.host_bandwidth / 1e6))
    moved = sum(moved_bytes(graph, config, b=B, s=S))
    seconds = offload_seconds(graph, slow, config, speed, s=S)
    assert 0 < seconds <= 2 * moved / (slow.gpu.host_bandwidth * 0.88)


def test_refusals(case):
    values, config, graph, _ = case
    assert refusals(graph, config) == []
    partial = Config(precision=Precision.FP32, micro_batch=B,
                     checkpoint=(Checkpoint.NONE,) + (Checkpoint.FULL,) * (values["num_hidden_layers"] - 1))
    assert "checkpointing" in refusals(graph, partial)[0]
