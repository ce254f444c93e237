"""The GPU kernels a default Megatron-LM run uses, in CPU form for megatron-core's GPT layers on fake tensors.

Megatron-LM's defaults (core_v0.16.1: `transformer_impl="transformer_engine"`, `attention_backend=auto`, and the
`--no-bias-swiglu-fusion` / `--no-rope-fusion` flags unset) run three kernels the local spec does not. Each is
given here as what it saves for backward, which is all the lowering measures:
- attention: Transformer Engine's flash attention (Tri Dao's kernel before Hopper, cuDNN's fused attention from
  Hopper on; TE's backend choice) saves q, k and v (k and v not repeated for GQA), its output and the fp32
  log-sum-exp of each query row (flash-attn `FlashAttnFunc.forward`: `save_for_backward(q, k, v, out_padded,
  softmax_lse, rng_state)`; TE `FusedAttnFunc`: q, k, v, out and the (b, h, s, 1) fp32 softmax statistics). The
  CPU stand-in is `F.scaled_dot_product_attention`, whose CPU flash kernel saves exactly these. The output goes back
  to Megatron's (s, b, h*d) layout as a copy, as TE does for flash-attn (`transpose(0, 1).contiguous()`); cuDNN's
  kernel writes that layout directly, so on Hopper one (s, b, h*d) tensor per layer is priced above what is held;
- SwiGLU: megatron's own `SwiGLUFunction` (`bias_activation_fusion`, `fusions/fused_bias_swiglu.py`) saves only
  its input. It runs as is; only its `torch.compile`d helpers run eagerly, which changes no saved tensor (they run
  inside the Function's no-grad forward);
- RoPE: TE's `FusedRoPEFunc` (`apply_rope_fusion`) saves only the frequency table (`save_for_backward(freqs)`),
  which megatron keeps anyway. `FusedRope` below is that Function on the CPU.
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


class FusedRope(torch.autograd.Function):
    """TE's fused RoPE on (s, b, h, d): y = x cos + rotate_half(x) sin, keeping only `freqs` for backward, whose
    gradient is the inverse rotation g cos - rotate_half(g sin)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(freqs)
        width = freqs.shape[-1]
        rotated, rest = t[..., :width], t[..., width:]
        cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        return torch.cat((rotated * cos + _rotate_half(rotated) * sin, rest), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (freqs,) = ctx.saved_tensors
        width = freqs.shape[-1]
        rotated, rest = grad[..., :width], grad[..., width:]
        cos, sin = torch.cos(freqs).to(grad.dtype), torch.sin(freqs).to(grad.dtype)
        return torch.cat((rotated * cos - _rotate_half(rotated * sin), rest), dim=-1), None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`rope_utils.fused_apply_rotary_pos_emb`'s signature (megatron's TE extension)."""
    if interleaved:
        raise NotImplementedError("interleaved RoPE is not lowered")
    return FusedRope.apply(t, freqs)


_SWIGLU_HELPERS = ("swiglu", "bias_swiglu", "swiglu_back", "bias_swiglu_back")


@contextlib.contextmanager
def te_kernels() -> Iterator[None]:
    """Install the CPU forms (call around building and running the model: TransformerConfig checks that a fused
    RoPE exists): TE's fused RoPE in `rope_utils`, and megatron's SwiGLU helpers eager."""
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.models.common.embeddings import rope_utils

    saved_rope = rope_utils.fused_apply_rotary_pos_emb
    saved_helpers = {name: getattr(fused_bias_swiglu, name) for name in _SWIGLU_HELPERS}
    rope_utils.fused_apply_rotary_pos_emb = fused_rope
    for name, helper in saved_helpers.items():
        setattr(fused_bias_swiglu, name, getattr(helper, "_torchdynamo_orig_callable", helper))
    try:
        yield
    finally:
        rope_utils.fused_apply_rotary_pos_emb = saved_rope
        for name, helper in saved_helpers.items():
            setattr(fused_bias_swiglu, name, helper)


__all__ = ["FlashCoreAttention", "FusedRope", "fused_rope", "te_kernels"]
