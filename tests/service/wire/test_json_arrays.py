"""Parsing a body's big arrays of numbers in pieces (service.wire.json_arrays) answers exactly as
parsing it whole: the same tensors bit for bit, the same refusals word for word, for bodies of
every shape (tests/service/wire/json_bodies.py), cut into pieces of a few bytes so that every
boundary falls somewhere. And its parts, each against an independent truth: the span finder
against a byte-by-byte scanner written for this test, the layout against np.asarray, the
pieces' combination against np.asarray of the whole list, error positions against from_json.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_core import from_json

from service.errors import InvalidRequest
from service.wire.codec import decode_int_list, decode_tensor, loads_request, refuse_many_keys
from service.wire.json_arrays import (
    MAX_ENVELOPE_VALUES,
    MAX_NESTING,
    WHOLE_PARSE_BYTES,
    Pieces,
    Slot,
    WholeParseNeeded,
    loads_in_pieces,
    parse_in_pieces,
    parse_whole,
)
from service.wire.json_errors import message, parse_error
from service.wire.json_spans import SPAN_BYTES, find_spans
from service.wire.models import AnalyzeRequest, AttentionRequest, array_slots, validate_request
from service.wire.number_lists import NumberArray, NumberArrayBuilder, minus_inf_of
from service.wire.span_layout import span_layout
from service.wire.v2_codec import decode_inputs, split_header
from service.wire.v2_models import array_slot, parse_infer_request
from tests.service.wire.json_bodies import Bodies

BIG = 1 << 24
TENSORS = (("q", "float"), ("k", "float"), ("v", "float"), ("key_padding_mask", "bool_mask"),
           ("attn_mask", "mask"))  # fmt: skip
EXAMPLES = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
pieces_strategy = st.builds(
    Pieces,
    piece_bytes=st.integers(4, 96),
    min_span_bytes=st.integers(2, 48),
    few_values=st.just(0),
    window=st.sampled_from([16, 1 << 18]),
)


def bits(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return str(t.dtype), tuple(t.shape), raw.contiguous().numpy().tobytes()


def attempt(fn: Any) -> Any:
    """What a decode gives: its tensor's bits, or its refusal's words (a bug raises)."""
    try:
        return ("tensor", bits(fn()))
    except InvalidRequest as exc:
        return ("refused", str(exc), [(e.loc, e.msg, e.type) for e in exc.errors])


def in_pieces(body: bytes, slot_of: Any, pieces: Pieces, *, allow_inf_nan: bool) -> Any:
    """loads_request's in pieces, where the pieces may not give up (WholeParseNeeded): none of
    these bodies nests near jiter's recursion limit, and every error must be placed."""
    refuse_many_keys(body)  # as loads_request does first
    return parse_in_pieces(body, slot_of=slot_of, allow_inf_nan=allow_inf_nan, pieces=pieces)


def v1_outcome(
    body: bytes, model: Any, pieces: Pieces | None, *, last_resort: bool = False
) -> list[Any]:
    """Each of a v1 body's tensors as the wire layer decodes it (in pieces, with the whole parse
    as the last resort only when `last_resort`)."""
    try:
        if pieces is None:
            payload = loads_request(body)
        elif last_resort:
            payload = loads_request(body, slot_of=array_slots(model), pieces=pieces)
        else:
            payload = in_pieces(body, array_slots(model), pieces, allow_inf_nan=False)
        req = validate_request(payload, model)
    except InvalidRequest as exc:
        return [("refused", str(exc), [(e.loc, e.msg, e.type) for e in exc.errors])]
    out = []
    for name, role in TENSORS:
        value = getattr(req, name, None)
        out.append(
            None
            if value is None
            else attempt(
                lambda v=value, n=name, r=role: (
                    decode_tensor(v, loc=("body", n), role=r, max_elements=BIG).tensor
                )
            )
        )
    if req.key_lengths is not None:
        loc = ("body", "key_lengths")
        out.append(attempt(lambda: decode_int_list(req.key_lengths, loc=loc, max_elements=BIG)))
    return out


