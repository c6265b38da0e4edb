"""Byte counts in headers are read with a bound on their digits: 4,301 digits (which int()
refuses with a ValueError, once a 500) are a 400 naming the header; leading zeros do not
count."""

from __future__ import annotations

import pytest

from service.errors import InvalidRequest
from service.wire.lengths import BEYOND_ANY_LIMIT, MAX_LENGTH_DIGITS, parse_length
from service.wire.v2_codec import split_header


@pytest.mark.parametrize(
    ("text", "length"),
    [
        ("12", 12),
        (" 42\t", 42),
        ("0", 0),
        ("0" * 5000 + "7", 7),
        ("9" * 18, 999_999_999_999_999_999),
        ("1" * 19, BEYOND_ANY_LIMIT),  # past every limit of the service
        ("1" * 4301, BEYOND_ANY_LIMIT),
        (b"0" * 5000 + b"7", 7),  # bytes (a raw header) read alike
        ("", None),
        ("-1", None),
        ("+1", None),
        ("1_000", None),
        ("1e3", None),
        ("\u00b2", None),  # str.isdigit() takes it, int() does not
        ("\u0661\u0662", None),  # Arabic-Indic digits: int() reads 12
    ],
)
def test_a_length_is_ascii_digits_18_significant_at_most(
    text: str | bytes, length: int | None
) -> None:
    assert MAX_LENGTH_DIGITS == 18
    assert parse_length(text) == length


@pytest.mark.parametrize("length", ["1" * 4301, "0" * 5000 + "1" * 20])
def test_a_header_length_of_too_many_digits_is_a_400_naming_the_header(length: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        split_header(b"{}" * 8, length)
    exc = raised.value
    assert exc.status == 422  # v2 answers it 400 (service.api.errors)
    assert exc.detail.startswith("header Inference-Header-Content-Length: ")
    assert "in ASCII digits" in exc.detail
    assert exc.errors[0].loc == ("v2", "header")


def test_leading_zeros_do_not_count() -> None:
    body = b'{"inputs": []}' + b"\x00" * 4
    assert split_header(body, "0" * 5000 + "14") == (b'{"inputs": []}', 14)
