"""Errors raised by sdpa_core.

Every error names the parameter it concerns, what was expected and what was got, so that the
service can turn it into a field-level 422 without parsing messages.
"""

from __future__ import annotations

from typing import Any


class SdpaError(Exception):
    """Base of every error sdpa_core raises on bad input (never on its own bugs)."""

    def __init__(self, message: str, *, param: str, expected: Any = None, got: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.expected = expected
        self.got = got

    def __str__(self) -> str:
        parts = [self.message]
        if self.expected is not None:
            parts.append(f"expected {self.expected}")
        if self.got is not None:
            parts.append(f"got {self.got}")
        return f"{self.param}: " + "; ".join(parts)


class ShapeError(SdpaError):
    """Ranks, dimensions or head counts that do not fit together."""


class MaskError(SdpaError):
    """A mask, key length or causal option that is malformed or does not broadcast."""


class DTypeError(SdpaError):
    """An unsupported dtype, or inputs whose dtypes disagree."""


class LimitError(SdpaError):
    """A request that would exceed a memory budget (for example the n^2 weight matrix)."""


class NonFiniteError(SdpaError):
    """NaN or Inf in an input, when allow_nonfinite is not set."""