def v2_outcome(body: bytes, pieces: Pieces | None) -> Any:
    """A v2 body's inputs as the wire layer decodes them."""
    try:
        header, offset = split_header(body, None)
        if pieces is None:
            payload = loads_request(header, allow_inf_nan=True)
        else:
            payload = in_pieces(header, array_slot, pieces, allow_inf_nan=True)
        request = parse_infer_request(payload)
        tensors = decode_inputs(request, body, offset, max_elements=BIG)
    except InvalidRequest as exc:
        return ("refused", str(exc), [(e.loc, e.msg, e.type) for e in exc.errors])
    return sorted((name, bits(t)) for name, t in tensors.items())


# ---- the whole: pieces answer as the whole body does -------------------------------------------


@EXAMPLES
@given(rng=st.randoms(use_true_random=False), pieces=pieces_strategy)
def test_v1_attention_bodies_decode_alike_whole_and_in_pieces(
    rng: random.Random, pieces: Pieces
) -> None:
    body = Bodies(rng).v1()
    assert v1_outcome(body, AttentionRequest, pieces) == v1_outcome(body, AttentionRequest, None)


@EXAMPLES
@given(rng=st.randoms(use_true_random=False), pieces=pieces_strategy)
def test_v1_analyze_bodies_decode_alike_whole_and_in_pieces(
    rng: random.Random, pieces: Pieces
) -> None:
    body = Bodies(rng).v1(analyze=True)
    assert v1_outcome(body, AnalyzeRequest, pieces) == v1_outcome(body, AnalyzeRequest, None)


@EXAMPLES
@given(rng=st.randoms(use_true_random=False), pieces=pieces_strategy)
def test_v2_bodies_decode_alike_whole_and_in_pieces(rng: random.Random, pieces: Pieces) -> None:
    body = Bodies(rng).v2()
    assert v2_outcome(body, pieces) == v2_outcome(body, None)


def test_the_random_bodies_reach_every_path() -> None:
    """The bodies above do what they are for: spans are taken out and cut into pieces, some
    bodies are not JSON, some arrays are ragged, some decode."""
    seen: dict[str, int] = dict.fromkeys(["spans", "cut", "ragged", "not JSON", "decoded"], 0)
    small = Pieces(piece_bytes=16, min_span_bytes=8, few_values=0)
    for seed in range(120):
        body = Bodies(random.Random(seed)).v1()
        spans = find_spans(body, min_bytes=small.min_span_bytes)
        seen["spans"] += bool(spans)
        layouts = [span_layout(body, s.start, s.end, piece_bytes=16) for s in spans]
        seen["cut"] += any(layout.cuts for layout in layouts)
        seen["ragged"] += any(lay.shape is None and lay.violation is None for lay in layouts)
        outcome = v1_outcome(body, AttentionRequest, small)
        seen["not JSON"] += "not valid JSON" in str(outcome)
        seen["decoded"] += any(part and part[0] == "tensor" for part in outcome)
    assert min(seen.values()) >= 6, seen


# ---- the span finder -----------------------------------------------------------------------


