"""Byte counts written by clients in headers (Content-Length, Inference-Header-Content-Length),
read with a bound on their length: the one parser of them.

int() reads far more than a header's decimal number: other scripts' digits ("١٢"), underscores
("1_000"), signs; and it refuses text of more than 4,300 digits with a ValueError (CPython's
limit on integer string conversion, CVE-2020-10735, checked on 3.11.7), which unguarded was a
500 with a traceback (5,000 leading zeros in Content-Length; llhttp passes such a header on,
leading zeros never overflow its 64-bit count). A length here is ASCII digits, surrounded by
optional whitespace; its leading zeros do not count, and one of more than MAX_LENGTH_DIGITS
digits is larger than any limit of the service, so it reads as BEYOND_ANY_LIMIT whatever its
digits.
"""

from __future__ import annotations

from typing import Final

# Every size setting of the service is below 10**18 bytes.
MAX_LENGTH_DIGITS: Final = 18
BEYOND_ANY_LIMIT: Final = 10**MAX_LENGTH_DIGITS


def parse_length(text: str | bytes) -> int | None:
    """The byte count `text` writes (BEYOND_ANY_LIMIT past MAX_LENGTH_DIGITS significant
    digits), or None when it is not ASCII digits."""
    stripped = text.strip()
    if isinstance(stripped, str):
        if not stripped.isascii():  # str.isdigit() takes "²", which int() refuses
            return None
        stripped = stripped.encode("ascii")
    if not stripped.isdigit():  # bytes.isdigit: ASCII digits only
        return None
    significant = stripped.lstrip(b"0")
    if len(significant) > MAX_LENGTH_DIGITS:
        return BEYOND_ANY_LIMIT
    return int(significant or b"0")
