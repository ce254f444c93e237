"""Small versions of catalog architectures: same code paths, shapes small enough to trace in a second."""

from __future__ import annotations

from typing import Any

from graphs.catalog import load_entry

_COMMON = {"vocab_size": 512, "num_hidden_layers": 3}
_ATTN = {"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 256}

TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("meta-llama/Llama-3.2-1B", {**_ATTN, "num_key_value_heads": 2, "head_dim": 32}),
    "mistral": ("mistralai/Mistral-7B-v0.1", {**_ATTN, "num_key_value_heads": 2, "head_dim": 32}),
    "qwen2": ("Qwen/Qwen2.5-0.5B", {**_ATTN, "num_key_value_heads": 2}),
    "qwen3": ("Qwen/Qwen3-8B", {**_ATTN, "num_key_value_heads": 2, "head_dim": 32}),
    "gemma2": ("google/gemma-2-2b", {**_ATTN, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 4}),
    "phi3": ("microsoft/Phi-3-mini-4k-instruct", {**_ATTN, "num_key_value_heads": 4}),
    "olmo2": ("allenai/OLMo-2-1124-7B", {**_ATTN, "num_key_value_heads": 4}),
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1", {**_ATTN, "num_key_value_heads": 2, "head_dim": 32,
                                                 "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen/Qwen3-30B-A3B", {**_ATTN, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
                                          "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", {
        **_ATTN, "num_key_value_heads": 4, "moe_intermediate_size": 64, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 64,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "first_k_dense_replace": 1}),
    "gpt2": ("gpt2", {"n_embd": 128, "n_head": 4, "n_layer": 3, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                      "attn_pdrop": 0.0}),
    "opt": ("facebook/opt-125m", {"hidden_size": 128, "num_attention_heads": 4, "ffn_dim": 256,
                                  "word_embed_proj_dim": 128, "dropout": 0.0, "attention_dropout": 0.0}),
    "gpt_neox": ("EleutherAI/pythia-1b", {**_ATTN, "intermediate_size": 512}),
    "phi": ("microsoft/phi-2", {**_ATTN, "num_key_value_heads": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "falcon": ("tiiuae/falcon-7b", {"hidden_size": 128, "num_attention_heads": 4}),
    "bloom": ("bigscience/bloom-560m", {"hidden_size": 128, "n_head": 4, "n_layer": 3}),
    "codegen": ("Salesforce/codegen-350M-mono", {"n_embd": 128, "n_head": 4, "n_layer": 3, "rotary_dim": 16,
                                                  "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
}


def tiny_values(arch: str) -> dict[str, Any]:
    """The catalog config of `arch`'s model with small dimensions (keeps model_type and every other field)."""
    model_id, overrides = TINY[arch]
    values = load_entry(model_id).config_dict()
    for key in ("n_layer", "num_layers"):
        if key in values:
            values[key] = 3
    values.update({**_COMMON, **overrides})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if key in values:
            values[key] = 0
    return values
