"""The model's architecture as a launcher that builds the model itself (Megatron-LM) needs it: sizes from the
lowered graph, and the block design (norm, MLP, positions, tying, biases) from the model's config.json."""

from __future__ import annotations

from typing import Any

from graphs import LayerGraph, Role
from graphs.architectures import has_flag, router_pre_softmax
from solver.plan.record import ModelShape, RopeScaling


def model_shape(graph: LayerGraph, values: dict[str, Any], *, seq_len: int) -> ModelShape:
    """The shape of the model `values` (its config.json) describes, sized as `graph` measured it."""
    text = values.get("text_config") or values
    dims = graph.dims
    rms = "rms_norm_eps" in text
    epsilon = text.get("rms_norm_eps") or text.get("layer_norm_eps") or text.get("layer_norm_epsilon")
    activation = str(text.get("hidden_act") or text.get("activation_function") or
                     _class_default(graph.model_type, "hidden_act", ""))
    rope_theta = _rope_theta(text, graph.model_type)
    rope = rope_theta is not None or "rope_scaling" in text or "rotary_pct" in text
    # Where config.json omits the bias flags: Llama-style blocks have no linear biases, and the architecture table
    # names the families that keep a bias on q, k and v only (Qwen2) and that normalise each head's queries and keys.
    qkv_bias = has_flag(graph.model_type, "qkv_bias_only")
    bias = text.get("attention_bias", text.get("bias", text.get("mlp_bias")))
    return ModelShape(
        heads=dims.heads, kv_heads=dims.kv_heads, head_dim=dims.head_dim, ffn_hidden=dims.intermediate,
        vocab=dims.vocab, max_positions=max(seq_len, int(text.get("max_position_embeddings") or
                                                         text.get("n_positions") or seq_len)),
        normalization="RMSNorm" if rms else "LayerNorm", norm_epsilon=None if epsilon is None else float(epsilon),
        gated_silu=activation in ("silu", "swish"), rope=rope,
        rope_theta=rope_theta, rope_scaling=_rope_scaling(text) if rope else None,
        tied_embeddings=bool(values.get("tie_word_embeddings", text.get("tie_word_embeddings", _traced_tied(graph)))),
        linear_bias=(not rms) if bias is None else bool(bias), qkv_bias=qkv_bias, experts=dims.experts,
        top_k=dims.top_k, expert_ffn_hidden=int(text.get("moe_intermediate_size") or 0) if dims.experts else 0,
        aux_loss_coeff=float(_given(text, "router_aux_loss_coef", graph.model_type, 0.0) or 0.0)
        if dims.experts else 0.0,
        router_pre_softmax=router_pre_softmax(graph.model_type,
                                              bool(_given(text, "norm_topk_prob", graph.model_type, True)))
        if dims.experts else False,
        qk_norm=has_flag(graph.model_type, "qk_norm"),
        attention_dropout=_dropout(text, _ATTENTION_DROPOUT), hidden_dropout=_dropout(text, _HIDDEN_DROPOUT))


def _rope_theta(text: dict[str, Any], model_type: str) -> float | None:
    """RoPE's base as config.json states it, else the config class's default where the family rotates its
    positions (a config.json may leave rope_theta out: transformers then builds the model with the class's base);
    None for a family with a fixed position table."""
    given = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta") or \
        text.get("rotary_emb_base")
    if given is not None:
        return float(given)
    if has_flag(model_type, "fixed_positions"):
        return None
    default = _class_default(model_type, "rope_parameters", None)  # transformers 5: {"rope_theta": ..., ...}
    return float(default["rope_theta"]) if isinstance(default, dict) and "rope_theta" in default else None


def _rope_scaling(text: dict[str, Any]) -> RopeScaling | None:
    """The RoPE scaling config.json states (`rope_scaling`, or transformers 5's `rope_parameters`), or None."""
    values = text.get("rope_scaling") or text.get("rope_parameters") or {}
    kind = values.get("rope_type") or values.get("type")
    if kind in (None, "default"):
        return None

    def number(key: str) -> float | None:
        return None if values.get(key) is None else float(values[key])

    original = values.get("original_max_position_embeddings")
    return RopeScaling(kind=str(kind), factor=number("factor") or 1.0, low_freq_factor=number("low_freq_factor"),
                       high_freq_factor=number("high_freq_factor"),
                       original_max_positions=None if original is None else int(original))


# config.json's dropout keys across families (Llama/Qwen/Mistral: attention_dropout and no hidden dropout; GPT-2,
# CodeGen, Phi: attn_pdrop/resid_pdrop; Falcon, GPT-NeoX, Bloom: hidden_dropout; OPT: dropout).
_ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
_HIDDEN_DROPOUT = ("hidden_dropout", "resid_pdrop", "hidden_dropout_prob", "dropout")


def _dropout(text: dict[str, Any], keys: tuple[str, ...]) -> float:
    """The first of `keys` config.json states as a number, else 0 (the model was trained without it)."""
    for key in keys:
        value = text.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return 0.0


def _traced_tied(graph: LayerGraph) -> bool:
    """Whether the traced model ties its LM head to the embedding (the lowering counts a tied weight once, on the
    embedding, so the head node has none): what transformers' config class decided when config.json is silent,
    read without importing transformers (a cached lowering needs no import)."""
    heads = [layer for layer in graph.nodes() if layer.role is Role.HEAD]
    return bool(heads) and not any(layer.params for layer in heads)


def _given(text: dict[str, Any], key: str, model_type: str, fallback: Any) -> Any:
    """config.json's `key`, else the config class's default (transformers is imported only then)."""
    return text[key] if key in text else _class_default(model_type, key, fallback)


def _class_default(model_type: str, key: str, fallback: Any) -> Any:
    """What transformers' config class of the family sets for `key` when config.json leaves it out (Qwen3Config:
    hidden_act silu; MixtralConfig and LlamaConfig: untied embeddings; GPT2Config: tied): the lowering builds the
    model from the same class. `fallback` (PretrainedConfig's own default) for a type transformers does not know."""
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.for_model(model_type), key, fallback)
    except ValueError:
        return fallback
