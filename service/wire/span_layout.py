"""The layout of an array of numbers in a JSON body (a span: service.wire.json_spans), read with
numpy a window at a time: whether its brackets and commas follow JSON's grammar, its shape when
it is regular (what np.asarray would find), and the commas where it is cut into pieces.

The span is read as a sequence of events: '[', ']', ',' and the first byte of each token (a
number or literal; whether the token itself is valid JSON is for the parser, piece by piece).
- Grammar: each event may only follow certain others ('[' is followed by '[', a token or ']';
  a token and ']' by ',' or ']'; ',' by '[' or a token): the first event that may not is where
  the array stops being JSON.
- Shape: np.asarray reads a nested list as an array when every leaf sits at the same depth D
  and every list of one level has as many leaves as the others, else it refuses it as ragged.
  Counting the ']' between consecutive leaves says both: in a regular array of shape
  (s1, ..., sD), P_m = s_{D-m+1} x ... x sD leaves fill a list of level D-m+1, and m lists close
  after leaf i exactly when P_m divides i + 1. So the first leaf after which m lists close
  gives P_m, and the array is regular when the counts match that pattern throughout. Lists
  with no leaf count as leaves of their own when no list holds a token ([[], []] is (2, 0)); a
  span that holds both is ragged.
- Pieces: the commas at which the span is cut, each piece at most `piece_bytes` long (or one
  token or run of whitespace longer than that), and the arrays open at each cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from service.wire.json_spans import WINDOW

# Event classes. A byte of a span is whitespace, a bracket, a comma or a token's.
_START, _OPEN, _CLOSE, _COMMA, _TOKEN = 0, 1, 2, 3, 4
_CLASS: Final = np.full(256, _TOKEN, dtype=np.int8)
_CLASS[list(b" \t\n\r")] = 0
_CLASS[ord("[")] = _OPEN
_CLASS[ord("]")] = _CLOSE
_CLASS[ord(",")] = _COMMA
# _FOLLOWS[previous, event]: whether JSON's grammar lets `event` follow `previous`.
_FOLLOWS: Final = np.zeros((5, 5), dtype=np.bool_)
_COMMA_BYTE: Final = ord(",")
_OPEN_BYTE: Final = ord("[")
_CLOSE_BYTE: Final = ord("]")
for _prev, _next in (
    (_START, _OPEN),
    (_OPEN, _OPEN),
    (_OPEN, _TOKEN),
    (_OPEN, _CLOSE),
    (_TOKEN, _COMMA),
    (_TOKEN, _CLOSE),
    (_CLOSE, _COMMA),
    (_CLOSE, _CLOSE),
    (_COMMA, _OPEN),
    (_COMMA, _TOKEN),
):
    _FOLLOWS[_prev, _next] = True
_FOLLOWS_FLAT: Final = _FOLLOWS.reshape(-1)  # [previous * 5 + event]


@dataclass(frozen=True, slots=True)
class Layout:
    """What a span holds, before its tokens are parsed."""

    violation: int | None  # index in the body of the first event JSON's grammar forbids
    leaves: int  # its tokens (or, when it holds none, its innermost empty lists)
    tokens: int  # its tokens
    shape: tuple[int, ...] | None  # what np.asarray finds; None: ragged
    depth: int  # arrays nested in it, itself included
    empty_lists: bool  # whether it holds an empty list
    items: int  # elements of the outermost list
    cuts: tuple[int, ...]  # indices in the body of the commas it is cut at
    cut_depths: tuple[int, ...]  # arrays of the span open at each cut


@dataclass
class _Reading:
    """What the windows read so far carry to the next."""

    previous: int = _START  # class of the last event
    depth: int = 0  # arrays open after it
    deepest: int = 0
    in_token: bool = False  # the last byte belongs to a token
    closes: int = 0  # ']' so far
    leaves: int = 0
    tokens: int = 0
    empties: int = 0  # lists closed right after they opened
    leaf_depth: int | None = None
    ragged: bool = False
    last_leaf_closes: int = 0  # ']' up to the end of the last leaf
    items_commas: int = 0  # commas of the outermost list
    violation: int | None = None
    last_cut: int = 0
    candidate: int | None = None  # the last comma within reach of the next cut
    candidate_depth: int = 0


def span_layout(
    body: bytes, start: int, end: int, *, piece_bytes: int, window: int = WINDOW
) -> Layout:
    """The layout of the array body[start:end] (body[start] is '[', body[end - 1] its ']')."""
    r = _Reading(last_cut=start)
    gaps: list[npt.NDArray[np.int8]] = []  # ']' between consecutive leaves
    cuts: list[int] = []
    cut_depths: list[int] = []
    for at in range(start, end, window):
        stop = min(end, at + window)
        b = np.frombuffer(body, dtype=np.uint8, count=stop - at, offset=at)
        # Comparisons rather than a table: a span holds no byte below 33 but whitespace.
        structure = (b == _COMMA_BYTE) | (b == _OPEN_BYTE) | (b == _CLOSE_BYTE)
        token = (b > 32) & ~structure
        first = np.empty_like(token)  # a token's first byte
        first[0] = token[0] and not r.in_token
        np.greater(token[1:], token[:-1], out=first[1:])
        r.in_token = bool(token[-1])
        events = np.flatnonzero(structure | first)
        if not len(events):
            continue
        kinds = np.take(_CLASS, b[events])
        previous = np.empty_like(kinds)
        previous[0] = r.previous
        previous[1:] = kinds[:-1]
        r.previous = int(kinds[-1])
        if r.violation is None:
            bad = np.flatnonzero(~np.take(_FOLLOWS_FLAT, previous * 5 + kinds))
            if len(bad):
                r.violation = at + int(events[bad[0]])
        is_open = kinds == _OPEN
        is_close = kinds == _CLOSE
        step = is_open.astype(np.int64) - is_close
        after = r.depth + np.cumsum(step)
        before = after - step
        r.depth = int(after[-1])
        r.deepest = max(r.deepest, int(after.max()))
        closes = np.cumsum(is_close, dtype=np.int64)  # in the window, up to each event
        closed_before = r.closes
        r.closes += int(closes[-1])
        commas = kinds == _COMMA
        r.items_commas += int(np.count_nonzero(commas & (before == 1)))
        _cut(r, events[commas] + at, before[commas], piece_bytes, cuts, cut_depths)
        is_token = kinds == _TOKEN
        empty = is_close & (previous == _OPEN)
        tokens, empties = int(np.count_nonzero(is_token)), int(np.count_nonzero(empty))
        r.tokens += tokens
        r.empties += empties
        if r.ragged or not (tokens or empties):
            continue
        if r.tokens and r.empties:
            r.ragged = True
            continue
        # A token sits at the depth around it; an empty list at the depth of the list holding
        # it (the depth after its ']'). Then the ']' up to each leaf's end (its own for an
        # empty list), and those before each begins.
        leaf = is_token if tokens else empty
        depth_of = before if tokens else after
        if r.leaf_depth is None:
            r.leaf_depth = int(depth_of[np.argmax(leaf)])
        if (leaf & (depth_of != r.leaf_depth)).any():
            r.ragged = True
            continue
        ends = closes[leaf] + closed_before
        begins = ends if tokens else ends - 1
        gap = np.empty(len(ends), dtype=np.int64)
        gap[0] = begins[0] - r.last_leaf_closes
        gap[1:] = begins[1:] - ends[:-1]
        gaps.append((gap[1:] if r.leaves == 0 else gap).astype(np.int8))
        r.last_leaf_closes = int(ends[-1])
        r.leaves += len(ends)
    if r.candidate is not None and end - 1 - r.last_cut > piece_bytes:
        cuts.append(r.candidate)
        cut_depths.append(r.candidate_depth)
    shape = None
    if r.violation is None and not r.ragged:
        shape = _shape(np.concatenate(gaps) if gaps else np.zeros(0, np.int8), r)
    return Layout(
        violation=r.violation,
        leaves=r.leaves,
        tokens=r.tokens,
        shape=shape,
        depth=r.deepest,
        empty_lists=r.empties > 0,
        items=r.items_commas + 1 if r.leaf_depth != 0 else 0,
        cuts=tuple(cuts),
        cut_depths=tuple(cut_depths),
    )


def _cut(
    r: _Reading,
    commas: npt.NDArray[np.int64],
    depths: npt.NDArray[np.int64],
    piece_bytes: int,
    cuts: list[int],
    cut_depths: list[int],
) -> None:
    """Cut at the last comma within `piece_bytes` of the last cut (at the first past it when
    none is), as this window's commas (body indices, in order) allow."""
    while len(commas):
        reach = r.last_cut + piece_bytes
        within = int(np.searchsorted(commas, reach, side="right"))
        if within:
            r.candidate, r.candidate_depth = int(commas[within - 1]), int(depths[within - 1])
        if within == len(commas):
            return  # every comma left is within reach: the next window may hold a later one
        if r.candidate is None:  # nothing within reach: the first comma past it
            r.candidate, r.candidate_depth = int(commas[within]), int(depths[within])
        cuts.append(r.candidate)
        cut_depths.append(r.candidate_depth)
        r.last_cut = r.candidate
        r.candidate = None
        keep = commas > r.last_cut
        commas, depths = commas[keep], depths[keep]


