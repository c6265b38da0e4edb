"""v1's `temperature` (scale = 1/(T·sqrt(D))) and null as -inf in a float attn_mask sent as
JSON lists, in process, against the float64 reference of tests/core/reference.py."""

from __future__ import annotations

import math
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.core.reference import reference_attention, visibility

RNG = np.random.default_rng(11)
Q, K, V = (RNG.standard_normal((2, 5, 8)).astype(np.float32) for _ in range(3))  # [H, N, D]


def _reference(*, scale: float, bias: np.ndarray | None = None) -> np.ndarray:
    mask = None if bias is None else torch.from_numpy(bias)
    visible = visibility(b=1, h=2, n_q=5, n_kv=5, causal="none", attn_mask=mask)
    ref = reference_attention(
        *(torch.from_numpy(x.astype(np.float64)) for x in (Q, K, V)),
        visible,
        scale=scale,
        bias=mask,
    )
    return ref.out.numpy().reshape(2, 5, 8)


def _attention(client: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"q": Q.tolist(), "k": K.tolist(), "v": V.tolist(), "diagnostics": "none", **fields}
    return client.post("/v1/attention", json=body)


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_temperature_scales_by_one_over_t_sqrt_d(client: httpx.Client, temperature: float) -> None:
    response = _attention(client, temperature=temperature)
    assert response.status_code == 200, response.text
    got = np.array(response.json()["output"]["data"])
    want = _reference(scale=1.0 / (temperature * math.sqrt(8)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_temperature_with_scale_is_a_422(client: httpx.Client) -> None:
    response = _attention(client, temperature=2.0, scale=0.1)
    assert response.status_code == 422
    error = response.json()["errors"][0]
    assert "scale or temperature" in error["msg"]
    assert error["type"] == "scale_and_temperature"


@pytest.mark.parametrize("temperature", [0, -1.5])
def test_temperature_must_be_positive(client: httpx.Client, temperature: float) -> None:
    response = _attention(client, temperature=temperature)
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "temperature"]


def test_null_is_minus_inf_in_a_float_mask(client: httpx.Client) -> None:
    bias = RNG.standard_normal((5, 5)).astype(np.float32)
    bias[0, 1:] = -np.inf  # query 0 sees key 0 only
    bias[3, :] = -np.inf  # query 3 sees nothing: a fully masked row
    as_json = [[None if math.isinf(x) else float(x) for x in row] for row in bias]
    for mask in (as_json, {"dtype": "float32", "shape": [5, 5], "data": as_json}):
        response = _attention(client, attn_mask=mask, diagnostics="summary")
        assert response.status_code == 200, response.text
        got = np.array(response.json()["output"]["data"])
        np.testing.assert_allclose(got, _reference(scale=1 / math.sqrt(8), bias=bias), atol=1e-5)
        assert not got[:, 3].any()
        assert response.json()["diagnostics"]["summary"]["masked_rows"] == 2  # row 3, 2 heads


@pytest.mark.parametrize(
    "mask",
    [
        [[0.0, None, "x"]],  # a string beside the nulls
        [[True, None, False]],  # a bool mask has no -inf
        {"dtype": "bool", "shape": [1, 3], "data": [[True, None, False]]},
        [[0.0, None, 10**400]],  # an integer beyond float64 beside the nulls (was a 500)
    ],
)
def test_null_beside_non_numbers_is_refused(client: httpx.Client, mask: Any) -> None:
    response = _attention(client, attn_mask=mask)
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["loc"][:2] == ["body", "attn_mask"]


def test_the_schema_documents_temperature_and_null(client: httpx.Client) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    request = schemas["AttentionRequest"]["properties"]
    assert request["temperature"]["anyOf"][0]["exclusiveMinimum"] == 0
    mask_object = schemas["MaskTensor"]["properties"]["data"]
    assert "null" in str(mask_object)
    assert "-inf" in request["attn_mask"]["description"]


def test_a_temperature_too_small_for_a_finite_scale_names_temperature(
    client: httpx.Client,
) -> None:
    response = _attention(client, temperature=1e-320)  # 1/(T·sqrt(8)) overflows float
    assert response.status_code == 422, response.text
    error = response.json()["errors"][0]
    assert error["loc"] == ["body", "temperature"]
    assert "not a finite number" in error["msg"]


# Every q·k is positive, so -1e308 (-inf in float32) makes every score -inf, never NaN: the
# fused path answered 200 with zeros, as if every key were masked.
POSITIVE = [[1.0, 0.0], [2.0, 0.0]]


@pytest.mark.parametrize("diagnostics", ["none", "summary", "full"])
def test_a_scale_that_is_infinite_in_float32_is_a_422_on_every_path(
    client: httpx.Client, diagnostics: str
) -> None:
    body = {"q": POSITIVE, "k": POSITIVE, "v": POSITIVE, "scale": -1e308}
    response = client.post("/v1/attention", json={**body, "diagnostics": diagnostics})
    assert response.status_code == 422, response.text
    error = response.json()["errors"][0]
    assert error["loc"][-1] == "scale"
    assert "accumulation dtype (float32)" in error["msg"]


def test_a_scale_that_is_infinite_in_float32_is_a_400_on_v2(client: httpx.Client) -> None:
    inputs = [
        {
            "name": name,
            "datatype": "FP32",
            "shape": [2, 2],
            "data": [x for row in POSITIVE for x in row],
        }
        for name in ("q", "k", "v")
    ]
    response = client.post(
        "/v2/models/attention/infer", json={"inputs": inputs, "parameters": {"scale": -1e308}}
    )
    assert response.status_code == 400, response.text
    assert "accumulation dtype (float32)" in response.json()["error"]
