"""The message pydantic_core.from_json gives for invalid JSON, for a body it never parsed whole.

A body parsed in pieces (service.wire.json_arrays) must be refused with the words and the
position from_json would have given for the whole body ("expected `,` or `]` at line 1 column
4"). from_json stops at the first error; so the piece of text around the first error is parsed
alone, prefixed so that the parser is in the same state there, and the position it reports is
carried back to the body.

Positions as jiter writes them (pydantic_core 2.50.5, checked by tests/service/wire/
test_json_arrays.py): lines count b"\\n" only; within the body the column is the byte offset
from the line's first byte, counting from 1, and 0 for the newline itself; past the body's end
(an "EOF while parsing ..." error) it is the length of the last line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import numpy as np
from pydantic_core import from_json

from service.wire.bytecount import occurrences

_NEWLINE: Final = ord("\n")
_WINDOW: Final = 1 << 20
_AT: Final = re.compile(r"(?P<what>.*) at line (?P<line>\d+) column (?P<column>\d+)", re.S)


@dataclass(frozen=True, slots=True)
class JsonError:
    """What from_json said, and where: its words and the index in the text it parsed."""

    what: str
    index: int


def position(text: bytes, index: int) -> tuple[int, int]:
    """(line, column) of text[index] as from_json writes them (index == len(text): the end)."""
    if index < len(text):
        line_start = text.rfind(b"\n", 0, index + 1) + 1
        return 1 + occurrences(text, _NEWLINE, end=index + 1), index + 1 - line_start
    line_start = text.rfind(b"\n") + 1
    return 1 + occurrences(text, _NEWLINE), len(text) - line_start


def message(text: bytes, error: JsonError) -> str:
    """from_json's message for `error` in `text`."""
    line, column = position(text, error.index)
    return f"{error.what} at line {line} column {column}"


def parse_error(text: bytes, *, allow_inf_nan: bool) -> JsonError | None:
    """Where from_json finds `text` invalid, or None when it parses (or says something this
    module cannot place)."""
    try:
        from_json(text, allow_inf_nan=allow_inf_nan)
    except ValueError as exc:  # from_json's only way to say the text is not JSON
        found = _AT.fullmatch(str(exc))
        if found is None:
            return None
        at_end = found["what"].startswith("EOF")  # jiter's words for running out of text
        index = _index(text, int(found["line"]), int(found["column"]), at_end=at_end)
        return None if index is None else JsonError(found["what"], index)
    return None


def _index(text: bytes, line: int, column: int, *, at_end: bool) -> int | None:
    """The index whose position is (line, column): the inverse of position(). The end of the
    text and its last byte can share a position: `at_end` says which the error is at."""
    if at_end:
        return len(text) if position(text, len(text)) == (line, column) else None
    line_start = 0 if line == 1 else _after_newline(text, line - 1)
    if line_start is None:
        return None
    index = line_start + column - 1 if column else line_start - 1  # column 0: the newline
    if not 0 <= index < len(text) or position(text, index) != (line, column):
        return None
    return index


def _after_newline(text: bytes, count: int) -> int | None:
    """The index after the `count`-th newline of `text`, counted a window at a time."""
    seen = 0
    for start in range(0, len(text), _WINDOW):
        b = np.frombuffer(text, dtype=np.uint8, count=min(_WINDOW, len(text) - start), offset=start)
        newlines = np.flatnonzero(b == _NEWLINE)
        if seen + len(newlines) >= count:
            return start + int(newlines[count - seen - 1]) + 1
        seen += len(newlines)
    return None