def reference_spans(text: bytes, min_bytes: int) -> list[tuple[int, int]]:
    """The maximal arrays of numbers where a value stands, found one byte at a time: an array
    is pure when no string, object or other byte JSON numbers do not use lies in it; maximal
    when no array around it is pure; where a value stands when the byte before it (whitespace
    aside) is ':' or '[' or there is none."""
    in_string = escaped = False
    stack: list[dict[str, Any]] = []  # open containers
    arrays: list[dict[str, Any]] = []
    previous: int | None = None
    allowed = set(SPAN_BYTES)
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == ord("\\"):
                escaped = True
            elif c == ord('"'):
                in_string = False
            continue
        if c == ord("["):
            parent = next((e for e in reversed(stack) if e["kind"] == "["), None)
            direct = stack[-1] if stack else None
            entry = {"kind": "[", "start": i, "pure": True, "end": None,
                     "at_value": previous in (None, ord(":"), ord("[")),
                     "parent": parent if direct is parent else None}  # fmt: skip
            stack.append(entry)
            arrays.append(entry)
        elif c == ord("]") and stack and stack[-1]["kind"] == "[":
            stack.pop()["end"] = i + 1
        elif c == ord("{"):
            stack.append({"kind": "{"})
        elif c == ord("}") and stack and stack[-1]["kind"] == "{":
            stack.pop()
        if c == ord('"'):
            in_string = True
        if c not in allowed or c == ord('"'):
            for entry in stack:
                entry["pure"] = False
        if c not in b" \t\n\r":
            previous = c
    for entry in stack:  # never closed
        entry["pure"] = False
    return [
        (a["start"], a["end"])
        for a in arrays
        if a["pure"] and a["end"] is not None and a["at_value"]
        and a["end"] - a["start"] >= min_bytes
        and (a["parent"] is None or not a["parent"]["pure"] or a["parent"]["end"] is None)
    ]  # fmt: skip


json_scalars = st.one_of(
    st.integers(-(2**65), 2**65), st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(), st.none(), st.sampled_from(["a[1]", 'q"[2, 3]"', "\\", '\\"', "]", "{["]),
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), min_size=1, max_size=4),
        st.dictionaries(st.sampled_from(["a", "b[", 'c"', "\\"]), inner, max_size=3),
    ),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(value=json_values, indent=st.sampled_from([None, 0, 1]), window=st.integers(3, 40),
       min_bytes=st.integers(2, 12))  # fmt: skip
def test_spans_are_the_maximal_arrays_of_numbers_where_a_value_stands(
    value: Any, indent: int | None, window: int, min_bytes: int
) -> None:
    text = json.dumps(value, indent=indent).encode()
    found = [(s.start, s.end) for s in find_spans(text, min_bytes=min_bytes, window=window)]
    assert found == reference_spans(text, min_bytes)
    for start, end in found:  # each parses as a list, alone
        assert isinstance(json.loads(text[start:end]), list)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"q": [[1, 2], [3, 4]]}', ["[[1, 2], [3, 4]]"]),
        ('{"s": "[1, 2, 3]", "q": [1, 2, 3]}', ["[1, 2, 3]"]),  # the string's array is text
        (r'{"s": "a\"[1, 2, 3]\\", "q": [1, 2, 3]}', ["[1, 2, 3]"]),  # \" escaped, \\ not
        (r'{"s": "\\\"[9, 9, 9]", "q": [4, 5, 6]}', ["[4, 5, 6]"]),  # \\\" escaped
        ('{"v": {"data": [1, 2, 3]}, "w": [{"x": [4, 5, 6]}]}', ["[1, 2, 3]", "[4, 5, 6]"]),
        ('{"q": ["s", [1, 2, 3], [4, 5, 6]]}', []),  # after ',': an object's key there?
        ('{"q": [[1, 2, 3], "s"]}', ["[1, 2, 3]"]),  # the first element of an impure list
        ("  [[1, 2], [3, 4]]  ", ["[[1, 2], [3, 4]]"]),  # the whole body
        ('{"q": [1, 2, 3] , "k": [true, null, false]}', ["[1, 2, 3]", "[true, null, false]"]),
        ('{"q": [1, x, 3]}', []),  # x is no byte of a number
    ],
)
def test_spans_of_hand_made_bodies(text: str, expected: list[str]) -> None:
    body = text.encode()
    for window in (1, 2, 5, 1 << 18):
        spans = find_spans(body, min_bytes=5, window=window)
        assert [body[s.start : s.end].decode() for s in spans] == expected


# ---- the layout ----------------------------------------------------------------------------


def np_shape(value: Any) -> tuple[int, ...] | None:
    try:
        return np.asarray(value).shape
    except ValueError:
        return None


@settings(max_examples=120, deadline=None)
@given(rng=st.randoms(use_true_random=False), piece_bytes=st.integers(1, 40),
       window=st.integers(2, 50))  # fmt: skip