def _shape(gaps: npt.NDArray[np.int8], r: _Reading) -> tuple[int, ...] | None:
    """The shape np.asarray finds, from the ']' between consecutive leaves; None: ragged."""
    assert r.leaf_depth is not None
    depth, n = r.leaf_depth, r.leaves
    if depth == 0:  # the span is one empty list: []
        return (0,) if n == 1 else None
    fill = [0] * depth  # fill[m]: leaves per list that m + 1 closing brackets end (P_{m+1})
    for m in range(1, depth):
        closing = np.flatnonzero(gaps >= m)
        fill[m - 1] = int(closing[0]) + 1 if len(closing) else n
    fill[depth - 1] = n  # the outermost list holds every leaf
    for m in range(depth - 1):
        if fill[m + 1] % fill[m]:
            return None
    expected = 0
    for m in range(1, depth):
        per = fill[m - 1]
        if not (gaps[per - 1 :: per] >= m).all():
            return None
        expected += n // per - 1
    if int(gaps.sum(dtype=np.int64)) != expected:
        return None
    dims = [fill[depth - 1] // fill[depth - 2]] if depth > 1 else [n]
    dims += [fill[m] // fill[m - 1] for m in range(depth - 2, 0, -1)]
    if depth > 1:
        dims.append(fill[0])
    return (*dims, 0) if r.empties else tuple(dims)
