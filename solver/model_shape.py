"""The model's architecture as a launcher that builds the model itself (Megatron-LM) needs it: sizes from the
lowered graph, and the block design (norm, MLP, positions, tying, biases) from the model's config.json."""

from __future__ import annotations

from typing import Any

from graphs import LayerGraph

from .plan import ModelShape

# Families whose config.json omits the bias flags: Llama-style blocks have no linear biases; Qwen2 keeps a
# bias on the q/k/v projections only (transformers models/qwen2/modeling_qwen2.py: q_proj(..., bias=True)).
_QKV_BIAS_ONLY = frozenset({"qwen2", "qwen2_moe"})


def model_shape(graph: LayerGraph, values: dict[str, Any], *, seq_len: int) -> ModelShape:
    """The shape of the model `values` (its config.json) describes, sized as `graph` measured it."""
    text = values.get("text_config") or values
    dims = graph.dims
    rms = "rms_norm_eps" in text
    epsilon = text.get("rms_norm_eps") or text.get("layer_norm_eps") or text.get("layer_norm_epsilon")
    activation = str(text.get("hidden_act") or text.get("activation_function") or "")
    rope_theta = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta") or \
        text.get("rotary_emb_base")
    rope = rope_theta is not None or "rope_scaling" in text or "rotary_pct" in text
    qkv_bias = graph.model_type in _QKV_BIAS_ONLY
    bias = text.get("attention_bias", text.get("bias", text.get("mlp_bias")))
    return ModelShape(
        heads=dims.heads, kv_heads=dims.kv_heads, head_dim=dims.head_dim, ffn_hidden=dims.intermediate,
        vocab=dims.vocab, max_positions=max(seq_len, int(text.get("max_position_embeddings") or
                                                         text.get("n_positions") or seq_len)),
        normalization="RMSNorm" if rms else "LayerNorm", norm_epsilon=None if epsilon is None else float(epsilon),
        gated_silu=activation in ("silu", "swish"), rope=rope,
        rope_theta=None if rope_theta is None else float(rope_theta),
        tied_embeddings=bool(values.get("tie_word_embeddings", text.get("tie_word_embeddings",
                                                                         _tied_by_default(graph.model_type)))),
        linear_bias=(not rms) if bias is None else bool(bias), qkv_bias=qkv_bias, experts=dims.experts,
        top_k=dims.top_k, expert_ffn_hidden=int(text.get("moe_intermediate_size") or 0) if dims.experts else 0)


def _tied_by_default(model_type: str) -> bool:
    """Whether transformers ties the model family's embeddings when config.json does not say (MixtralConfig and
    LlamaConfig do not, GPT2Config does): the lowering builds the model from the same config class."""
    from transformers import AutoConfig

    try:
        return bool(AutoConfig.for_model(model_type).tie_word_embeddings)
    except ValueError:  # a model type transformers does not know: PretrainedConfig's own default
        return True