def test_the_layout_finds_the_shape_numpy_finds_and_cuts_pieces_within_bounds(
    rng: random.Random, piece_bytes: int, window: int
) -> None:
    bodies = Bodies(rng)
    text = bodies.data(rng.choice(["float", "int", "bool", "mask"]))
    if not text.startswith("[") or "{" in text or '"' in text:
        text = "[" + text.replace("{", "[").replace("}", "]").replace('"', "") + "]"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return  # a nested list of strings' pieces: another test's
    body = text.encode()
    layout = span_layout(body, 0, len(body), piece_bytes=piece_bytes, window=window)
    assert layout.violation is None
    assert layout.shape == np_shape(value)
    assert layout.items == len(value)
    bounds = (0, *layout.cuts, len(body) - 1)
    assert all(body[cut] == ord(",") for cut in layout.cuts)
    for start, stop in itertools.pairwise(bounds):
        piece = body[start + 1 : stop]
        assert len(piece) <= piece_bytes or b"," not in piece
    for cut, depth in zip(layout.cuts, layout.cut_depths, strict=True):
        assert depth == body[:cut].count(b"[") - body[:cut].count(b"]")


@pytest.mark.parametrize(
    ("text", "at"),
    [("[1 2]", 3), ("[1,]", 3), ("[,1]", 1), ("[[1]2]", 4), ("[[1],,[2]]", 5), ("[1]", None)],
)
def test_the_layout_finds_the_first_byte_json_forbids(text: str, at: int | None) -> None:
    layout = span_layout(text.encode(), 0, len(text), piece_bytes=2, window=2)
    assert layout.violation == at


# ---- the pieces' rules ---------------------------------------------------------------------

scalars = st.one_of(
    st.integers(-5, 5),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**400]),
    st.floats(allow_nan=False), st.booleans(), st.none(),
)  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(values=st.lists(scalars, min_size=1, max_size=30), data=st.data())
def test_pieces_read_as_numpy_reads_the_whole_list(values: list[Any], data: Any) -> None:
    inner = st.integers(1, len(values) - 1) if len(values) > 1 else st.nothing()
    cuts = sorted(data.draw(st.sets(inner, max_size=6 if len(values) > 1 else 0)))
    builder = NumberArrayBuilder(len(values))
    for start, stop in zip([0, *cuts], [*cuts, len(values)], strict=True):
        builder.add(values[start:stop])
    got = builder.finish((len(values),))
    whole = np.asarray(values)
    assert got.kind == whole.dtype.kind
    assert got.booleans == any(type(v) is bool for v in values)
    if whole.dtype.kind != "O":
        assert got.as_array().dtype == whole.dtype
        assert got.as_array().tobytes() == whole.tobytes()
        return
    expected = minus_inf_of(whole)
    if isinstance(expected, str):
        assert got.minus_inf() == expected
    else:
        minus_inf = got.minus_inf()
        assert not isinstance(minus_inf, str)
        assert minus_inf.tobytes() == expected.tobytes()


def test_a_ragged_number_array_is_refused_as_numpy_refuses_a_ragged_list() -> None:
    with pytest.raises(ValueError, match="inhomogeneous"):
        np.asarray([[1, 2], [3]])
    with pytest.raises(ValueError, match="ragged"):
        NumberArray.ragged_list().as_array()
    with pytest.raises(ValueError, match="inhomogeneous"):  # and a list around its stand-in
        np.asarray([NumberArray.ragged_list().stand_in(), "x"])


# ---- from_json's words, carried -------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(value=json_values, indent=st.sampled_from([None, 1]), data=st.data())
def test_an_error_is_placed_where_from_json_places_it(
    value: Any, indent: int | None, data: Any
) -> None:
    text = json.dumps(value, indent=indent)
    at = data.draw(st.integers(0, len(text)))
    broken = text[:at] + data.draw(st.sampled_from([",", "]", "x", "", "\n}"])) + text[at + 1 :]
    body = broken.encode()
    error = parse_error(body, allow_inf_nan=False)
    assert (None if error is None else message(body, error)) == from_json_says(body)


