"""A JSON body whose big arrays of numbers are parsed in pieces straight into numpy: no Python
object per number, and no call that holds the GIL for more than a piece.

pydantic_core.from_json (jiter) and np.asarray hold the GIL from start to end, so a body that
decodes on a worker thread still stalls the event loop for as long as they run: 1 MiB of
single-element lists about 50 ms, a 128 MiB body of rows of 64 numbers seconds. And each number
becomes a Python float and a list slot: 12.7x the body at the peak. Here:
1. the body's arrays of numbers of MIN_SPAN_BYTES or more (spans: service.wire.json_spans) are
   taken out, each replaced by a placeholder string that holds a random token no client can
   guess, and what is left (the envelope: names, options, strings, small lists) is parsed by
   from_json as the whole body was;
2. each span's brackets and commas are checked and its shape found with numpy
   (service.wire.span_layout); it is cut at commas into pieces of at most PIECE_BYTES, each
   parsed by from_json as a flat list (its brackets blanked; in a span with empty lists, its
   tokens alone), read into numpy by the codec's own rules and combined as the whole list
   would have been (service.wire.number_lists);
3. each placeholder is replaced by what stands where it is (`slot_of`, from the wire models):
   a NumberArray where the codec reads a tensor; where the models or numpy read the list in
   other ways, a stand-in that reads the same.

Every answer is the one the whole body parsed at once would get, bit for bit and word for word
(tests/service/wire/test_json_arrays.py compares them): invalid JSON is refused with
from_json's own message and position (service.wire.json_errors), a ragged array as ragged.
Where that cannot be assured (an array nested near jiter's recursion limit, an error the
pieces cannot place: WholeParseNeeded), a body of at most WHOLE_PARSE_BYTES is parsed whole; a
larger one is refused (422, with the reason): parsed whole, it would hold the loop and the
memory this module exists to spare, and no valid request nests so deep or fails so.

One new refusal: a body whose envelope still holds more than MAX_ENVELOPE_VALUES ',' and '['
(values outside its big arrays of numbers: many small lists, strings in lists) is refused
before it is parsed, as MAX_KEYS refuses keys (service.wire.codec): no request of this API
comes near it, and parsing it would hold the loop as before.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from pydantic_core import from_json

from service.errors import FieldError, InvalidRequest
from service.wire.bytecount import occurrences
from service.wire.json_errors import JsonError, message, parse_error
from service.wire.json_spans import SPAN_BYTES, WINDOW, Span, find_spans
from service.wire.number_lists import NumberArray, NumberArrayBuilder
from service.wire.span_layout import Layout, span_layout

# The most text one from_json call parses: about 2 ms of the GIL (256 KiB of numbers).
PIECE_BYTES: Final = 256 * 1024
# Arrays shorter than this stay in the envelope: their Python objects are few.
MIN_SPAN_BYTES: Final = 4096
# A body with at most this many ',' and '[' is parsed whole: it holds few values.
FEW_VALUES: Final = 4096
# The values an envelope may hold (its ',' and '['). A request of this API holds far fewer:
# its tensors smaller than MIN_SPAN_BYTES (six at most, 2,048 values each), its shapes,
# strategies, outputs and keys: 13,000 at most.
MAX_ENVELOPE_VALUES: Final = 16_384
# The largest body parsed whole when the pieces cannot answer for it: a piece's worth.
WHOLE_PARSE_BYTES: Final = PIECE_BYTES
# Arrays and objects a span may lie in, its own included, for its answer to be the one from_json
# gives: well below jiter's recursion limit (about 200 in pydantic_core 2.50). Deeper, the body
# is parsed whole. (No request of this API nests more than 10.)
MAX_NESTING: Final = 128
# numpy's most dimensions (2.4): np.asarray refuses a deeper list with ValueError, as ragged.
NUMPY_MAX_DIMS: Final = 64
# A list field (shape, strategies, inputs, outputs) holds at most 32 items: a span of more
# stands in as a list of as many Nones (the models refuse it for its length alone).
LIST_ITEMS_READ: Final = 64
_COMMA: Final = ord(",")
_OPEN: Final = ord("[")
_CLOSE: Final = ord("]")
_TOKEN_BYTE: Final = np.zeros(256, dtype=np.bool_)
_TOKEN_BYTE[[c for c in SPAN_BYTES if c not in b" \t\n\r[],"]] = True
_BLANK_BRACKETS: Final = np.arange(256, dtype=np.uint8)
_BLANK_BRACKETS[[_OPEN, _CLOSE]] = ord(" ")

Path = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Pieces:
    """How a body is parsed in pieces (tests use small ones, to cut small bodies)."""

    piece_bytes: int = PIECE_BYTES  # the most text one from_json call parses
    min_span_bytes: int = MIN_SPAN_BYTES  # arrays shorter than this stay in the envelope
    few_values: int = FEW_VALUES  # a body with at most this many ',' and '[' is parsed whole
    window: int = WINDOW  # bytes read per numpy call


PIECES: Final = Pieces()


class Slot(enum.Enum):
    """What reads a list that stands at some place of a body (the wire models say)."""

    TENSOR = "tensor"  # a tensor's data: the codec, which takes a NumberArray
    IN_TENSOR = "in_tensor"  # inside a tensor's list that holds other things: np.asarray
    LIST = "list"  # a list field (shape, strategies, ...): its length and outermost items
    ANY = "any"  # nothing looks into it (an unknown field, a number's place): any list


SlotOf = Callable[[Path], Slot]


class WholeParseNeeded(Exception):
    """The pieces cannot say what the whole body would (nesting near jiter's recursion limit,
    an error the pieces cannot place): a small body is parsed whole, a large one refused.
    str(): why, in the words of the refusal."""


def not_json(detail: str) -> InvalidRequest:
    """A body that is not JSON (422, loc ["body"]): from_json's words in `detail`."""
    msg = f"request body is not valid JSON: {detail}"
    return InvalidRequest(msg, errors=[FieldError(loc=("body",), msg=msg, type="json_invalid")])


