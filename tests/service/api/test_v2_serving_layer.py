"""v2 is a second door to v1's serving layer (in process): its requests are counted under their
own route label (a client leaving mid-body is a 499 there), the shared limits refuse them with
v2's {"error"} body, the parameters reach the computation (temperature, causal), the JSON
form of every output reads back as the binary form's values, and the outputs are those named:
without "output" none, and the per-head statistics ("<stat>_per_head") equal v1's."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import httpx
import numpy as np
import pytest

from sdpa_core import PER_HEAD_FIELDS, PER_ROW_FIELDS
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


# ---- the outputs a request names: no output, per-head statistics --------------------------


def _outputs(response: httpx.Response) -> dict[str, dict[str, Any]]:
    """The answer's outputs by name, binary data read back into "array"."""
    length = response.headers.get("inference-header-content-length")
    header = json.loads(response.content if length is None else response.content[: int(length)])
    offset = len(response.content) if length is None else int(length)
    dtypes = {"FP32": "<f4", "FP64": "<f8", "INT64": "<i8"}
    found = {}
    for out in header["outputs"]:
        dtype = np.dtype(dtypes[out["datatype"]])
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is None:
            array = np.array(out["data"], dtype=dtype).reshape(out["shape"])
        else:
            array = np.frombuffer(response.content[offset : offset + size], dtype=dtype)
            array = array.reshape(out["shape"])
            offset += size
        found[out["name"]] = {**out, "array": array}
    assert offset == len(response.content)
    return found


PER_HEAD_OUTPUTS = [f"{name}_per_head" for name in PER_HEAD_FIELDS]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("diagnostics", ["summary", "full"])
@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
def test_per_head_outputs_are_v1_s_per_head_statistics(
    client: httpx.Client, datatype: str, diagnostics: str, binary: bool
) -> None:
    """Every "<stat>_per_head" output, named without "output": [B, H] in the accumulation
    dtype (FP32; FP64 for FP64 inputs), masked_rows INT64, equal to v1's diagnostics.per_head
    for the same request (float64 numbers in JSON) to the wire dtype's rounding."""
    dtype = {"FP32": np.float32, "FP64": np.float64}[datatype]
    rng = np.random.default_rng(17)
    q = rng.standard_normal((2, 3, 5, 8)).astype(dtype)
    k, v = (rng.standard_normal((2, 3, 6, 8)).astype(dtype) for _ in range(2))
    inputs = [
        {"name": n, "shape": list(a.shape), "datatype": datatype, "data": a.ravel().tolist()}
        for n, a in (("q", q), ("k", k), ("v", v))
    ]
    inputs.append({"name": "key_lengths", "shape": [2], "datatype": "INT64", "data": [6, 0]})
    requested = [{"name": n, "parameters": {"binary_data": binary}} for n in PER_HEAD_OUTPUTS]
    body = {"inputs": inputs, "outputs": requested, "parameters": {"diagnostics": diagnostics}}
    response = client.post(URL, json=body)
    assert response.status_code == 200, response.text
    v1 = client.post("/v1/attention", json={
        "q": {"dtype": dtype.__name__, "data": q.tolist()},
        "k": {"dtype": dtype.__name__, "data": k.tolist()},
        "v": {"dtype": dtype.__name__, "data": v.tolist()},
        "key_lengths": [6, 0], "diagnostics": diagnostics, "return_output": False,
    })  # fmt: skip
    assert v1.status_code == 200, v1.text
    per_head = v1.json()["diagnostics"]["per_head"]
    outputs = _outputs(response)
    assert list(outputs) == PER_HEAD_OUTPUTS  # in the order named, and nothing else
    float_datatype = datatype
    for name, stat in zip(PER_HEAD_OUTPUTS, PER_HEAD_FIELDS, strict=True):
        out = outputs[name]
        assert out["shape"] == [2, 3], name
        assert ("parameters" in out) == binary
        want = np.array(per_head[stat], dtype=np.float64)
        if stat == "masked_rows":
            assert out["datatype"] == "INT64"
            np.testing.assert_array_equal(out["array"], want)
            np.testing.assert_array_equal(out["array"], [[0, 0, 0], [5, 5, 5]])
        else:
            assert out["datatype"] == float_datatype, name
            # v1 writes the float64 statistic; v2 rounds it once to its datatype.
            np.testing.assert_array_equal(out["array"], want.astype(dtype), err_msg=name)