def from_json_says(body: bytes) -> str | None:
    try:
        from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        return str(exc)
    return None


# ---- the envelope's bound, and the places of lists ------------------------------------------


def test_an_envelope_of_too_many_values_is_refused_before_it_is_parsed() -> None:
    pieces = Pieces(piece_bytes=64, min_span_bytes=64, few_values=0)
    strings = ", ".join(['"x"'] * (MAX_ENVELOPE_VALUES + 1))
    body = f'{{"q": [{strings}]}}'.encode()
    with pytest.raises(InvalidRequest) as raised:
        loads_in_pieces(body, slot_of=array_slots(AttentionRequest), allow_inf_nan=False,
                        pieces=pieces)  # fmt: skip
    (error,) = raised.value.errors
    assert (error.loc, error.type) == (("body",), "too_many_values")
    fewer = ", ".join(['"x"'] * (MAX_ENVELOPE_VALUES - 10))
    parsed = loads_in_pieces(f'{{"q": [{fewer}]}}'.encode(), slot_of=array_slots(AttentionRequest),
                             allow_inf_nan=False, pieces=pieces)  # fmt: skip
    assert len(parsed["q"]) == MAX_ENVELOPE_VALUES - 10


def test_a_tensors_numbers_stand_as_a_number_array_and_other_lists_as_lists() -> None:
    pieces = Pieces(piece_bytes=8, min_span_bytes=8, few_values=0)
    rows = [[1.5, 2, -0.0], [4, 5e3, 6]]
    request = {"q": rows, "k": {"dtype": "float32", "data": rows},
               "strategies": [[1, 2, 3, 4]], "extra": [1, 2, 3, 4, 5]}  # fmt: skip
    body = json.dumps(request).encode()
    parsed = loads_in_pieces(body, slot_of=array_slots(AnalyzeRequest), allow_inf_nan=False,
                             pieces=pieces)  # fmt: skip
    for array in (parsed["q"], parsed["k"]["data"]):
        assert isinstance(array, NumberArray)
        assert array.as_array().tolist() == [[1.5, 2.0, -0.0], [4.0, 5000.0, 6.0]]
    assert parsed["strategies"] == [[]]  # its items are lists: what the model says of them
    assert parsed["extra"] == []  # an unknown field: refused whatever it holds
    assert parse_whole(body, allow_inf_nan=False)["q"] == rows


@pytest.mark.parametrize(
    ("path", "slot"),
    [
        (("q",), Slot.TENSOR), (("attn_mask", "data"), Slot.TENSOR),
        (("key_lengths",), Slot.TENSOR), (("q", 0, 1), Slot.IN_TENSOR),
        (("q", "data", 2), Slot.IN_TENSOR), (("q", "shape"), Slot.LIST),
        (("strategies",), Slot.LIST), (("v",), Slot.ANY), (("q", 0, "a"), Slot.ANY),
        (("scale",), Slot.ANY), (("unknown",), Slot.ANY), ((), Slot.ANY),
    ],
)  # fmt: skip
def test_where_a_v1_analyze_request_reads_its_lists(path: Any, slot: Slot) -> None:
    assert array_slots(AnalyzeRequest)(path) == slot


@pytest.mark.parametrize(
    ("path", "slot"),
    [
        (("inputs", 0, "data"), Slot.TENSOR), (("inputs", 1, "data", 0), Slot.IN_TENSOR),
        (("inputs", 0, "shape"), Slot.LIST), (("inputs",), Slot.LIST), (("outputs",), Slot.LIST),
        (("inputs", 0), Slot.ANY), (("parameters",), Slot.ANY), (("outputs", 0), Slot.ANY),
    ],
)  # fmt: skip
def test_where_a_v2_request_reads_its_lists(path: Any, slot: Slot) -> None:
    assert array_slot(path) == slot