def parse_whole(body: bytes, *, allow_inf_nan: bool) -> Any:
    """from_json(body), a body that is not JSON refused with its words."""
    try:
        return from_json(body, allow_inf_nan=allow_inf_nan)
    except ValueError as exc:
        # from_json reports malformed JSON (and bad UTF-8) as a plain ValueError; nothing else
        # runs inside this try, so no bug of ours can be turned into a 422 here.
        raise not_json(str(exc)) from None


def loads_in_pieces(
    body: bytes, *, slot_of: SlotOf, allow_inf_nan: bool, pieces: Pieces = PIECES
) -> Any:
    """parse_whole(body), with its big arrays of numbers parsed in pieces (NumberArrays where
    `slot_of` says a tensor stands). Raises InvalidRequest as parse_whole does, and for an
    envelope of more than MAX_ENVELOPE_VALUES values."""
    try:
        return parse_in_pieces(body, slot_of=slot_of, allow_inf_nan=allow_inf_nan, pieces=pieces)
    except WholeParseNeeded as exc:
        if len(body) > WHOLE_PARSE_BYTES:
            raise not_json(f"{exc} (in a body of more than {WHOLE_PARSE_BYTES:,} bytes)") from None
        return parse_whole(body, allow_inf_nan=allow_inf_nan)


def parse_in_pieces(
    body: bytes, *, slot_of: SlotOf, allow_inf_nan: bool, pieces: Pieces = PIECES
) -> Any:
    """loads_in_pieces without its last resort: raises WholeParseNeeded where the pieces
    cannot answer as the whole body would."""
    if _values(body, past=pieces.few_values) <= pieces.few_values:
        return parse_whole(body, allow_inf_nan=allow_inf_nan)
    reader = _Reader(body, slot_of, allow_inf_nan, pieces)
    spans = find_spans(body, min_bytes=pieces.min_span_bytes, window=pieces.window)
    return reader.loads(spans)


def too_many_values() -> InvalidRequest:
    msg = (
        f"request body holds more than {MAX_ENVELOPE_VALUES:,} values (',' and '[') besides its "
        "large lists of numbers, more than any request of this API: small lists, or strings "
        "in lists, that no endpoint takes"
    )
    return InvalidRequest(msg, errors=[FieldError(loc=("body",), msg=msg, type="too_many_values")])


def _values(text: bytes, *, past: int) -> int:
    return occurrences(text, _COMMA, past=past) + occurrences(text, _OPEN, past=past)


@dataclass(frozen=True, slots=True)
class _Found:
    """A placeholder in the parsed envelope: container[key] is it, at `path`."""

    container: dict[str, Any] | list[Any]
    key: Any
    path: Path


