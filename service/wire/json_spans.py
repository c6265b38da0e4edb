"""Where a JSON body's big arrays of numbers lie, found with numpy over its bytes.

A span is an array value that holds only numbers, true, false, null (NaN and Infinity too),
commas, brackets and whitespace: no string, no object. The body is read a window at a time
(WINDOW bytes: every numpy call is bounded, and gives the GIL back between windows):
- runs: the stretches of bytes that could belong to a span, between two bytes that cannot
  (a quote among them); only runs of at least `min_bytes` are looked into, and only those
  outside strings kept: a quote opens or closes a string unless an odd run of backslashes
  precedes it, so a run lies in a string when an odd number of such quotes come before it;
- in a run, the arrays that open and close inside it and sit in no other such array (its
  maximal arrays): brackets counted from the run's start give each a level, and an array is
  maximal when no array around it both opens and closes inside the run.

A span is taken only where a JSON value may stand and nothing but JSON's own parse could say
otherwise: after a ':' (an object's value), after a '[' (an array's first element), or as the
whole body. A span after ',' could be an object's key (invalid JSON) and is left to the parser.

Bytes that break JSON's grammar are no concern here: a span holds only bytes that JSON allows
in an array of numbers, and its grammar and tokens are checked when it is parsed
(service.wire.span_layout, service.wire.json_arrays); everything else stays in the body that
from_json parses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

# Bytes read per numpy call: its temporaries stay in the cache (a cumulative sum over 1 MiB
# took 6.5 ms, over 256 KiB 0.26 ms), and the GIL goes back between calls.
WINDOW: Final = 1 << 18
# Bytes a span may hold: JSON's whitespace, brackets, commas, and what its numbers and the
# literals true, false, null, NaN, Infinity are written with.
SPAN_BYTES: Final = b" \t\n\r[],0123456789+-.eEtrufalsnNIiy"
_NOT_IN_SPAN: Final = np.ones(256, dtype=np.bool_)
_NOT_IN_SPAN[list(SPAN_BYTES)] = False
_WHITESPACE: Final = np.zeros(256, dtype=np.bool_)
_WHITESPACE[list(b" \t\n\r")] = True
_QUOTE: Final = ord('"')
_BACKSLASH: Final = ord("\\")
_OPEN: Final = ord("[")
_CLOSE: Final = ord("]")
_COLON: Final = ord(":")
_NO_EVENT: Final = np.iinfo(np.int64).max


@dataclass(frozen=True, slots=True)
class Span:
    """An array of numbers in the body: body[start] is its '[', body[end - 1] its ']'."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class _Run:
    """Bytes outside strings that may all belong to spans: body[start:end]."""

    start: int
    end: int


def find_spans(body: bytes, *, min_bytes: int, window: int = WINDOW) -> list[Span]:
    """The maximal arrays of numbers of at least `min_bytes` in `body`, in order, where a value
    stands (see the module's docstring)."""
    spans: list[Span] = []
    for run in _runs(body, min_bytes=min_bytes, window=window):
        spans.extend(_arrays_in_run(body, run, min_bytes=min_bytes, window=window))
    return spans


