"""`graphs.compiled.compile_forward` makes a layer save for backward exactly what `torch.compile(backend="inductor")`
saves: a real Inductor compile of a transformers decoder layer on CPU (kernels generated and run) against the
fake-tensor layer, compared tensor by tensor through saved-tensor hooks (parameters and the layer's inputs left out)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from graphs.compiled import compile_forward
from graphs.fake import to_fake

HIDDEN, HEAD_DIM = 128, 32


def saved(run: Callable[[], torch.Tensor], exclude: set[int]) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, dtype, storage bytes) of each storage `run` saves for backward, then runs backward."""
    seen: dict[int, tuple[tuple[int, ...], str, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = id(storage) if isinstance(tensor, FakeTensor) else storage.data_ptr()
        seen[key] = (tuple(tensor.shape), str(tensor.dtype), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    output = output[0] if isinstance(output, tuple) else output  # older transformers return (hidden,)
    output.float().sum().backward()
    return sorted(value for key, value in seen.items() if key not in exclude)


def decoder_layer(arch: str, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, Qwen2Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    kind, layer = {"llama": (LlamaConfig, LlamaDecoderLayer), "qwen2": (Qwen2Config, Qwen2DecoderLayer)}[arch]
    config = kind(hidden_size=HIDDEN, intermediate_size=344, num_attention_heads=HIDDEN // HEAD_DIM,
                  num_key_value_heads=2, num_hidden_layers=1, vocab_size=100)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return layer(config, 0).to(torch.bfloat16)


def inputs(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(b, s, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    return x, torch.randn(1, s, HEAD_DIM, dtype=torch.bfloat16), torch.randn(1, s, HEAD_DIM, dtype=torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fake_compiled_layer_saves_what_inductor_saves(arch):
    torch.manual_seed(0)
    b, s = 2, 64
    layer = decoder_layer(arch, "cpu")
    x, cos, sin = inputs(b, s)
    outside = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), x, cos, sin)}
    compiled = torch.compile(layer, backend="inductor")
    real = saved(lambda: compiled(x, position_embeddings=(cos, sin), attention_mask=None), outside)
    eager = saved(lambda: layer(x, position_embeddings=(cos, sin), attention_mask=None), outside)

    mode = FakeTensorMode()
    fake_layer = decoder_layer(arch, "meta")
    to_fake(fake_layer, mode)
    compile_forward(fake_layer)
    with mode:
        fx, fcos, fsin = inputs(b, s)
        outside = {id(t.untyped_storage()) for t in (*fake_layer.parameters(), fx, fcos, fsin)}
        fake = saved(lambda: fake_layer(fx, position_embeddings=(fcos, fsin), attention_mask=None),
                     outside)
    assert fake == real
    assert sum(n for *_, n in fake) < sum(n for *_, n in eager)  # the partitioner recomputes the cheap ops
