"""How long a sequence a model can take: fixed position tables refuse longer ones, rotary and ALiBi models extend.

Read from the config.json values and the architecture table (`fixed_positions`); nothing is lowered.
"""

from __future__ import annotations

from typing import Any

from .architectures import has_flag
from .errors import FitplanError

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
    if has_flag(values.get("model_type"), "fixed_positions"):  # a longer sequence indexes past the table
        raise FitplanError(f"--seq-len {seq_len} exceeds {location}'s {field}={value}: its position table has "
                           f"{value} rows, so longer sequences cannot run.",
                           f"Use --seq-len {value} or less, or a model with rotary positions.")
    return (f"sequence length {seq_len} exceeds {field}={value}: assumes the context is extended (e.g. "
            "rope_scaling); memory and time are modelled, model quality at this length is not")