class _Reader:
    def __init__(self, body: bytes, slot_of: SlotOf, allow_inf_nan: bool, pieces: Pieces):
        self.body = body
        self.slot_of = slot_of
        self.allow_inf_nan = allow_inf_nan
        self.pieces = pieces

    def loads(self, spans: list[Span]) -> Any:
        if not spans:
            if _values(self.body, past=MAX_ENVELOPE_VALUES) > MAX_ENVELOPE_VALUES:
                raise too_many_values()
            return parse_whole(self.body, allow_inf_nan=self.allow_inf_nan)
        token = secrets.token_hex(16)
        names = {f"{token}{i}": i for i in range(len(spans))}
        parts: list[bytes] = []
        places: list[tuple[int, int]] = []  # where each placeholder lies in the envelope
        at = size = 0
        for i, span in enumerate(spans):
            parts.append(self.body[at : span.start])
            size += span.start - at
            placeholder = f'"{token}{i}"'.encode()
            places.append((size, size + len(placeholder)))
            parts.append(placeholder)
            size += len(placeholder)
            at = span.end
        parts.append(self.body[at:])
        envelope = b"".join(parts)
        del parts
        if _values(envelope, past=MAX_ENVELOPE_VALUES) > MAX_ENVELOPE_VALUES:
            raise too_many_values()
        try:
            tree = from_json(envelope, allow_inf_nan=self.allow_inf_nan)
        except ValueError:
            raise self._envelope_error(envelope, spans, places) from None
        if isinstance(tree, str) and tree in names:  # the body is one array
            return self._read(spans[0], self.slot_of(()), nesting=0)
        found = _placeholders(tree, names)
        for i, span in enumerate(spans):
            where = found.get(i)
            if where is None:  # given under a key that is given again: only checked
                self._read(span, Slot.ANY, nesting=0)
                continue
            value = self._read(span, self.slot_of(where.path), nesting=len(where.path))
            where.container[where.key] = value
        return tree

    # ---- one span ----------------------------------------------------------------------------

    def _read(self, span: Span, slot: Slot, *, nesting: int) -> Any:
        """What stands for the span at a place of kind `slot`, inside `nesting` arrays and
        objects; raises InvalidRequest with from_json's message when it is not JSON."""
        layout = span_layout(
            self.body,
            span.start,
            span.end,
            piece_bytes=self.pieces.piece_bytes,
            window=self.pieces.window,
        )
        if nesting + layout.depth > MAX_NESTING:
            raise WholeParseNeeded(f"arrays nested more than {MAX_NESTING} deep")
        regular = (
            layout.violation is None
            and layout.shape is not None
            and len(layout.shape) <= NUMPY_MAX_DIMS
        )
        builder = (
            NumberArrayBuilder(layout.tokens)
            if regular and slot in (Slot.TENSOR, Slot.IN_TENSOR)
            else None
        )
        bounds = (span.start, *layout.cuts, span.end - 1)
        parsed = 0
        for k in range(len(bounds) - 1):
            start, stop = bounds[k] + 1, bounds[k + 1]
            if layout.violation is not None and start > layout.violation:
                break
            text = _piece(self.body, start, stop, compact=layout.empty_lists)
            if not text:
                continue
            try:
                values = from_json(text, allow_inf_nan=self.allow_inf_nan)
            except ValueError:
                raise self._error_in(span, layout, k) from None
            parsed += len(values)
            if builder is not None:
                # No "t" or "f" in its text: no true or false among its values.
                booleans = None if b"t" in text or b"f" in text else False
                builder.add(values, booleans=booleans)
        if layout.violation is not None:
            raise self._error_in(span, layout, _region_of(bounds, layout.violation))
        if parsed != layout.tokens:  # cannot be: each token is one value
            raise WholeParseNeeded("an array whose values could not be counted")
        if slot is Slot.LIST:
            return self._list_items(span, layout)
        if slot is Slot.ANY:
            return []  # what the models say of a list there does not depend on its content
        if builder is None:
            array = NumberArray.ragged_list()
        else:
            assert layout.shape is not None
            array = builder.finish(layout.shape)
        return array if slot is Slot.TENSOR else array.stand_in()

    def _list_items(self, span: Span, layout: Layout) -> list[Any]:
        """A list field's stand-in: its outermost items, each list among them as []; a list of
        more than LIST_ITEMS_READ items as so many Nones (pydantic_core 2.50 refuses a list
        past its max_length for its length alone, and every list field's is at most 32)."""
        if layout.items > LIST_ITEMS_READ:
            return [None] * layout.items
        return list(from_json(_outermost(self.body, span), allow_inf_nan=self.allow_inf_nan))

    # ---- errors --------------------------------------------------------------------------------

    def _error_in(self, span: Span, layout: Layout, region: int) -> InvalidRequest:
        """from_json's error for the body, whose first error lies in the span's `region`-th
        piece: that piece is parsed alone, after a prefix that puts the parser in the state it
        is in there (inside as many arrays, after a value)."""
        bounds = (span.start, *layout.cuts, span.end - 1)
        if region == 0:
            prefix, begin = b"", span.start
        else:
            prefix, begin = b"[" * layout.cut_depths[region - 1] + b"0", bounds[region]
        window = prefix + self.body[begin : bounds[region + 1] + 1]
        error = parse_error(window, allow_inf_nan=self.allow_inf_nan)
        if error is None or not len(prefix) <= error.index < len(window):
            raise WholeParseNeeded("an error whose place could not be told")
        at = begin + error.index - len(prefix)
        return not_json(message(self.body, JsonError(error.what, at)))

    def _envelope_error(
        self, envelope: bytes, spans: list[Span], places: list[tuple[int, int]]
    ) -> InvalidRequest:
        """from_json's error for the body, whose envelope is not JSON: the first error of the
        spans before where the envelope's lies, else the envelope's, carried to the body."""
        error = parse_error(envelope, allow_inf_nan=self.allow_inf_nan)
        if error is None:
            raise WholeParseNeeded("an error whose place could not be told")
        at = error.index  # in the body: the envelope's index, shifted past the spans before it
        for span, (start, end) in zip(spans, places, strict=True):
            if error.index < end:
                if start < error.index:  # inside a placeholder: cannot be
                    raise WholeParseNeeded("an error whose place could not be told")
                break
            at += (span.end - span.start) - (end - start)
        for span in spans:
            if span.end > at:
                break
            self._read(span, Slot.ANY, nesting=0)  # raises its own error first, if any
        return not_json(message(self.body, JsonError(error.what, at)))


