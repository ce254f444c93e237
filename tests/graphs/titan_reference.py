"""An independent reference for the torchtitan lowering: the real torchtitan model (every layer, with
torchtitan's own `FullAC` / `SelectiveAC` applied to the whole model by `.apply`, as its trainer does) run once
on fake tensors and measured with torch's own accounting only: `saved_tensors_hooks` and `MemTracker`.

Norms run with the GPU kernel's autograd formula (`graphs.titan.cuda_rms_norm`: what `_fused_rms_norm` saves
on a GPU), tested on its own in test_titan.py. Op-level SAC is applied through torchtitan's documented
customisation point (a `SelectiveAC` subclass
overriding `get_save_ops`) with the CPU flash-attention kernel added to the save list: on a GPU, the CUDA
kernel is in it (see `graphs/sac.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker

from graphs.architectures import titan_family
from graphs.layer import Checkpoint
from graphs.measure import transformers_config
from graphs.sources import resolve
from graphs.titan import build_titan, cuda_rms_norm, titan_config


def cpu_selective_ac() -> Any:
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    class CpuSelectiveAC(SelectiveAC):
        def get_save_ops(self) -> set:
            return super().get_save_ops() | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    return CpuSelectiveAC(CpuSelectiveAC.Config())


def reference_model(folder: str, *, dtype: torch.dtype, mode: Checkpoint, fake: FakeTensorMode,
                    seq_len: int) -> torch.nn.Module:
    """The torchtitan model for the config in `folder`, with fake parameters, checkpointed as `mode`."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    config = transformers_config(resolve(folder))
    spec = titan_config(config, family=titan_family(config.model_type), layers=config.num_hidden_layers)
    # torchtitan's trainer sizes every RoPE cache for `training.seq_len` (`Decoder.Config.update_from_config`).
    for layer in spec.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    model = build_titan(spec)
    if mode is Checkpoint.FULL:
        FullAC(FullAC.Config()).apply(model)
    elif mode is Checkpoint.OP_SELECTIVE:
        cpu_selective_ac().apply(model)
    memo: dict[int, torch.Tensor] = {}
    for sub in model.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    meta = p.detach().to(dtype)
                    memo[id(p)] = torch.nn.Parameter(
                        fake.fake_tensor_converter.from_meta_and_device(fake, meta, torch.device("cpu")))
                sub._parameters[name] = memo[id(p)]
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = fake.fake_tensor_converter.from_meta_and_device(fake, buf, torch.device("cpu"))
    return model


def _loss(model: torch.nn.Module, b: int, s: int, loss: str = "chunked") -> torch.Tensor:
    """The loss as torchtitan's trainer computes it: `ChunkedLossWrapper` (its default config) on the hidden
    states with `_skip_lm_head` set, or plain `cross_entropy_loss` on the logits."""
    from torchtitan.components.loss import ChunkedLossWrapper, cross_entropy_loss

    vocab = model.lm_head.out_features
    tokens = torch.randint(0, vocab, (b, s))
    labels = torch.randint(0, vocab, (b, s))
    positions = torch.arange(s).repeat(b, 1)
    if loss == "plain":
        return cross_entropy_loss(model(tokens, positions, None), labels)
    model._skip_lm_head = True
    hidden = model(tokens, positions, None)
    model._skip_lm_head = False
    wrapper = ChunkedLossWrapper(ChunkedLossWrapper.Config())
    wrapper.set_lm_head(model.lm_head)
    return wrapper(hidden, labels)[0]


@dataclass
class LayerReference:
    saved: list[int]
    """Bytes each layer's forward left alive (MemTracker: Post-Forward minus Pre-Forward)."""
    hooked: list[int]
    """Bytes saved-tensor hooks saw each layer save (storages counted once, on the first layer)."""


def layer_reference(folder: str, *, b: int, s: int, dtype: torch.dtype, mode: Checkpoint,
                    compiled: bool = False) -> LayerReference:
    """`compiled`: every block runs as torch.compile trains it (`graphs.compiled.compile_forward`, itself checked
    against a real Inductor compile), as torchtitan's `apply_compile` compiles each block."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = reference_model(folder, dtype=dtype, mode=mode, fake=fake, seq_len=s)
    layers = list(model.layers.values())
    if compiled:
        from graphs.compiled import compile_forward

        for layer in layers:
            compile_forward(layer)
    existing = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    stack, owner, nbytes, keep = ["outside"], {}, {}, []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in existing and st._cdata not in owner:
            owner[st._cdata], nbytes[st._cdata] = stack[-1], st.nbytes()
            keep.append(st)
        return t

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: stack.append(f"layer{i}"))
        layer.register_forward_hook(lambda m, a, o: stack.pop() and None)
    tracker = MemTracker()
    tracker.track_external(model)
    with fake, tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cuda_rms_norm():
        loss = _loss(model, b, s, "plain")
    stats = [tracker.memory_tracking[layer].snapshots for layer in layers]
    retained = [_total(st["Post-Forward"][-1]) - _total(st["Pre-Forward"][-1]) for st in stats]
    hooked = [sum(n for k, n in nbytes.items() if owner[k] == f"layer{i}") for i in range(len(layers))]
    del loss
    return LayerReference(saved=retained, hooked=hooked)


def _total(snapshot: dict[torch.device, dict[str, int]]) -> int:
    return sum(per_device["Total"] for per_device in snapshot.values())


class _NoModuleTracking(ModTracker):
    """MemTracker's module tracker with no module hooks: torch 2.13's ModTracker reports "The Module hierarchy
    tracking is wrong" when a backward runs inside a forward, as in torchtitan's chunked loss. The step's total
    allocated memory, which is what these tests compare, does not depend on per-module attribution."""

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def step_peak(folder: str, *, b: int, s: int, dtype: torch.dtype, mode: Checkpoint, loss: str = "chunked") -> int:
    """MemTracker's allocated peak over one training step of the torchtitan model (forward, loss, backward,
    foreach AdamW step, zero_grad), after a warm-up step that creates the optimizer states."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = reference_model(folder, dtype=dtype, mode=mode, fake=fake, seq_len=s)
    with fake, cuda_rms_norm():
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

        def step() -> None:
            _loss(model, b, s, loss).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        tracker = MemTracker()
        tracker._mod_tracker = _NoModuleTracking()
        tracker.track_external(model, optimizer)
        with tracker:
            step()
    return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