def _view(body: bytes, start: int, stop: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(body, dtype=np.uint8, count=stop - start, offset=start)


def _runs(body: bytes, *, min_bytes: int, window: int) -> list[_Run]:
    """The runs of at least `min_bytes`: stretches outside strings of bytes that SPAN_BYTES
    allows. A stretch between two bytes it does not allow lies inside a string when an odd
    number of quotes (unescaped) come before it: only the few long stretches are asked."""
    runs: list[_Run] = []
    quotes_before = 0  # unescaped quotes before the window
    last_plain = -1  # the last byte before the window that is not a backslash
    last_stop = -1  # the last byte before the window that no span may hold
    stop_in_string = False  # whether that byte lies in a string (or is its opening quote)
    for start in range(0, len(body), window):
        stop = min(len(body), start + window)
        b = _view(body, start, stop)
        quotes, last_plain = _unescaped_quotes(b, start, last_plain)
        # Most windows of a body of numbers hold no byte a span cannot (a cheap look first).
        if body[start:stop].translate(None, SPAN_BYTES):
            stops = np.flatnonzero(np.take(_NOT_IN_SPAN, b))
        else:
            stops = np.zeros(0, dtype=np.int64)
        if len(stops):
            ends = stops + start
            begins = np.empty_like(ends)
            begins[0] = last_stop
            begins[1:] = ends[:-1]
            for i in np.flatnonzero(ends - begins - 1 >= min_bytes):
                begin, end = int(begins[i]), int(ends[i])
                if begin == last_stop:
                    in_string = stop_in_string
                else:
                    seen = quotes_before + int(np.searchsorted(quotes, begin, side="right"))
                    in_string = bool(seen % 2)
                if not in_string:
                    runs.append(_Run(begin + 1, end))
            last_stop = int(ends[-1])
            seen = quotes_before + int(np.searchsorted(quotes, last_stop, side="right"))
            stop_in_string = bool(seen % 2)
        quotes_before += len(quotes)
    if len(body) - last_stop - 1 >= min_bytes and not stop_in_string:
        runs.append(_Run(last_stop + 1, len(body)))
    return runs


def _unescaped_quotes(
    b: npt.NDArray[np.uint8], start: int, last_plain: int
) -> tuple[npt.NDArray[np.int64], int]:
    """(body indices of the quotes in the window `b` that an even run of backslashes precedes,
    the last byte up to its end that is not a backslash). Outside strings a backslash is
    invalid JSON: from_json refuses it in the envelope."""
    quotes = np.flatnonzero(b == _QUOTE) + start
    backslashes = b == _BACKSLASH
    if not backslashes.any():
        # Only a quote that opens the window can follow backslashes (the window's before).
        if len(quotes) and quotes[0] == start and (start - 1 - last_plain) % 2:
            quotes = quotes[1:]
        return quotes, start + len(b) - 1
    plain = np.where(backslashes, -1, np.arange(start, start + len(b)))
    plain[0] = max(int(plain[0]), last_plain)
    last_plain_at = np.maximum.accumulate(plain)
    if len(quotes):
        local = quotes - start
        before = np.where(local > 0, last_plain_at[local - 1], last_plain)
        quotes = quotes[(quotes - 1 - before) % 2 == 0]
    return quotes, int(last_plain_at[-1])


def _brackets(
    body: bytes, start: int, stop: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(positions, +1 for '[' / -1 for ']') of the brackets in body[start:stop]."""
    b = _view(body, start, stop)
    at = np.flatnonzero((b == _OPEN) | (b == _CLOSE))
    step = np.where(b[at] == _OPEN, 1, -1).astype(np.int64)
    return at.astype(np.int64) + start, step


def _arrays_in_run(body: bytes, run: _Run, *, min_bytes: int, window: int) -> list[Span]:
    """The run's maximal arrays, of at least `min_bytes`, where a value stands.

    Levels count brackets from the run's start (level 0). A '[' at level k (before it) is
    maximal when the run's levels after it fall back to k but never below it, or fall below it
    only after never having been below it before (no array around it opened inside the run);
    a ']' back to level k likewise, mirrored. Two passes: the first finds each window's lowest
    level, the second where the levels after each bracket go."""
    bounds = list(range(run.start, run.end, window))
    lowest: list[int] = []  # per window: the lowest level after any of its brackets
    level = 0
    for start in bounds:
        _, step = _brackets(body, start, min(run.end, start + window))
        if len(step):
            after = level + np.cumsum(step)
            lowest.append(int(after.min()))
            level = int(after[-1])
        else:
            lowest.append(_NO_EVENT)
    lowest_from = np.minimum.accumulate(np.array(lowest[::-1], dtype=np.int64))[::-1]
    opens: list[npt.NDArray[np.int64]] = []
    closes: list[npt.NDArray[np.int64]] = []
    level = 0
    lowest_before = 0  # the lowest level so far (the run starts at 0)
    for w, start in enumerate(bounds):
        at, step = _brackets(body, start, min(run.end, start + window))
        if not len(at):
            continue
        after = level + np.cumsum(step)
        before = after - step
        # Lowest level before each bracket (not counting its own), and after it.
        low_before = np.minimum(lowest_before, np.minimum.accumulate(after))
        low_before = np.concatenate(([lowest_before], low_before[:-1]))
        later = int(lowest_from[w + 1]) if w + 1 < len(bounds) else _NO_EVENT
        low_after = np.minimum.accumulate(after[::-1])[::-1]
        low_after = np.concatenate((low_after[1:], [later]))
        low_after = np.minimum(low_after, later)
        is_open = step > 0
        k_open = before
        top_open = is_open & (
            (low_after == k_open) | ((low_after < k_open) & (low_before == k_open))
        )
        k_close = after
        top_close = ~is_open & (
            (low_before == k_close) | ((low_before < k_close) & (low_after >= k_close))
        )
        opens.append(at[top_open])
        closes.append(at[top_close])
        level = int(after[-1])
        lowest_before = min(lowest_before, int(after.min()))
    if not opens:
        return []
    open_at = np.concatenate(opens)
    close_at = np.concatenate(closes)
    if len(open_at) != len(close_at) or not (
        (open_at < close_at).all() and (close_at[:-1] < open_at[1:]).all()
    ):
        return []  # cannot be: left to the parser rather than trusted
    big = np.flatnonzero(close_at - open_at + 1 >= min_bytes)
    return [
        Span(int(open_at[i]), int(close_at[i]) + 1)
        for i in big
        if _value_stands_at(body, run, int(open_at[i]))
    ]


def _value_stands_at(body: bytes, run: _Run, at: int) -> bool:
    """Whether the '[' at body[at] is an array's first element, an object's value, or the
    whole body (its previous byte other than whitespace is a '[', a ':', or none)."""
    lookback = 256
    stop = at
    while stop > run.start:
        start = max(run.start, stop - lookback)
        b = _view(body, start, stop)
        seen = np.flatnonzero(~_WHITESPACE[b])
        if len(seen):
            return bool(b[seen[-1]] == _OPEN)
        stop = start
        lookback *= 4
    if run.start == 0:
        return True  # the whole body
    return body[run.start - 1] == _COLON
