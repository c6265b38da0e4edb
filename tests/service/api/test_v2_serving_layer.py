"""v2 is a second door to v1's serving layer (in process): its requests are counted under their
own route label (a client leaving mid-body is a 499 there), the shared limits refuse them with
v2's {"error"} body, the parameters reach the computation (temperature, causal), and the JSON
form of every output reads back as the binary form's values."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import httpx
import numpy as np

from tests.service.api.test_client_leaves import leave_mid_body
from tests.support.app import in_process_client, small_settings

URL = "/v2/models/attention/infer"
RNG = np.random.default_rng(5)
Q, K, V = (RNG.standard_normal((1, 2, 4, 8)).astype(np.float32) for _ in range(3))


def _body(**extra: Any) -> dict[str, Any]:
    inputs = [
        {"name": n, "shape": list(a.shape), "datatype": "FP32", "data": a.ravel().tolist()}
        for n, a in (("q", Q), ("k", K), ("v", V))
    ]
    return {"inputs": inputs, **extra}


def _output(response: httpx.Response, name: str) -> np.ndarray:
    for out in response.json()["outputs"]:
        if out["name"] == name:
            return np.array(out["data"], dtype=np.float64).reshape(out["shape"])
    raise AssertionError(f"no output {name!r}")


def _reference(scale: float, causal: bool) -> np.ndarray:
    s = np.einsum("bhqd,bhkd->bhqk", Q.astype(np.float64), K.astype(np.float64)) * scale
    if causal:
        s = np.where(np.tril(np.ones((4, 4), dtype=bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", w, V.astype(np.float64))


def _sample(metrics_text: str, route: str, status: str) -> float:
    pattern = (
        rf'^sdpa_requests_total\{{(?=[^}}]*route="{re.escape(route)}")'
        rf'(?=[^}}]*status="{status}")[^}}]*\}} (\S+)$'
    )
    found = re.findall(pattern, metrics_text, flags=re.MULTILINE)
    return sum(float(x) for x in found)


def test_parameters_reach_the_computation(client: httpx.Client) -> None:
    for params, scale, causal in (
        ({"temperature": 2.0}, 1 / (2.0 * math.sqrt(8)), False),
        ({"scale": 0.3, "causal": True}, 0.3, True),
        ({"causal": "top_left"}, 1 / math.sqrt(8), True),
    ):
        response = client.post(URL, json=_body(parameters=params))
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(
            _output(response, "output"), _reference(scale, causal), atol=1e-5
        )


def test_requests_are_counted_under_the_v2_route(client: httpx.Client) -> None:
    before = client.get("/metrics").text
    assert client.post(URL, json=_body()).status_code == 200
    assert client.post(URL, json=_body(parameters={"casual": True})).status_code == 400
    after = client.get("/metrics").text
    for status in ("200", "400"):
        grew = _sample(after, URL, status) - _sample(before, URL, status)
        assert grew == 1, status
    assert _sample(after, "/v1/attention", "200") == _sample(before, "/v1/attention", "200")


def test_binary_and_json_outputs_agree(client: httpx.Client) -> None:
    names = ["output", "weights", "lse", "visible_keys"]
    plain = client.post(URL, json=_body(outputs=[{"name": n} for n in names]))
    assert plain.status_code == 200
    packed = client.post(
        URL,
        json=_body(outputs=[{"name": n, "parameters": {"binary_data": True}} for n in names]),
    )
    assert packed.status_code == 200
    length = int(packed.headers["inference-header-content-length"])
    header = json.loads(packed.content[:length])
    offset = length
    dtypes = {"FP32": "<f4", "INT64": "<i8"}
    for out in header["outputs"]:
        size = out["parameters"]["binary_data_size"]
        dtype = np.dtype(dtypes[out["datatype"]])
        raw = packed.content[offset : offset + size]
        got = np.frombuffer(raw, dtype=dtype).reshape(out["shape"])
        offset += size
        # JSON writes each float32 in its shortest form: read back as float32, the same bits.
        np.testing.assert_array_equal(got, _output(plain, out["name"]).astype(got.dtype))
    assert offset == len(packed.content)


def test_the_in_flight_limit_answers_in_v2_words() -> None:
    settings = small_settings(max_inflight_bytes=4096)
    with in_process_client(settings) as client:
        response = client.post(URL, json=_body(outputs=[{"name": "weights"}]))
        assert response.status_code == 400, response.text
        assert set(response.json()) == {"error"}
        assert "SDPA_MAX_INFLIGHT_BYTES" in response.json()["error"]
        v1 = client.post("/v1/attention", json={"q": Q.tolist(), "k": K.tolist(), "v": V.tolist()})
        assert v1.status_code == 422  # the same limit, in v1's words
        assert v1.headers["content-type"] == "application/problem+json"


def test_a_v2_client_leaving_mid_body_is_a_499() -> None:
    sent, counted = leave_mid_body(URL)
    start = next(m for m in sent if m.get("type") == "http.response.start")
    assert start["status"] == 499
    assert counted == {(URL, "499"): 1.0}


def test_a_binary_answer_is_sized_as_the_bytes_it_sends() -> None:
    """q = k = v [1, 1, 64, 64] FP32 with the weights: a binary answer carries 64·64·4 bytes
    of output and as many of weights, plus the JSON header (4,096 bytes estimated): 36,864
    bytes. Under a 40,000-byte response limit it is served; the same answer as JSON lists
    (16 bytes a number) is refused, naming the limit."""
    from sdpa_client.v2 import build_infer_request

    x = np.random.default_rng(0).standard_normal((1, 1, 64, 64)).astype(np.float32)
    url = "/v2/models/attention/infer"
    with in_process_client(small_settings(max_response_bytes=40_000)) as client:
        for binary, expected in ((True, 200), (False, 400)):
            body, headers = build_infer_request(
                x, x, x, return_weights=True, diagnostics="none", binary=binary
            )
            response = client.post(url, content=body, headers=headers)
            assert response.status_code == expected, response.text[:300]
            if expected == 400:
                assert "SDPA_MAX_RESPONSE_BYTES" in response.json()["error"]


def test_json_infinity_literals_as_tritonclient_writes_them() -> None:
    """tritonclient's JSON path writes a float mask's -inf as -Infinity (Python's json module):
    it means not visible, as null does. NaN in q is refused naming q, and +Infinity in a mask
    naming the mask."""
    url = "/v2/models/attention/infer"

    def body(q: str, mask: str) -> bytes:
        def tensor(name: str, data: str) -> str:
            return f'{{"name": "{name}", "shape": [2, 2], "datatype": "FP32", "data": {data}}}'

        inputs = [tensor("q", q), tensor("k", "[1, 0, 0, 1]"), tensor("v", "[1, 2, 3, 4]")]
        inputs.append(tensor("attn_mask", mask))
        return ('{"inputs": [' + ", ".join(inputs) + "]}").encode()

    with in_process_client(small_settings()) as client:
        literal = client.post(url, content=body("[1, 0, 0, 1]", "[0, -Infinity, 0, 0]"))
        null = client.post(url, content=body("[1, 0, 0, 1]", "[0, null, 0, 0]"))
        assert literal.status_code == null.status_code == 200, literal.text
        assert literal.json()["outputs"] == null.json()["outputs"]
        # Row 0 sees only key 0: its output is v's row 0 exactly.
        assert literal.json()["outputs"][0]["data"][:2] == [1.0, 2.0]
        nan = client.post(url, content=body("[NaN, 0, 0, 1]", "[0, 0, 0, 0]"))
        assert nan.status_code == 400
        assert nan.json()["error"].startswith("input 'q': contains NaN or Inf")
        plus = client.post(url, content=body("[1, 0, 0, 1]", "[0, Infinity, 0, 0]"))
        assert plus.status_code == 400
        assert plus.json()["error"].startswith("input 'attn_mask':")
