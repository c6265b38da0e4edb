"""service.wire.models: the request envelope, its error locations, the documented schemas."""

from __future__ import annotations

import base64
import re
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from service.errors import InvalidRequest
from service.wire.models import (
    B64_PATTERN,
    NESTED_INPUT_SCHEMA,
    AnalyzeRequest,
    AttentionRequest,
    CustomStrategy,
    WireTensor,
    validate_request,
)

Q = [[1.0, 0.0], [0.0, 1.0]]
BASE: dict[str, Any] = {"q": Q, "k": Q, "v": Q}


def errors_of(payload: Any, model: Any = AttentionRequest) -> list[tuple[tuple[Any, ...], str]]:
    with pytest.raises(InvalidRequest) as info:
        validate_request(payload, model)
    return [(e.loc, e.msg) for e in info.value.errors]


def test_defaults_follow_the_http_api() -> None:
    req = validate_request(BASE, AttentionRequest)
    assert req.causal is False
    assert req.diagnostics == "summary"
    assert req.return_weights is False
    assert req.response_encoding is None
    assert req.q == Q


def test_a_typo_is_refused_and_explained() -> None:
    ((loc, msg),) = errors_of({**BASE, "casual": True})
    assert loc == ("body", "casual")
    assert "did you mean 'causal'" in msg


def test_a_field_of_another_endpoint_is_refused_without_a_useless_hint() -> None:
    with pytest.raises(InvalidRequest) as raised:
        validate_request(
            {"synthetic": {"n_q": 4, "n_k": 4, "d_k": 4}, "scale": 1.0}, AnalyzeRequest
        )
    (error,) = raised.value.errors
    assert error.loc == ("body", "scale")
    assert error.msg == "unknown field 'scale': this endpoint does not take it"


@pytest.mark.parametrize("causal", [False, True, "top_left", "bottom_right"])
def test_causal_options(causal: Any) -> None:
    assert validate_request({**BASE, "causal": causal}, AttentionRequest).causal == causal


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("causal", 1),
        ("causal", "true"),
        ("causal", "bottom-right"),
        ("return_weights", "yes"),
        ("return_weights", 1),
        ("diagnostics", "all"),
        ("response_encoding", "msgpack"),
        ("scale", float("inf")),
        ("scale", "0.5"),
        ("timeout_ms", 0),
        ("key_lengths", "3"),
    ],
)
def test_bad_options_are_located(field: str, value: Any) -> None:
    ((loc, _),) = errors_of({**BASE, field: value})
    assert loc == ("body", field)


def test_tensor_errors_name_the_tensor_field_without_union_noise() -> None:
    payload = {**BASE, "k": {"dtype": "float33", "data": Q}, "v": 3}
    errors = dict(errors_of(payload))
    assert set(errors) == {("body", "k", "dtype"), ("body", "v")}
    assert "nested list" in errors[("body", "v")]
    ((loc, _),) = errors_of({"k": Q, "v": Q})
    assert loc == ("body", "q")


@pytest.mark.parametrize(
    "tensor",
    [
        {"dtype": "float32", "shape": [2], "data": [1.0, 2.0], "b64": "AAAA"},
        {"dtype": "float32", "shape": [2]},
        {"dtype": "float32", "b64": "AACAPwAAAEA="},
        {"dtype": "float32", "shape": [-1], "data": [1.0]},
        {"dtype": "float32", "shape": [1] * 7, "data": 1.0},
        {"dtype": "float32", "data": [1.0], "bytes": "x"},
    ],
)
def test_wire_tensor_envelope(tensor: dict[str, Any]) -> None:
    errors = errors_of({**BASE, "q": tensor})
    assert all(loc[:2] == ("body", "q") for loc, _ in errors)


def test_analyze_takes_q_and_k_or_synthetic() -> None:
    syn = {"n_q": 8, "n_k": 8, "d_k": 16}
    assert validate_request({"synthetic": syn}, AnalyzeRequest).synthetic is not None
    assert validate_request({"q": Q, "k": Q}, AnalyzeRequest).q == Q
    for payload in ({}, {"q": Q}, {"q": Q, "k": Q, "synthetic": syn}):
        ((loc, _),) = errors_of(payload, AnalyzeRequest)
        assert loc == ("body",)


def test_strategies_mix_names_and_custom_divisors() -> None:
    req = validate_request(
        {"q": Q, "k": Q, "strategies": ["dk", {"name": "t8", "divisor": 8}]}, AnalyzeRequest
    )
    assert req.strategies == ["dk", CustomStrategy(name="t8", divisor=8.0)]
    errors = errors_of(
        {"q": Q, "k": Q, "strategies": ["sqrt", {"name": "t", "divisor": 0}, 5]}, AnalyzeRequest
    )
    assert [loc for loc, _ in errors] == [
        ("body", "strategies", 0),
        ("body", "strategies", 1, "divisor"),
        ("body", "strategies", 2),
    ]


def test_synthetic_bounds() -> None:
    for bad in ({"n_q": 0}, {"d_k": 1.5}, {"std": 0}, {"seed": -1}, {"dtype": "int8"}):
        syn = {"n_q": 8, "n_k": 8, "d_k": 16, **bad}
        ((loc, _),) = errors_of({"synthetic": syn}, AnalyzeRequest)
        assert loc == ("body", "synthetic", next(iter(bad)))


def test_documented_nested_list_schema_bounds_the_rank() -> None:
    jsonschema.validate([[[[0.5, True]]]], NESTED_INPUT_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([[[[[[[1.0]]]]]]], NESTED_INPUT_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([["a"]], NESTED_INPUT_SCHEMA)


def test_request_examples_validate() -> None:
    for model in (AttentionRequest, AnalyzeRequest, WireTensor):
        examples = model.model_json_schema()["examples"]
        assert examples
        for example in examples:
            model.model_validate(example)


def test_documented_b64_pattern_matches_python_base64() -> None:
    for raw in (b"", b"a", b"ab", b"abc", bytes(range(256))):
        assert re.fullmatch(B64_PATTERN, base64.b64encode(raw).decode())
    for bad in ("AAC", "AA=A", "AA AA", "AAC\u00e9"):
        assert not re.fullmatch(B64_PATTERN, bad)