def test_per_head_entropy_of_a_hand_made_case(client: httpx.Client) -> None:
    """One sequence, two heads, causal (top left): query 0 sees key 0 alone, query 1 keys 0 and
    1. Each head's entropy is the mean over its rows of -sum p log p, written here in float64
    numpy: row 0 has p = [1] (entropy 0), row 1 the softmax of its two scaled scores."""
    q = np.array([[[[1.0, 0.0], [0.0, 2.0]], [[0.5, 0.5], [1.0, -1.0]]]])  # [1, 2, 2, 2]
    k = np.array([[[[1.0, 1.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 0.5]]]])
    v = np.ones((1, 2, 2, 2))
    inputs = [
        {"name": n, "shape": [1, 2, 2, 2], "datatype": "FP64", "data": a.ravel().tolist()}
        for n, a in (("q", q), ("k", k), ("v", v))
    ]
    names = ["entropy_per_head", "max_weight_per_head", "masked_rows_per_head"]
    body = {
        "inputs": inputs,
        "outputs": [{"name": n} for n in names],
        "parameters": {"diagnostics": "summary", "causal": True},
    }
    response = client.post(URL, json=body)
    assert response.status_code == 200, response.text
    outputs = _outputs(response)
    scale = 1 / math.sqrt(2)
    entropy, max_weight = [], []
    for h in range(2):
        s = np.array([q[0, h, 1] @ k[0, h, 0], q[0, h, 1] @ k[0, h, 1]]) * scale
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        entropy.append((0.0 + float(-(p * np.log(p)).sum())) / 2)
        max_weight.append((1.0 + float(p.max())) / 2)
    assert outputs["entropy_per_head"]["datatype"] == "FP64"
    np.testing.assert_allclose(outputs["entropy_per_head"]["array"], [entropy], rtol=1e-12)
    np.testing.assert_allclose(outputs["max_weight_per_head"]["array"], [max_weight], rtol=1e-12)
    np.testing.assert_array_equal(outputs["masked_rows_per_head"]["array"], [[0, 0]])


def test_outputs_that_do_not_name_output_leave_it_out(client: httpx.Client) -> None:
    for names, diagnostics in (
        (["weights"], "none"),
        (["lse", "entropy_per_head"], "summary"),
        (["masked_rows_per_head"], "full"),
    ):
        body = _body(outputs=[{"name": n} for n in names], parameters={"diagnostics": diagnostics})
        response = client.post(URL, json=body)
        assert response.status_code == 200, response.text
        assert [out["name"] for out in response.json()["outputs"]] == names
    # No outputs list: the output (and the per-row statistics with "full"), as before.
    plain = client.post(URL, json=_body(parameters={"diagnostics": "full"})).json()
    assert [out["name"] for out in plain["outputs"]] == ["output", *PER_ROW_FIELDS]
    # Every output at once, each named once: the request's list has room for them all.
    every = [{"name": n} for n in ("output", "weights", *PER_ROW_FIELDS, *PER_HEAD_OUTPUTS)]
    response = client.post(URL, json=_body(outputs=every, parameters={"diagnostics": "full"}))
    assert response.status_code == 200, response.text
    assert [out["name"] for out in response.json()["outputs"]] == [o["name"] for o in every]


def test_a_per_head_output_needs_the_summary(client: httpx.Client) -> None:
    for parameters in ({}, {"diagnostics": "none"}):
        body = _body(outputs=[{"name": "sink_share_per_head"}], parameters=parameters)
        response = client.post(URL, json=body)
        assert response.status_code == 400, response.text
        (message,) = response.json().values()
        assert "output 'sink_share_per_head'" in message
        assert "parameter 'diagnostics'" in message
        assert '"summary" or "full"' in message
    response = client.post(URL, json=_body(outputs=[{"name": "entropy_by_head"}]))
    assert response.status_code == 400
    message = response.json()["error"]
    assert message.startswith("unknown output 'entropy_by_head'")
    assert "<stat>_per_head" in message


def test_the_model_metadata_lists_every_per_head_output(client: httpx.Client) -> None:
    outputs = {o["name"]: o for o in client.get("/v2/models/attention").json()["outputs"]}
    for name, stat in zip(PER_HEAD_OUTPUTS, PER_HEAD_FIELDS, strict=True):
        assert outputs[name]["shape"] == [-1, -1]
        assert outputs[name]["datatype"] == ("INT64" if stat == "masked_rows" else "FP32")


def test_an_output_not_named_is_not_sized() -> None:
    """q = k = v [1, 1, 64, 64] FP32, answered as JSON lists: the output alone is 4,096 numbers
    of up to 16 bytes, over a 64 KiB response limit with the 4 KiB envelope; the same request
    naming only a per-head statistic is served."""
    x = np.random.default_rng(1).standard_normal((1, 1, 64, 64)).astype(np.float32)
    inputs = [
        {"name": n, "shape": [1, 1, 64, 64], "datatype": "FP32", "data": x.ravel().tolist()}
        for n in ("q", "k", "v")
    ]
    params = {"diagnostics": "summary"}
    with in_process_client(small_settings(max_response_bytes=64 * 1024)) as client:
        whole = client.post(URL, json={"inputs": inputs, "parameters": params})
        assert whole.status_code == 400, whole.text[:300]
        assert "SDPA_MAX_RESPONSE_BYTES" in whole.json()["error"]
        outputs = [{"name": "entropy_per_head"}]
        bare = client.post(URL, json={"inputs": inputs, "outputs": outputs, "parameters": params})
        assert bare.status_code == 200, bare.text[:300]
        assert [out["name"] for out in bare.json()["outputs"]] == ["entropy_per_head"]
