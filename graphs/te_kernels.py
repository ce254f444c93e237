"""The GPU kernels a default Megatron-LM run uses, in CPU form for megatron-core's GPT layers on fake tensors.

Megatron-LM's defaults (core_v0.16.1: `transformer_impl="transformer_engine"`, `attention_backend=auto`, and the
`--no-bias-swiglu-fusion` / `--no-rope-fusion` flags unset) run three kernels the local spec does not. Each is
given here as what it saves for backward, which is all the lowering measures:
- attention: Transformer Engine's flash attention (Tri Dao's kernel before Hopper, cuDNN's fused attention from
  Hopper on: TE's preference where both apply, NeMo's memory-optimisation guide, "Flash Attention") saves q, k and
  v (k and v not repeated for GQA), its output and the fp32 log-sum-exp of each query row (flash-attn
  `FlashAttnFunc.forward`: `save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)`; TE `FusedAttnFunc`:
  q, k, v, out and the (b, h, s, 1) fp32 softmax statistics). The CPU stand-in is `F.scaled_dot_product_attention`,
  whose CPU flash kernel saves exactly these. The output goes back to Megatron's (s, b, h*d) layout as a copy, as
  TE does for flash-attn (`transpose(0, 1).contiguous()`); cuDNN's kernel writes that layout directly, so on Hopper
  one (s, b, h*d) tensor per layer is priced above what is held;
- SwiGLU: megatron's own `SwiGLUFunction` (`bias_activation_fusion`, `fusions/fused_bias_swiglu.py`) saves only
  its input. It runs as is; its `torch.compile`d helpers become one op each, as the fused kernels they compile to;
- RoPE: TE's `FusedRoPEFunc` (`apply_rope_fusion`) saves only the frequency table (`save_for_backward(freqs)`),
  which megatron keeps anyway. `FusedRope` below is that Function on the CPU.
Each fused kernel is one recorded op (a `fitplan::` custom op) reading its inputs and writing its output once, as
the GPU kernel does, so the time model sees one launch and its traffic, not the unfused ops' (the custom ops
compute on real tensors, and only shapes on fake ones).
The norms need nothing new: TE's fused RMSNorm (inside `TELayerNormColumnParallelLinear`) saves the input, the fp32
rstd and the normalised output for the GEMM, as `titan.cuda_rms_norm` plus a separate linear do. The loss stays the
unfused `vocab_parallel_cross_entropy` (`cross_entropy_loss_fusion` is off by default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class FlashCoreAttention(DotProductAttention):
    """Megatron's core attention as TE's flash attention runs it (causal, no materialised scores)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention biases are not lowered")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # (s, b, h, d) -> (b, h, s, d), views
        dropout = self.attention_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rope(t: torch.Tensor, freqs: torch.Tensor, sign: int) -> torch.Tensor:
    """Over the first freqs.shape[-1] channels (the rest passed through): x cos + rotate_half(x) sin for sign 1, its
    transpose (the backward) x cos - rotate_half(x sin) for sign -1."""
    width = freqs.shape[-1]
    rotated, rest = t[..., :width], t[..., width:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    turned = _rotate_half(rotated) * sin if sign > 0 else -_rotate_half(rotated * sin)
    return torch.cat((rotated * cos + turned, rest), dim=-1)


@torch.library.custom_op("fitplan::te_rope", mutates_args=(), schema="(Tensor t, Tensor freqs) -> Tensor")
def rope_kernel(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """TE's fused RoPE forward kernel: y = x cos + rotate_half(x) sin."""
    return _rope(t, freqs, 1)


@torch.library.custom_op("fitplan::te_rope_back", mutates_args=(), schema="(Tensor grad, Tensor freqs) -> Tensor")
def rope_back_kernel(grad: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """TE's fused RoPE backward kernel: the inverse rotation g cos - rotate_half(g sin)."""
    return _rope(grad, freqs, -1)


@rope_kernel.register_fake
def _(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


@rope_back_kernel.register_fake
def _(grad: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


class FusedRope(torch.autograd.Function):
    """TE's fused RoPE on (s, b, h, d), keeping only `freqs` for backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(freqs)
        return rope_kernel(t, freqs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (freqs,) = ctx.saved_tensors
        return rope_back_kernel(grad, freqs), None


@torch.library.custom_op("fitplan::te_swiglu", mutates_args=(), schema="(Tensor y) -> Tensor")
def swiglu_kernel(y: torch.Tensor) -> torch.Tensor:
    """megatron's compiled `swiglu`: silu(y1) * y2 for the halves of y."""
    gate, up = torch.chunk(y, 2, -1)
    return F.silu(gate) * up


@torch.library.custom_op("fitplan::te_swiglu_back", mutates_args=(), schema="(Tensor g, Tensor y) -> Tensor")
def swiglu_back_kernel(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """megatron's compiled `swiglu_back`: the gradient of silu(y1) * y2 with respect to y."""
    gate, up = torch.chunk(y, 2, -1)
    sigmoid = torch.sigmoid(gate)
    return torch.cat((g * sigmoid * (1 + gate * (1 - sigmoid)) * up, g * F.silu(gate)), -1)


@swiglu_kernel.register_fake
def _(y: torch.Tensor) -> torch.Tensor:
    return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))


@swiglu_back_kernel.register_fake
def _(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(y)


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`rope_utils.fused_apply_rotary_pos_emb`'s signature (megatron's TE extension)."""
    if interleaved:
        raise NotImplementedError("interleaved RoPE is not lowered")
    return FusedRope.apply(t, freqs)


# megatron's compiled helpers, by the kernel that stands in for each (Llama and Qwen2 have no MLP bias, so the bias
# variants keep their eager code).
_SWIGLU_HELPERS = {"swiglu": swiglu_kernel, "swiglu_back": swiglu_back_kernel}
_EAGER_HELPERS = ("bias_swiglu", "bias_swiglu_back")


@contextlib.contextmanager
def te_kernels() -> Iterator[None]:
    """Install the CPU forms (call around building and running the model: TransformerConfig checks that a fused
    RoPE exists): TE's fused RoPE in `rope_utils`, and megatron's SwiGLU helpers as one kernel each."""
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.models.common.embeddings import rope_utils

    saved_rope = rope_utils.fused_apply_rotary_pos_emb
    saved_helpers = {name: getattr(fused_bias_swiglu, name) for name in (*_SWIGLU_HELPERS, *_EAGER_HELPERS)}
    rope_utils.fused_apply_rotary_pos_emb = fused_rope
    for name, helper in saved_helpers.items():
        setattr(fused_bias_swiglu, name, _SWIGLU_HELPERS.get(name) or getattr(helper, "_torchdynamo_orig_callable",
                                                                              helper))
    try:
        yield
    finally:
        rope_utils.fused_apply_rotary_pos_emb = saved_rope
        for name, helper in saved_helpers.items():
            setattr(fused_bias_swiglu, name, helper)


__all__ = ["FlashCoreAttention", "FusedRope", "fused_rope", "rope_back_kernel", "rope_kernel", "swiglu_back_kernel",
           "swiglu_kernel", "te_kernels"]