def _region_of(bounds: tuple[int, ...], at: int) -> int:
    """The piece whose bytes (between two cuts) hold body[at]."""
    return max(0, int(np.searchsorted(np.asarray(bounds), at, side="left")) - 1)


def _piece(body: bytes, start: int, stop: int, *, compact: bool) -> bytes:
    """The tokens of body[start:stop] as a flat JSON list (b"" when it holds none): its
    brackets blanked, or with `compact` (a span with empty lists, whose commas could then
    stand side by side) its tokens alone, joined by commas."""
    region = np.frombuffer(body, dtype=np.uint8, count=stop - start, offset=start)
    if not compact:
        # Between two cuts lies a value, and every list holds one: there is a token.
        return b"[" + np.take(_BLANK_BRACKETS, region).tobytes() + b"]"
    token = _TOKEN_BYTE[region]
    first = token.copy()
    first[1:] &= ~token[:-1]
    starts = np.flatnonzero(first)
    if not len(starts):
        return b""
    out = region.copy()
    separators = starts[1:] - 1  # the byte before a token is never a token's
    out[separators] = _COMMA
    token[separators] = True
    return b"[" + out[token].tobytes() + b"]"


def _outermost(body: bytes, span: Span) -> bytes:
    """The span with each list inside its outermost one emptied: [1, [2, [3]], 4] -> [1, [], 4]."""
    parts: list[bytes] = []
    level = 0
    for start in range(span.start, span.end, WINDOW):
        stop = min(span.end, start + WINDOW)
        b = np.frombuffer(body, dtype=np.uint8, count=stop - start, offset=start)
        step = (b == _OPEN).astype(np.int64) - (b == _CLOSE)
        after = level + np.cumsum(step)
        level = int(after[-1])
        parts.append(b[(after <= 1) | ((b == _OPEN) & (after == 2))].tobytes())
    return b"".join(parts)


def _placeholders(tree: Any, names: dict[str, int]) -> dict[int, _Found]:
    """Where each placeholder stands in the parsed envelope (each at most once: a placeholder
    whose key was given twice is overwritten, as its array would have been)."""
    longest = max(map(len, names))
    found: dict[int, _Found] = {}
    stack: list[tuple[Any, Path]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and len(key) <= longest and key in names:
                # Cannot be: a span never stands where a key does.
                raise WholeParseNeeded("an array where a key stands")
            if isinstance(value, str):
                if len(value) <= longest and value in names:
                    found[names[value]] = _Found(node, key, (*path, key))
            elif isinstance(value, dict | list):
                stack.append((value, (*path, key)))
    return found
