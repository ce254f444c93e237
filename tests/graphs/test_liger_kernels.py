"""Liger's lowering (graphs/liger.py) against real Liger-patched models trained on CPU.

The reference (`liger_reference.py`) builds the model with real weights, applies liger-kernel's own patch and runs
one forward and backward with its Triton kernels executed by Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess); saved-tensor hooks count what autograd keeps per decoder layer (`reference._measure`). The lowering
runs the same patched code on fake tensors at the probe shapes; this shape is one it never traced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphs import Checkpoint, Role, lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

pytest.importorskip("liger_kernel")
pytest.importorskip("triton")

from graphs.liger import LIGER_KERNELS  # after the skips: needs liger-kernel

UNSEEN_B, UNSEEN_S = 3, 24  # probes use b in {2, 4} and s in {32, 64, 96}; few rows keep the interpreter quick
ROOT = Path(__file__).resolve().parents[2]


def _reference(values: dict, *, attention: str, lora: dict | None = None) -> dict:
    request = {"values": values, "b": UNSEEN_B, "s": UNSEEN_S, "dtype": "bfloat16", "attention": attention,
               "kernels": LIGER_KERNELS, "lora": lora}
    done = subprocess.run([sys.executable, "-m", "tests.graphs.liger_reference", json.dumps(request)], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {}


def _lowered(arch: str, tmp_path_factory: pytest.TempPathFactory, cache: dict) -> tuple:
    if arch not in cache:
        folder = write_config(tmp_path_factory.mktemp(arch), tiny_values(arch))
        cache[arch] = (lower(str(folder), dtype="bfloat16", use_cache=False, liger=True),
                       lower(str(folder), dtype="bfloat16", use_cache=False))
    return cache[arch]


def _layer_saved(graph) -> list[int]:
    saved = [layer.cost().saved(UNSEEN_B, UNSEEN_S) for layer in graph.decoder_layers()]
    saved[0] += graph.shared(UNSEEN_B, UNSEEN_S)  # rotary cos/sin: the reference books them on the first saver
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])  # SwiGLU, SwiGLU with q/k norms, GeGLU (gemma norms)
def test_saved_bytes_equal_the_patched_model_s(arch, tmp_path_factory, graphs):
    """Per decoder layer and in total, exactly what the real patched model saves; less than HF's eager layers."""
    liger, eager = _lowered(arch, tmp_path_factory, graphs)
    assert liger.liger and not eager.liger
    ref = _reference(tiny_values(arch), attention=liger.attention)
    saved = _layer_saved(liger)
    assert saved == ref["layer_saved"]
    rest = sum(node.cost().saved(UNSEEN_B, UNSEEN_S) for node in liger.nodes() if node.role is not Role.DECODER)
    assert rest + sum(saved) == ref["total_saved"]
    assert [layer.cost().forward.flops(UNSEEN_B, UNSEEN_S) for layer in liger.decoder_layers()] == \
        ref["layer_forward_flops"]
    assert all(a < b for a, b in zip(saved, _layer_saved(eager), strict=True))


@pytest.mark.slow
def test_saved_bytes_with_lora_adapters_equal_the_patched_peft_model_s(tmp_path):
    """LoRA on every linear layer under Liger's patch (the common "LoRA with Liger" fine-tune): the adapted
    projections feed Liger's SwiGLU and RoPE, which save the LoRA-summed outputs, not HF's intermediates."""
    pytest.importorskip("peft")
    from graphs.adapters import LoraSpec

    folder = write_config(tmp_path / "llama", tiny_values("llama"))
    graph = lower(str(folder), dtype="bfloat16", use_cache=False, liger=True, lora=LoraSpec(rank=8, alpha=16))
    ref = _reference(tiny_values("llama"), attention=graph.attention,
                     lora={"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0})
    saved = _layer_saved(graph)
    assert saved[1:] == ref["layer_saved"][1:]
    # The first layer over-counts, as the eager LoRA lowering does (by 37 KB here): with frozen embeddings its
    # input needs no gradient, so in a real run its input norm records no autograd node and saves nothing, while
    # every traced layer sees an input that does (graphs/probe.py traces layers behind a dummy one). Under Liger
    # that is exactly the norm's X (bf16) and fp32 rstd per row.
    tokens = UNSEEN_B * UNSEEN_S
    assert saved[0] - ref["layer_saved"][0] == tokens * graph.dims.hidden * 2 + tokens * 4


def test_each_kernel_is_one_launch_and_the_patch_is_undone(tmp_path_factory, graphs):
    """A Llama layer runs 4 Liger kernels each way (two RMSNorms, RoPE, SwiGLU); the norm's forward moves X and W
    in, Y and the fp32 rstd out. The modeling code and liger-kernel's Triton kernels are restored afterwards."""
    import liger_kernel.ops.rms_norm as rms_norm
    import transformers.models.llama.modeling_llama as modeling_llama
    from triton.runtime.jit import KernelInterface

    liger, eager = _lowered("llama", tmp_path_factory, graphs)
    assert modeling_llama.apply_rotary_pos_emb.__module__ == modeling_llama.__name__
    assert isinstance(rms_norm._rms_norm_forward_kernel, KernelInterface)
    layer, plain = liger.decoder_layers()[1].cost(), eager.decoder_layers()[1].cost()
    assert layer.forward.kernels(UNSEEN_B, UNSEEN_S) < plain.forward.kernels(UNSEEN_B, UNSEEN_S)
    assert layer.forward.flops(UNSEEN_B, UNSEEN_S) == plain.forward.flops(UNSEEN_B, UNSEEN_S)
    norm = next(node for node in liger.nodes() if node.role is Role.NORM).cost()
    tokens, hidden = UNSEEN_B * UNSEEN_S, liger.dims.hidden
    assert norm.forward.kernels(UNSEEN_B, UNSEEN_S) == 1
    assert norm.forward.io_bytes(UNSEEN_B, UNSEEN_S) == 2 * tokens * hidden * 2 + hidden * 2 + 4 * tokens


def test_checkpointed_liger_layers_keep_only_their_input(tmp_path_factory, graphs):
    liger, eager = _lowered("llama", tmp_path_factory, graphs)
    full = [layer.cost(Checkpoint.FULL).saved(UNSEEN_B, UNSEEN_S) for layer in liger.decoder_layers()]
    assert full == [layer.cost(Checkpoint.FULL).saved(UNSEEN_B, UNSEEN_S) for layer in eager.decoder_layers()]


def test_liger_lowering_is_refused_with_compile_and_torchtitan():
    with pytest.raises(ValueError, match="torchtitan"):
        lower("meta-llama/Llama-3.2-1B", runtime="torchtitan", liger=True)
    with pytest.raises(ValueError, match=r"torch\.compile"):
        lower("meta-llama/Llama-3.2-1B", liger=True, compiled=True)
