"""Big JSON-list bodies through the app (in process), whose arrays of numbers are parsed in
pieces off the event loop (service.wire.json_arrays): the answers are those of base64 (v1) and
binary (v2) bodies of the same tensors, and their refusals those of a whole parse."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic_core import from_json

from service.serving.offload import decode_inline
from service.wire.json_arrays import MAX_ENVELOPE_VALUES
from tests.support.app import in_process_client, small_settings

V1 = "/v1/attention"
V2 = "/v2/models/attention/infer"
JSON = {"content-type": "application/json"}
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    settings = small_settings(
        max_body_bytes=32 << 20, max_elements=1 << 22, max_weights_elements=1 << 22
    )
    with in_process_client(settings) as c:
        yield c


def b64(arr: np.ndarray[Any, Any], dtype: str) -> dict[str, Any]:
    wire = arr.astype({"float32": "<f4", "float16": "<f2", "bool": "u1"}[dtype])
    text = base64.b64encode(wire.tobytes()).decode()
    return {"dtype": dtype, "shape": list(arr.shape), "b64": text}


def post(client: httpx.Client, path: str, payload: dict[str, Any]) -> httpx.Response:
    body = json.dumps(payload).encode()
    assert not decode_inline(body) or len(body) < 4096  # the big ones leave the loop
    return client.post(path, content=body, headers=JSON)


def qkv(n: int = 1024, d: int = 32) -> dict[str, np.ndarray[Any, Any]]:
    return {name: RNG.standard_normal((1, 2, n, d)).astype(np.float32) for name in "qkv"}


def test_v1_json_lists_answer_as_base64(client: httpx.Client) -> None:
    t = qkv()
    mask = RNG.random((1, 1, 1024, 1024)) > 0.2
    mask[..., 0] = True
    common = {"response_encoding": "json", "diagnostics": "summary"}
    as_json = {**{k: v.tolist() for k, v in t.items()}, "attn_mask": mask.tolist(), **common}
    as_b64 = {**{k: b64(v, "float32") for k, v in t.items()}, "attn_mask": b64(mask, "bool"),
              **common}  # fmt: skip
    listed, encoded = post(client, V1, as_json), post(client, V1, as_b64)
    assert listed.status_code == encoded.status_code == 200, listed.text
    assert listed.json()["output"] == encoded.json()["output"]
    assert listed.json()["diagnostics"] == encoded.json()["diagnostics"]


def test_v1_tensor_objects_and_a_float_mask_with_nulls_answer_as_base64(
    client: httpx.Client,
) -> None:
    t = qkv(n=512)
    bias = RNG.standard_normal((1, 1, 512, 512)).round(3)
    hidden = RNG.random(bias.shape) > 0.8
    hidden[..., 0] = False
    with_nulls = np.where(hidden, None, bias).tolist()
    as_json = {k: {"dtype": "float16", "shape": list(v.shape), "data": v.tolist()}
               for k, v in t.items()}  # fmt: skip
    as_b64 = {k: b64(v, "float16") for k, v in t.items()}
    masked = np.where(hidden, -np.inf, bias).astype(np.float32)
    listed = post(client, V1, {**as_json, "attn_mask": with_nulls, "response_encoding": "json"})
    encoded = post(
        client, V1, {**as_b64, "attn_mask": b64(masked, "float32"), "response_encoding": "json"}
    )
    assert listed.status_code == encoded.status_code == 200, listed.text
    assert listed.json()["output"] == encoded.json()["output"]


def test_v1_analyze_of_json_lists_answers_as_base64(client: httpx.Client) -> None:
    t = qkv(n=384, d=128)
    listed = post(client, "/v1/analyze", {"q": t["q"].tolist(), "k": t["k"].tolist()})
    encoded = post(client, "/v1/analyze", {"q": b64(t["q"], "float32"),
                                           "k": b64(t["k"], "float32")})  # fmt: skip
    assert listed.status_code == encoded.status_code == 200, listed.text
    drop = ("meta",)
    assert {k: v for k, v in listed.json().items() if k not in drop} == {
        k: v for k, v in encoded.json().items() if k not in drop
    }


def test_v2_json_data_answers_as_binary_data(client: httpx.Client) -> None:
    t = qkv()
    shape = [1, 2, 1024, 32]
    as_json = {"inputs": [
        {"name": k, "datatype": "FP32", "shape": shape,
         "data": v.tolist() if k == "q" else v.reshape(-1).tolist()}  # nested, and flat
        for k, v in t.items()
    ]}  # fmt: skip
    header = {"inputs": [
        {"name": k, "datatype": "FP32", "shape": shape,
         "parameters": {"binary_data_size": v.nbytes}} for k, v in t.items()
    ]}  # fmt: skip
    head = json.dumps(header).encode()
    binary = head + b"".join(v.astype("<f4").tobytes() for v in t.values())
    listed = post(client, V2, as_json)
    sent = client.post(V2, content=binary, headers={
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(head)),
    })  # fmt: skip
    assert listed.status_code == sent.status_code == 200, listed.text
    assert listed.json()["outputs"] == sent.json()["outputs"]


def test_big_refusals_are_the_whole_parses(client: httpx.Client) -> None:
    rows = np.zeros((20_000, 8)).tolist()
    ragged = {"q": [*rows, [1.0]], "k": rows, "v": rows}
    answer = post(client, V1, ragged)
    assert answer.status_code == 422
    assert answer.json()["detail"] == ("q: ragged nested list: every row must have the same length")
    boolean = {"q": rows, "k": [*rows[:-1], [0.0] * 7 + [True]], "v": rows}
    answer = post(client, V1, boolean)
    assert answer.status_code == 422
    assert answer.json()["detail"] == "k: data must hold only numbers, found booleans"
    text = json.dumps({"q": rows, "k": rows, "v": rows}).encode()
    at = text.index(b",", len(text) // 2) + 1
    broken = text[:at] + b" 1e," + text[at:]  # an invalid number
    with pytest.raises(ValueError, match="invalid number") as raised:
        from_json(broken, allow_inf_nan=False)
    answer = client.post(V1, content=broken, headers=JSON)
    assert answer.status_code == 422
    assert answer.json()["detail"] == f"request body is not valid JSON: {raised.value}"


def test_an_envelope_of_too_many_values_is_refused_on_both_protocols(
    client: httpx.Client,
) -> None:
    strings = ['"x"'] * (MAX_ENVELOPE_VALUES + 1)
    body = ('{"q": [' + ", ".join(strings) + '], "k": [[1.0]], "v": [[1.0]]}').encode()
    body += b" " * (400 << 10)  # past what decodes on the loop
    answer = client.post(V1, content=body, headers=JSON)
    assert answer.status_code == 422
    (error,) = answer.json()["errors"]
    assert (error["loc"], error["type"]) == (["body"], "too_many_values")
    v2 = ('{"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": ['
          + ", ".join(strings) + "]}]}").encode() + b" " * (400 << 10)  # fmt: skip
    answer = client.post(V2, content=v2, headers=JSON)
    assert answer.status_code == 400
    assert "more than 16,384 values" in answer.json()["error"]
