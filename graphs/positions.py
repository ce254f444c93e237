"""How long a sequence a model can take: fixed position tables refuse longer ones, rotary and ALiBi models extend.

Read from the config.json values; nothing is lowered or imported.
"""

from __future__ import annotations

from typing import Any

from .errors import FitplanError

# Architectures whose positions index a table of fixed size: a learned nn.Embedding (gpt2, gpt_bigcode,
# gpt_neo, opt, biogpt, openai-gpt) or a precomputed sinusoidal buffer (codegen, gptj) of
# max_position_embeddings / n_positions rows (transformers 5, models/<type>/modeling_<type>.py). A longer
# sequence indexes past the table and fails at run time.
FIXED_POSITION_TYPES = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt", "openai-gpt", "codegen", "gptj"})
_LIMIT_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def position_limit(values: dict[str, Any]) -> tuple[str, int] | None:
    """The config field that states the model's longest sequence, and its value (None when none is stated)."""
    for field in _LIMIT_FIELDS:
        value = values.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return field, value
    return None


def sequence_note(values: dict[str, Any], seq_len: int, *, location: str) -> str | None:
    """None when `seq_len` is within the model's positions; an assumption (in words) for a rotary/ALiBi model
    asked for more; an error for a model with a fixed position table."""
    limit = position_limit(values)
    if limit is None or seq_len <= limit[1]:
        return None
    field, value = limit
    if values.get("model_type") in FIXED_POSITION_TYPES:
        raise FitplanError(f"--seq-len {seq_len} exceeds {location}'s {field}={value}: its position table has "
                           f"{value} rows, so longer sequences cannot run.",
                           f"Use --seq-len {value} or less, or a model with rotary positions.")
    return (f"sequence length {seq_len} exceeds {field}={value}: assumes the context is extended (e.g. "
            "rope_scaling); memory and time are modelled, model quality at this length is not")
