"""User-facing errors: one family, each with a message and an actionable hint.

Only the CLI turns these into exit codes; library callers catch `FitplanError`.
"""

from __future__ import annotations


class FitplanError(Exception):
    """A problem with the user's input or request, explained with a way out."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n{self.hint}" if self.hint else self.message


class UnknownModel(FitplanError):
    """The model name is not in the catalog, not a local path and not in the HF cache."""


class MalformedConfig(FitplanError):
    """A config file exists but cannot be read or is missing a required field."""


class UnsupportedModel(FitplanError):
    """The architecture cannot be lowered (unknown to transformers, or not a causal LM)."""
