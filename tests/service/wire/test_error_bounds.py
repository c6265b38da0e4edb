"""Bounded work per error and bounded error bodies, v1 and v2: an object with many unknown
fields is refused in one error before pydantic walks its keys, at most MAX_LISTED_ERRORS errors
are listed with the count of the rest, and every text a client can lengthen is clipped."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.errors import (
    MAX_ERROR_TEXT,
    MAX_LISTED_ERRORS,
    MAX_LOC_TEXT,
    FieldError,
    InvalidRequest,
    and_more,
    clip,
    problem_payload,
)
from service.wire.codec import MAX_KEYS, loads_request, occurrences
from service.wire.models import (
    MAX_UNKNOWN_FIELDS,
    AnalyzeRequest,
    AttentionRequest,
    unknown_field_hint,
    validate_request,
)
from service.wire.v2_models import parse_infer_request

Q = [[1.0, 0.0], [0.0, 1.0]]
BASE: dict[str, Any] = {"q": Q, "k": Q, "v": Q}
V2_INPUTS = [{"name": n, "datatype": "FP32", "shape": [2, 2], "data": [1.0] * 4} for n in "qkv"]


def refusal(payload: Any, model: Any = AttentionRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        validate_request(payload, model)
    return raised.value


def v2_refusal(payload: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        parse_infer_request(payload)
    return raised.value


def unknown(count: int) -> dict[str, int]:
    return {f"x{i}": 0 for i in range(count)}


def test_a_hundred_thousand_unknown_fields_are_one_error_naming_the_first_three() -> None:
    exc = refusal({**BASE, **unknown(100_000)})
    (error,) = exc.errors
    assert error.loc == ("body",)
    assert error.type == "too_many_unknown_fields"
    assert error.msg.startswith("100,000 unknown fields ('x0', 'x1', 'x2', ...); this object takes")
    assert "response_encoding" in error.msg  # it lists the fields the object does take
    assert exc.detail == f"body: {error.msg}"
    body = json.dumps(problem_payload(status=422, detail=exc.detail, errors=exc.errors))
    assert len(body) < 2_000


def test_up_to_the_bound_each_unknown_field_is_its_own_error_with_its_hint() -> None:
    # MAX_UNKNOWN_FIELDS (8) unknown keys: 8 errors, the typo explained; one more: one error.
    fields = {"casual": True, **unknown(MAX_UNKNOWN_FIELDS - 1)}
    exc = refusal({**BASE, **fields})
    assert [e.loc for e in exc.errors] == [("body", name) for name in fields]
    assert exc.errors[0].msg == "unknown field 'casual'; did you mean 'causal'?"
    assert exc.detail.endswith(" (and 7 more)")
    (error,) = refusal({**BASE, **fields, "one_more": 1}).errors
    assert error.msg.startswith("9 unknown fields ('casual', 'x0', 'x1', ...)")


def test_a_tensor_object_with_many_unknown_fields_is_refused_at_its_own_loc() -> None:
    tensor = {"dtype": "float32", "data": Q, **unknown(50_000)}
    (error,) = refusal({**BASE, "k": tensor}).errors
    assert error.loc == ("body", "k")
    assert error.msg == (
        "50,000 unknown fields ('x0', 'x1', 'x2', ...); this object takes dtype, shape, data, b64"
    )


def test_a_strategy_with_many_unknown_fields_is_refused_at_its_index() -> None:
    strategies = ["dk", {"name": "mine", "divisor": 2.0, **unknown(20)}]
    payload = {"synthetic": {"n_q": 4, "n_k": 4, "d_k": 4}, "strategies": strategies}
    (error,) = refusal(payload, AnalyzeRequest).errors
    assert error.loc == ("body", "strategies", 1)
    assert error.msg.startswith("20 unknown fields ('x0', 'x1', 'x2', ...)")


def test_at_most_the_listed_errors_are_kept_and_the_detail_counts_them_all() -> None:
    # 8 unknown fields and q, k, v missing: 11 errors, 10 listed (MAX_LISTED_ERRORS).
    exc = refusal(unknown(MAX_UNKNOWN_FIELDS))
    assert MAX_LISTED_ERRORS == 10
    assert len(exc.errors) == 10
    assert exc.detail.endswith(" (and 10 more; 10 listed)")


def test_a_megabyte_key_is_clipped_in_the_loc_and_the_message() -> None:
    key = "k" * 1_000_000
    (error, *_) = refusal({key: 1, **BASE}).errors
    clipped = key[: MAX_LOC_TEXT - 1] + "…"
    assert error.loc == ("body", clipped)
    assert error.msg == f"unknown field {clipped!r}"  # no hint for such a key
    assert unknown_field_hint(key, ["k"]) is None
    assert unknown_field_hint("casual", ["causal", "scale"]) == "causal"


def test_v2_many_unknown_fields_are_one_error_at_the_top_in_parameters_and_in_an_input() -> None:
    exc = v2_refusal({"inputs": V2_INPUTS, **unknown(90_000)})
    assert [e.msg for e in exc.errors] == [
        "request: 90,000 unknown fields ('x0', 'x1', 'x2', ...); this object takes id, "
        "model_name, model_version, parameters, inputs, outputs"
    ]
    exc = v2_refusal({"inputs": V2_INPUTS, "parameters": unknown(90_000)})
    ((error),) = exc.errors
    assert error.loc == ("v2", "parameters")
    assert error.msg.startswith("parameters: 90,000 unknown fields ('x0', 'x1', 'x2', ...)")
    inputs = [{**V2_INPUTS[0], **unknown(9)}, *V2_INPUTS[1:]]
    ((error),) = v2_refusal({"inputs": inputs}).errors
    assert error.loc == ("v2", "inputs", 0)
    assert error.msg.startswith("inputs[0]: 9 unknown fields ('x0', 'x1', 'x2', ...)")


def test_v2_lists_at_most_ten_errors_and_counts_the_rest() -> None:
    # Each input has 8 unknown fields (each its own error, under the bound): 3 x 8 = 24 errors.
    inputs = [{**inp, **unknown(MAX_UNKNOWN_FIELDS)} for inp in V2_INPUTS]
    exc = v2_refusal({"inputs": inputs})
    assert len(exc.errors) == MAX_LISTED_ERRORS
    assert exc.detail == "unknown field 'x0' (and 23 more; 10 listed)"


def test_a_problem_body_lists_ten_errors_and_clips_every_text() -> None:
    errors = [FieldError(loc=("body", "y" * 100, i), msg="m" * 2000) for i in range(50)]
    problem = problem_payload(status=422, detail="d" * 10_000, errors=errors)
    assert problem["detail"] == "d" * (MAX_ERROR_TEXT - 1) + "…"
    assert len(problem["errors"]) == MAX_LISTED_ERRORS
    first = problem["errors"][0]
    assert first["loc"] == ["body", "y" * (MAX_LOC_TEXT - 1) + "…", 0]
    assert first["msg"] == "m" * (MAX_ERROR_TEXT - 1) + "…"


def test_clip_and_and_more_say_what_they_cut() -> None:
    assert clip("abc", 3) == "abc"
    assert clip("abcd", 3) == "ab…"
    assert and_more(1, listed=1) == ""
    assert and_more(2, listed=2) == " (and 1 more)"
    assert and_more(100_000, listed=10) == " (and 99,999 more; 10 listed)"


def test_a_body_of_more_keys_than_any_request_holds_is_refused_before_parsing() -> None:
    # q, k, v and n unknown fields: n + 3 ':' (no string here holds one).
    def body(n: int) -> bytes:
        return json.dumps({**BASE, **unknown(n)}).encode()

    assert MAX_KEYS == 4096
    assert body(4093).count(b":") == 4096
    parsed = loads_request(body(4093))  # parsed, then refused by the model (one error)
    assert len(parsed) == 4096
    with pytest.raises(InvalidRequest) as raised:
        loads_request(body(4094))
    (error,) = raised.value.errors
    assert (error.loc, error.type) == (("body",), "too_many_keys")
    assert error.msg.startswith("request body holds more than 4,096 ':' (its keys")


def test_occurrences_counts_exactly_across_windows_and_stops_past_the_bound() -> None:
    text = (b"x" * 999 + b":") * 3000  # 3,000 ':' over 3 MB: counting windows of 1 MiB
    assert occurrences(text, ord(":")) == 3000
    assert occurrences(text, ord(":"), end=999 * 1000 + 1000) == 1000
    assert occurrences(text, ord("x"), end=10) == 10
    assert occurrences(text, ord("{")) == 0
    # Asked only whether it is past 40: it stops after the first window that tells.
    assert 40 < occurrences(text, ord(":"), past=40) < 3000
