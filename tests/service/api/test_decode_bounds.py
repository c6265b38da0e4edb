"""Bounded error bodies through the app (in process), on both protocols: what the wire layer
refuses reaches the client as a small problem+json (v1) or {"error"} (v2), with the status each
protocol uses, whatever the body held."""

from __future__ import annotations

import json

import httpx

V2_INFER = "/v2/models/attention/infer"
OK = '"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]'
V2_INPUTS = ", ".join(
    f'{{"name": "{n}", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}}' for n in "qkv"
)
JSON = {"content-type": "application/json"}


def unknown_fields(count: int) -> str:
    return ", ".join(f'"f{i}": 0' for i in range(count))


def test_v1_sixty_thousand_unknown_fields_answer_a_small_problem(
    client: httpx.Client,
) -> None:
    body = f"{{{OK}, {unknown_fields(60_000)}}}".encode()  # 0.8 MB, under the 1 MiB limit
    response = client.post("/v1/attention", content=body, headers=JSON)
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    assert len(response.content) < 1024
    (error,) = response.json()["errors"]
    assert (error["loc"], error["type"]) == (["body"], "too_many_keys")


def test_v1_many_errors_list_ten_and_count_the_rest(client: httpx.Client) -> None:
    # 8 unknown fields in each of q, k and v: 24 errors.
    tensors = ", ".join(
        f'"{n}": {{"dtype": "float32", "data": [[1.0]], {unknown_fields(8)}}}' for n in "qkv"
    )
    response = client.post("/v1/attention", content=f"{{{tensors}}}".encode(), headers=JSON)
    problem = response.json()
    assert response.status_code == 422
    assert len(problem["errors"]) == 10
    assert problem["detail"] == "q.f0: unknown field 'f0' (and 23 more; 10 listed)"


def test_v1_a_megabyte_key_is_clipped_in_the_answer(client: httpx.Client) -> None:
    body = f'{{{OK}, "{"x" * 1_000_000}": 0}}'.encode()
    response = client.post("/v1/attention", content=body, headers=JSON)
    assert response.status_code == 422
    assert len(response.content) < 1024
    (error,) = response.json()["errors"]
    assert error["loc"] == ["body", "x" * 63 + "…"]


def test_v2_unknown_parameters_answer_a_small_400(client: httpx.Client) -> None:
    body = f'{{"inputs": [{V2_INPUTS}], "parameters": {{{unknown_fields(60_000)}}}}}'.encode()
    response = client.post(V2_INFER, content=body, headers=JSON)
    assert response.status_code == 400
    assert len(response.content) < 1024
    assert "more than 4,096 ':'" in response.json()["error"]


def test_v2_a_header_length_of_4301_digits_is_a_400_naming_the_header(
    client: httpx.Client,
) -> None:
    body = f'{{"inputs": [{V2_INPUTS}]}}'.encode()
    headers = {**JSON, "Inference-Header-Content-Length": "1" * 4301}
    response = client.post(V2_INFER, content=body, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"].startswith("header Inference-Header-Content-Length: ")


def test_v2_fp32_data_with_a_boolean_is_a_400_as_v1s_is_a_422(client: httpx.Client) -> None:
    inputs = json.loads(f"[{V2_INPUTS}]")
    inputs[0]["data"] = [1.0, True]
    response = client.post(V2_INFER, json={"inputs": inputs})
    assert response.status_code == 400
    assert response.json() == {
        "error": "input 'q': FP32 data must hold only numbers, found booleans"
    }
    v1_body = {"q": [[1.0, True]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}
    v1 = client.post("/v1/attention", json=v1_body)
    assert v1.status_code == 422
    assert v1.json()["errors"][0]["msg"] == "data must hold only numbers, found booleans"
