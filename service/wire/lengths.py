"""Byte counts written by clients in headers, read with a bound on their length.

int() reads far more than a header's decimal number: other scripts' digits ("١٢"), underscores
("1_000"), signs; and it refuses text of 4,300 digits or more with a ValueError (CPython's limit
on integer string conversion, 3.11), which unguarded was a 500 with a traceback. A length here
is ASCII digits, surrounded by optional whitespace, with at most MAX_LENGTH_DIGITS once its
leading zeros are stripped.
"""

from __future__ import annotations

from typing import Final

# 19 digits hold every int64, and far more than any body's length.
MAX_LENGTH_DIGITS: Final = 19


def parse_length(text: str) -> int | None:
    """The byte count `text` writes, or None when it is not one (not ASCII digits, or more than
    MAX_LENGTH_DIGITS significant digits)."""
    digits = text.strip()
    # ASCII digits only: str.isdigit() alone also takes "²", which int() refuses.
    if not (digits.isascii() and digits.isdigit()):
        return None
    significant = digits.lstrip("0")
    if len(significant) > MAX_LENGTH_DIGITS:
        return None
    return int(significant or "0")
