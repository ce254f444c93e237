"""The shape rules of a config.json: which dimensions must be positive integers and how they must divide.

Checked on the raw values before transformers or the lowering see them: a zero width divides by zero deep in the
cost model, and a negative position limit would be silently ignored. Fields that may be 0 (token ids, counts of
dense or shared layers) and fields that may be null (gpt2's n_inner, a missing sliding window) are left out.
"""

from __future__ import annotations

from typing import Any

from .errors import MalformedConfig

# Widths and counts that are null or absent when unused, but a positive integer when given.
POSITIVE_FIELDS = (
    "intermediate_size", "ffn_dim", "n_inner", "head_dim", "num_key_value_heads", "num_kv_heads",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_local_experts",
    "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rotary_dim", "word_embed_proj_dim", "n_group", "topk_group",
    # The longest sequence: positions.py reads the first one given, so a non-positive one must not hide.
    "max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length",
)
# The names config.json files give the hidden size and the attention heads (graphs.sources requires one of each).
HIDDEN_ALIASES = ("hidden_size", "n_embd", "d_model", "hidden_dim")
HEADS_ALIASES = ("num_attention_heads", "n_head", "num_heads")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")


def check_dimensions(values: dict[str, Any], location: str) -> None:
    """Raise `MalformedConfig` naming the file and field when a dimension is not a positive integer, or when
    heads, key-value heads, experts or expert groups do not divide as the HF modeling code assumes."""
    for field in POSITIVE_FIELDS:
        value = values.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise MalformedConfig(f"{location}: field '{field}' must be a positive integer (or absent), got "
                                  f"{value!r}", f"Fix '{field}' in the config file.")
    _check_heads(values, location)
    _check_experts(values, location)


def _first(values: dict[str, Any], aliases: tuple[str, ...]) -> Any:
    return next((values[a] for a in aliases if values.get(a) is not None), None)


def _check_heads(values: dict[str, Any], location: str) -> None:
    """Heads split the hidden size (unless head_dim is given) and key-value heads divide the query heads."""
    hidden, heads = _first(values, HIDDEN_ALIASES), _first(values, HEADS_ALIASES)
    if hidden is None or heads is None:
        return
    if heads > hidden:
        raise MalformedConfig(f"{location}: {heads} attention heads for hidden size {hidden}: at most one head per "
                              "hidden unit.", "Fix num_attention_heads or hidden_size in the config file.")
    if values.get("head_dim") is None and hidden % heads:
        raise MalformedConfig(f"{location}: hidden size {hidden} is not a multiple of the {heads} attention heads.",
                              "Fix hidden_size or num_attention_heads, or give head_dim.")
    for field in ("num_key_value_heads", "num_kv_heads"):
        kv = values.get(field)
        if kv is not None and heads % kv:
            raise MalformedConfig(f"{location}: {field}={kv} must divide num_attention_heads={heads}.",
                                  f"Fix {field} in the config file.")


def _check_experts(values: dict[str, Any], location: str) -> None:
    """A token is routed to at most all experts; expert groups split the experts and top-k groups are among them."""
    experts, top_k = _first(values, _EXPERTS), values.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        raise MalformedConfig(f"{location}: num_experts_per_tok={top_k} exceeds the {experts} experts.",
                              "Fix num_experts_per_tok in the config file.")
    groups, top_groups = values.get("n_group"), values.get("topk_group")
    if groups is not None and experts is not None and experts % groups:
        raise MalformedConfig(f"{location}: n_group={groups} must divide the {experts} routed experts.",
                              "Fix n_group in the config file.")
    if groups is not None and top_groups is not None and top_groups > groups:
        raise MalformedConfig(f"{location}: topk_group={top_groups} exceeds n_group={groups}.",
                              "Fix topk_group in the config file.")
