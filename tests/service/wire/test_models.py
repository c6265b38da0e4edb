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
    BoolTensor,
    CustomStrategy,
    FloatTensor,
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
    assert req.return_output is True
    assert req.q == Q


def test_a_typo_is_refused_and_explained() -> None:
    ((loc, msg),) = errors_of({**BASE, "casual": True})
    assert loc == ("body", "casual")
    assert "did you mean 'causal'" in msg
    ((loc, msg),) = errors_of({**BASE, "return_outputs": False})
    assert loc == ("body", "return_outputs")
    assert "did you mean 'return_output'" in msg


def test_return_output_is_documented_in_the_schema() -> None:
    assert (
        validate_request({**BASE, "return_output": False}, AttentionRequest).return_output is False
    )
    schema = AttentionRequest.model_json_schema()["properties"]["return_output"]
    assert schema["type"] == "boolean"
    assert schema["default"] is True
    assert "null" in schema["description"]


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
        ("return_output", "false"),
        ("return_output", 0),
        ("return_output", None),
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
    for model in (AttentionRequest, AnalyzeRequest, WireTensor, BoolTensor):
        examples = model.model_json_schema()["examples"]
        assert examples
        for example in examples:
            model.model_validate(example)


def test_documented_b64_pattern_matches_python_base64() -> None:
    for raw in (b"", b"a", b"ab", b"abc", bytes(range(256))):
        assert re.fullmatch(B64_PATTERN, base64.b64encode(raw).decode())
    for bad in ("AAC", "AA=A", "AA AA", "AAC\u00e9"):
        assert not re.fullmatch(B64_PATTERN, bad)


# ---- the documented schema and the server agree (issue: schemathesis findings) --------------


def request_schema(model: Any = AttentionRequest) -> dict[str, Any]:
    return dict(model.model_json_schema())


def schema_allows(body: Any, model: Any = AttentionRequest) -> bool:
    return bool(jsonschema.Draft202012Validator(request_schema(model)).is_valid(body))


Q4 = [[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]]  # [B=1, H=1, N=3, D=2]


@pytest.mark.parametrize(
    "mask",
    [
        [[0.0, 1.0, 0.0]],
        [[0, 1, 0]],
        [[True, 0.0, False]],
        {"dtype": "float32", "data": [[0.0, 1.0, 0.0]]},
        {"dtype": "bool", "data": [[0.0, 1.0, 0.0]]},
        {"dtype": "float16", "shape": [1, 3], "b64": "AAAAAAAA"},
    ],
)
def test_the_documented_key_padding_mask_is_bool_only(mask: Any) -> None:
    # The server refuses a key padding mask that is not bool (codec: role "bool_mask"); the
    # schema used to allow numbers and every dtype.
    body = {"q": Q4, "k": Q4, "v": Q4, "key_padding_mask": mask}
    assert not schema_allows(body)
    assert not schema_allows(body, AnalyzeRequest)


@pytest.mark.parametrize(
    "mask",
    [
        [[False, True, False]],
        {"dtype": "bool", "data": [[False, True, False]]},
        {"dtype": "bool", "shape": [1, 3], "b64": "AAEA"},
    ],
)
def test_a_bool_key_padding_mask_is_documented_and_accepted(mask: Any) -> None:
    body = {"q": Q4, "k": Q4, "v": Q4, "key_padding_mask": mask}
    assert schema_allows(body)
    assert validate_request(body, AttentionRequest).key_padding_mask is not None


def test_a_float_key_padding_mask_object_is_refused_at_its_dtype() -> None:
    ((loc, msg),) = errors_of(
        {**BASE, "key_padding_mask": {"dtype": "float32", "data": [[0.0, 1.0]]}}
    )
    assert loc == ("body", "key_padding_mask", "dtype")
    assert msg == "must be a bool tensor (true = padding), not float32"


@pytest.mark.parametrize(
    "mask",
    [
        [[0.0, 1.0, 0.0]],  # an additive bias
        [[True, False, True]],
        {"dtype": "float32", "data": [[0.0, -1.0, 0.0]]},
        {"dtype": "bool", "data": [[True, False, True]]},
    ],
)
def test_attn_mask_stays_documented_as_bool_or_float(mask: Any) -> None:
    assert schema_allows({"q": Q4, "k": Q4, "v": Q4, "attn_mask": mask})


@pytest.mark.parametrize("field", ["q", "attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("data", [0, 1.5, True, False, "0"])
def test_scalar_data_is_refused_at_data(field: str, data: Any) -> None:
    # No tensor on the wire is 0-d: the schema says data is an array, and the server agrees
    # (a bare 0 in an attn_mask used to be decoded as a 0-d mask and answered 200).
    dtype = "bool" if field == "key_padding_mask" else "float32"
    tensor = {"dtype": dtype, "data": data}
    assert not schema_allows({**BASE, field: tensor})
    ((loc, msg),) = errors_of({**BASE, field: tensor})
    assert loc == ("body", field, "data")
    assert "nested list" in msg


@pytest.mark.parametrize("field", ["q", "attn_mask", "key_padding_mask"])
def test_an_empty_shape_is_refused_at_shape(field: str) -> None:
    dtype = "bool" if field == "key_padding_mask" else "float32"
    tensor = {"dtype": dtype, "shape": [], "b64": "AAAAAA==" if dtype != "bool" else "AA=="}
    assert not schema_allows({**BASE, field: tensor})
    ((loc, _),) = errors_of({**BASE, field: tensor})
    assert loc == ("body", field, "shape")


def test_explicit_null_data_is_documented_as_absent() -> None:
    # {"data": null, "b64": ...} is accepted (null = absent), so the schema must allow it.
    tensor = {"dtype": "float32", "shape": [2], "b64": "AACAPwAAAEA=", "data": None}
    assert schema_allows({**BASE, "q": tensor})
    assert validate_request({**BASE, "q": tensor}, AttentionRequest).q == FloatTensor(
        dtype="float32", shape=[2], b64="AACAPwAAAEA="
    )


def test_q_k_v_are_documented_and_checked_as_float_only() -> None:
    """A bool dtype or boolean leaves in q, k or v: the schema refuses them, as the server does."""
    for name in "qkv":
        as_object = {"dtype": "bool", "shape": [1, 1], "data": [[True]]}
        assert not schema_allows({**BASE, name: as_object})
        ((loc, msg),) = errors_of({**BASE, name: as_object}, AttentionRequest)
        assert loc == ("body", name, "dtype")
        assert "floating-point" in msg
        assert not schema_allows({**BASE, name: [[True, 1.0]]})
        assert not schema_allows({**BASE, name: {"dtype": "float32", "data": [[True]]}})