def deep(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


ROWS = "[" + ", ".join(["[1.5, -2, 3e2, -0.0]"] * 6) + "]"
EDGES = {
    "65 levels: numpy's 64 dimensions, refused as ragged": f'{{"q": {deep(65)}}}',
    "7 levels: past the rank limit": f'{{"q": {deep(7)}, "k": {ROWS}, "v": {ROWS}}}',
    "130 levels, parsed whole": f'{{"q": {deep(130)}}}',
    "250 levels: jiter's recursion limit": f'{{"q": {ROWS}, "k": {deep(250)}}}',
    "a key given twice": f'{{"q": {ROWS}, "q": [[1, 2], [3, 4]], "k": {ROWS}, "v": {ROWS}}}',
    "NaN is no JSON": f'{{"q": {ROWS}, "k": [[1, 2], [NaN, 4]], "v": {ROWS}}}',
    "a number of 4,400 digits": f'{{"q": {ROWS}, "k": [[1, {"9" * 4400}]], "v": {ROWS}}}',
    "the whole body is an array": ROWS,
    "a shape of 70 numbers": f'{{"q": {{"dtype": "float32", "shape": {deep(1, "1, " * 69 + "1")}, '
    f'"data": {ROWS}}}, "k": {ROWS}, "v": {ROWS}}}',
    "a shape of one list": f'{{"q": {{"dtype": "float32", "shape": [{ROWS}], "data": [1]}}}}',
    "escaped quotes and brackets beside the arrays": (
        f'{{"tag": "\\\\", "q": {ROWS}, "x]": "\\"[", "k": {ROWS}, "v": {ROWS}}}'
    ),
    "a trailing comma at the end of a long array": f'{{"q": {ROWS[:-1]},]}}',
    "the body ends inside an array": f'{{"q": {ROWS}, "k": {ROWS[:40]}',
    "an unknown field's array": f'{{"q": {ROWS}, "k": {ROWS}, "v": {ROWS}, "x": {ROWS}}}',
    "strategies of numbers": f'{{"q": {ROWS}, "k": {ROWS}, "strategies": {ROWS}}}',
}


PARSED_WHOLE = ("130 levels, parsed whole", "250 levels: jiter's recursion limit")


@pytest.mark.parametrize("name", EDGES)
@pytest.mark.parametrize("model", [AttentionRequest, AnalyzeRequest])
def test_edges_decode_alike_whole_and_in_pieces(name: str, model: Any) -> None:
    body = EDGES[name].encode()
    for window in (5, 1 << 18):
        pieces = Pieces(piece_bytes=9, min_span_bytes=4, few_values=0, window=window)
        whole = name in PARSED_WHOLE
        assert v1_outcome(body, model, pieces, last_resort=whole) == v1_outcome(body, model, None)


@pytest.mark.parametrize("name", PARSED_WHOLE)
def test_arrays_nested_near_jiters_recursion_limit_are_parsed_whole(name: str) -> None:
    pieces = Pieces(piece_bytes=9, min_span_bytes=4, few_values=0)
    with pytest.raises(WholeParseNeeded):
        in_pieces(EDGES[name].encode(), array_slots(AttentionRequest), pieces, allow_inf_nan=False)


def test_a_large_body_the_pieces_cannot_answer_for_is_refused_not_parsed_whole() -> None:
    """130 levels around 300 KB of numbers: past MAX_NESTING, which the pieces leave to jiter;
    parsed whole, such a body would hold the loop and its Python floats as before, so past
    WHOLE_PARSE_BYTES it is refused (a small one, above, is parsed whole)."""
    numbers = ", ".join(["1.5"] * (WHOLE_PARSE_BYTES // 5 + 1))
    body = f'{{"q": {deep(130, numbers)}}}'.encode()
    assert len(body) > WHOLE_PARSE_BYTES
    with pytest.raises(InvalidRequest) as refused:
        loads_in_pieces(body, slot_of=array_slots(AttentionRequest), allow_inf_nan=False)
    assert refused.value.errors[0].type == "json_invalid"
    assert f"arrays nested more than {MAX_NESTING} deep" in refused.value.detail
