"""Triton's own HTTP clients (tritonclient.http and tritonclient.http.aio, unchanged) against a
real `sdpa-service serve` on loopback, over the Open Inference Protocol (v2).

The truth is the float64 reference of tests/core/reference.py (tests.support.v2_cases). An API
key is configured: every call goes through auth (a tritonclient plugin adds the header), and
v2's health probes stay open without it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.test_v2_sdpa_client import per_head_mean
from tests.support.app import API_SERVER_ENV
from tests.support.live_server import LiveServer, live_server
from tests.support.v2_cases import (
    FLOAT_DATATYPES,
    Case,
    assert_close,
    expected,
    make_case,
    mask_cases,
)

http = pytest.importorskip("tritonclient.http")
aio = pytest.importorskip("tritonclient.http.aio")
utils = pytest.importorskip("tritonclient.utils")

pytestmark = pytest.mark.xdist_group("v2-tritonclient")

API_KEY = "v2-tritonclient-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PER_ROW = ("entropy", "max_weight", "effective_keys", "lse", "visible_keys")


class BearerKey:
    """A tritonclient plugin: every request carries the API key (tritonclient's own hook)."""

    def __call__(self, request: Any) -> None:
        request.headers.update(AUTH)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {**API_SERVER_ENV, "SDPA_API_KEYS": API_KEY}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("v2-triton")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[Any]:
    c = http.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60.0)
    c.register_plugin(BearerKey())
    yield c
    c.close()


def infer_inputs(case: Case, *, binary: bool) -> list[Any]:
    inputs = []
    for name, array, datatype in case.inputs():
        inp = http.InferInput(name, list(array.shape), datatype)
        # BF16 travels only as binary data (tritonclient refuses it as JSON, as we do).
        inp.set_data_from_numpy(array, binary_data=binary or datatype == "BF16")
        inputs.append(inp)
    return inputs


def infer(
    client: Any, case: Case, *, binary: bool = True, outputs: tuple[str, ...] = (), **kw: Any
) -> Any:
    requested = [http.InferRequestedOutput(name, binary_data=binary) for name in outputs]
    return client.infer(
        "attention",
        infer_inputs(case, binary=binary),
        outputs=requested or None,
        parameters=case.request_parameters() or None,
        **kw,
    )


# ---- metadata and health -------------------------------------------------------------------


def test_server_and_model_metadata(client: Any, server: LiveServer) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("attention")
    assert client.is_model_ready("attention", "1")
    meta = client.get_server_metadata()
    assert meta["name"] == "sdpa-service"
    assert "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("attention", "1")
    assert model["name"] == "attention"
    assert model["versions"] == ["1"]
    assert {t["name"] for t in model["inputs"]} == {
        "q", "k", "v", "key_lengths", "key_padding_mask", "attn_mask",
    }  # fmt: skip
    assert {"output", "weights", "lse", "visible_keys"} <= {t["name"] for t in model["outputs"]}
    # The probes need no key (orchestrators carry none); everything else does.
    assert httpx.get(f"{server.url}/v2/health/ready").json() == {"ready": True}
    assert httpx.get(f"{server.url}/v2/health/live").json() == {"live": True}
    refused = httpx.get(f"{server.url}/v2/models/attention")
    assert refused.status_code == 401
    assert "API key" in refused.json()["error"]
    assert not client.is_model_ready("other-model")


# ---- every datatype, binary and JSON -------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", FLOAT_DATATYPES)
def test_every_datatype(client: Any, datatype: str, binary: bool) -> None:
    case = make_case((2, 2, 5, 8), datatype=datatype, causal=True)
    # BF16 results come back as binary data only; the per-row statistics are FP32 or FP64.
    out_binary = binary or datatype == "BF16"
    requested = [
        http.InferRequestedOutput("output", binary_data=out_binary),
        http.InferRequestedOutput("lse", binary_data=binary),
    ]
    result = client.infer(
        "attention", infer_inputs(case, binary=binary), outputs=requested,
        parameters=case.request_parameters(),
    )  # fmt: skip
    want = expected(case)
    out = result.get_output("output")
    assert out["datatype"] == datatype
    assert ("parameters" in out) == out_binary  # binary_data_size, or a JSON list
    got = result.as_numpy("output")
    assert got.dtype == case.q.dtype
    assert_close(got, want.output, datatype)
    lse = result.as_numpy("lse")
    assert lse.dtype == (np.float64 if datatype == "FP64" else np.float32)
    np.testing.assert_allclose(lse, want.rows.lse, rtol=1e-4, atol=1e-3)


# ---- every mask option, GQA, fully masked rows ---------------------------------------------

MASK_CASES = mask_cases()
# JSON has no -inf: a float mask with -inf as JSON is test_minus_inf_as_null_in_a_json_float_mask.
_FLOAT_MASKS = {"attn_mask_float"}
MASK_PARAMS = [
    pytest.param(name, binary, id=f"{name}-{'binary' if binary else 'json'}")
    for name in sorted(MASK_CASES)
    for binary in (True, False)
    if binary or name not in _FLOAT_MASKS
]


@pytest.mark.parametrize(("name", "binary"), MASK_PARAMS)
def test_mask_options(client: Any, name: str, binary: bool) -> None:
    case = MASK_CASES[name]
    result = infer(client, case, binary=binary, outputs=("output", "weights", *PER_ROW))
    want = expected(case)
    assert_close(result.as_numpy("output"), want.output, "FP32")
    assert_close(result.as_numpy("weights"), want.weights, "FP32")
    np.testing.assert_array_equal(result.as_numpy("visible_keys"), want.rows.visible_keys)
    np.testing.assert_allclose(result.as_numpy("entropy"), want.rows.entropy, atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("max_weight"), want.rows.max_weight, atol=1e-5)
    lse = result.as_numpy("lse")
    masked = want.rows.visible_keys == 0
    if binary:  # -inf travels as itself in binary data
        assert np.isneginf(lse[masked]).all()
    else:  # and as null in JSON, which numpy reads as NaN
        assert np.isnan(lse[masked]).all()
    np.testing.assert_allclose(lse[~masked], want.rows.lse[~masked], rtol=1e-5, atol=1e-4)
    if name == "fully_masked":
        assert masked.sum() == 4 * 6
        assert not result.as_numpy("output")[1].any()


def test_minus_inf_as_null_in_a_json_float_mask(server: LiveServer) -> None:
    case = MASK_CASES["attn_mask_float"]
    assert case.attn_mask is not None
    mask = case.attn_mask
    body = {
        "inputs": [
            *({"name": n, "shape": list(a.shape), "datatype": "FP32", "data": a.ravel().tolist()}
              for n, a in (("q", case.q), ("k", case.k), ("v", case.v))),
            {"name": "attn_mask", "shape": list(mask.shape), "datatype": "FP32",
             "data": [None if np.isneginf(x) else float(x) for x in mask.ravel()]},
        ],
        "outputs": [{"name": "output"}],
    }  # fmt: skip
    response = httpx.post(f"{server.url}/v2/models/attention/infer", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    got = np.array(out["data"], dtype=np.float64).reshape(out["shape"])
    assert_close(got, expected(case).output, "FP32")


# ---- the output rule and the response parameters -------------------------------------------


def test_no_outputs_named_means_output_only(client: Any) -> None:
    case = make_case((1, 2, 4, 8))
    result = infer(client, case)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["output"]
    params = result.get_response()["parameters"]
    assert params["path"] == "fused"  # no weights, no diagnostics: the cheapest path ran
    assert {"device", "batch_size", "queue_ms", "compute_ms"} <= set(params)
    assert "entropy" not in params  # diagnostics default to none


def test_diagnostics_full_returns_every_row_statistic(client: Any) -> None:
    case = make_case((1, 2, 4, 8), parameters={"diagnostics": "full"})
    result = infer(client, case)
    names = [o["name"] for o in result.get_response()["outputs"]]
    assert names[0] == "output"
    assert "weights" not in names  # never the n^2 weights unless named
    assert set(names[1:]) >= {"entropy", "lse", "visible_keys", "sink_share"}
    assert result.get_output("visible_keys")["datatype"] == "INT64"


def test_summary_parameters(client: Any) -> None:
    case = make_case((2, 2, 6, 8), key_lengths=np.array([6, 0], dtype=np.int64),
                     parameters={"diagnostics": "summary"})  # fmt: skip
    result = infer(client, case)
    params = result.get_response()["parameters"]
    rows = expected(case).rows
    active = rows.visible_keys > 0
    assert params["masked_rows"] == int((~active).sum()) == 12
    assert params["entropy"] == pytest.approx(rows.entropy[active].mean(), abs=1e-5)
    assert params["max_weight"] == pytest.approx(rows.max_weight[active].mean(), abs=1e-5)
    assert params["grad_health"] == pytest.approx(rows.grad_health[active].mean(), abs=1e-5)
    assert params["path"] == "chunked"  # statistics without weights: O(N) memory


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_request_naming_only_a_per_head_statistic_gets_it_alone(
    client: Any, binary: bool
) -> None:
    """tritonclient asks for "entropy_per_head" alone (diagnostics summary): the answer holds
    that [B, H] FP32 tensor and no "output", equal to the float64 reference's mean row entropy
    per head (the second sequence sees no key: 0, and all its rows counted as masked)."""
    case = make_case((2, 3, 6, 8), (2, 3, 7, 8), key_lengths=np.array([5, 0], dtype=np.int64),
                     causal="bottom_right", parameters={"diagnostics": "summary"})  # fmt: skip
    result = infer(client, case, binary=binary, outputs=("entropy_per_head",))
    assert [o["name"] for o in result.get_response()["outputs"]] == ["entropy_per_head"]
    assert result.as_numpy("output") is None
    out = result.get_output("entropy_per_head")
    assert (out["datatype"], out["shape"]) == ("FP32", [2, 3])
    got = result.as_numpy("entropy_per_head")
    rows = expected(case).rows
    want = per_head_mean(rows.entropy, rows.visible_keys)
    assert not want[1].any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert result.get_response()["parameters"]["masked_rows"] == 3 * 6


def test_every_per_head_statistic_beside_the_output(client: Any) -> None:
    """The model's metadata lists a "<stat>_per_head" output for each per-head statistic;
    asked for together with the output, each comes back [B, H] (masked_rows INT64)."""
    listed = [o["name"] for o in client.get_model_metadata("attention")["outputs"]]
    per_head = tuple(name for name in listed if name.endswith("_per_head"))
    assert {"entropy_per_head", "max_weight_per_head", "masked_rows_per_head"} <= set(per_head)
    case = make_case((1, 2, 4, 8), causal=True, parameters={"diagnostics": "full"})
    result = infer(client, case, outputs=("output", *per_head))
    names = [o["name"] for o in result.get_response()["outputs"]]
    assert names == ["output", *per_head]
    want = expected(case)
    assert_close(result.as_numpy("output"), want.output, "FP32")
    for name in per_head:
        assert result.as_numpy(name).shape == (1, 2), name
    assert result.as_numpy("masked_rows_per_head").dtype == np.int64
    np.testing.assert_allclose(
        result.as_numpy("max_weight_per_head"),
        per_head_mean(want.rows.max_weight, want.rows.visible_keys),
        rtol=1e-5,
    )


def test_a_per_head_statistic_without_the_summary_is_refused(client: Any) -> None:
    with pytest.raises(utils.InferenceServerException) as info:
        infer(client, make_case((1, 2, 4, 8)), outputs=("entropy_per_head",))
    assert info.value.status() == "400"
    assert "output 'entropy_per_head'" in info.value.message()
    assert "parameter 'diagnostics'" in info.value.message()


def test_request_id_timeout_priority_and_compression(client: Any) -> None:
    case = make_case((1, 2, 4, 8), causal="bottom_right")
    want = expected(case).output
    for algorithm in (None, "gzip", "deflate"):
        result = infer(
            client, case, request_id=f"req-{algorithm}", timeout=5_000_000, priority=1,
            request_compression_algorithm=algorithm,
        )  # fmt: skip
        assert result.get_response()["id"] == f"req-{algorithm}"
        assert_close(result.as_numpy("output"), want, "FP32")


# ---- bad requests --------------------------------------------------------------------------


def _v2_infer_json(q_shape: tuple[int, ...] = (1, 1, 2, 2), **extra: Any) -> dict[str, Any]:
    n = int(np.prod(q_shape))
    inputs = [
        {"name": name, "shape": list(q_shape), "datatype": "FP32", "data": [0.5] * n}
        for name in ("q", "k", "v")
    ]
    return {"inputs": inputs, **extra}


def _assert_error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    for word in words:
        assert word in body["error"], body


def test_bad_requests_through_tritonclient(client: Any) -> None:
    good = make_case((1, 2, 4, 8))
    bad: list[tuple[Case, dict[str, Any], tuple[str, ...]]] = [
        (make_case((1, 2, 4, 8), (1, 2, 4, 4)), {}, ("input 'k'", "head dim")),
        (make_case((1, 3, 4, 8), (1, 2, 4, 8)), {}, ("input 'k'",)),
        (good, {"parameters": {"casual": True}}, ("unknown parameter 'casual'", "'causal'")),
        (good, {"parameters": {"causal": "diagonal"}}, ("parameter 'causal'",)),
        (good, {"parameters": {"scale": 0.1, "temperature": 2.0}}, ("'temperature'",)),
        (good, {"parameters": {"temperature": -1.0}}, ("parameter 'temperature'",)),
        (good, {"parameters": {"diagnostics": "all"}}, ("parameter 'diagnostics'",)),
        (good, {"parameters": {"tag": "bad tag!"}}, ("parameter 'tag'",)),
        (make_case((1, 2, 4, 8), key_lengths=np.array([9], dtype=np.int64)), {},
         ("input 'key_lengths'",)),
    ]  # fmt: skip
    for case, kw, words in bad:
        with pytest.raises(utils.InferenceServerException) as info:
            client.infer(
                "attention", infer_inputs(case, binary=True),
                parameters={**case.request_parameters(), **kw.get("parameters", {})},
            )  # fmt: skip
        assert info.value.status() == "400", info.value.message()
        for word in words:
            assert word in info.value.message(), info.value.message()
    # A NaN in q names q.
    nan_case = make_case((1, 2, 4, 8))
    nan_case.q[0, 0, 0, 0] = np.nan
    with pytest.raises(utils.InferenceServerException) as info:
        infer(client, nan_case)
    assert info.value.status() == "400"
    assert "input 'q'" in info.value.message()
    # An unknown output name.
    with pytest.raises(utils.InferenceServerException) as info:
        infer(client, good, outputs=("attention_probs",))
    assert "unknown output 'attention_probs'" in info.value.message()
    # An input the model does not take.
    extra = http.InferInput("mask", [1, 4], "BOOL")
    extra.set_data_from_numpy(np.ones((1, 4), dtype=np.bool_))
    with pytest.raises(utils.InferenceServerException) as info:
        client.infer("attention", [*infer_inputs(good, binary=True), extra])
    assert "unknown input 'mask'" in info.value.message()
    # A deadline that has passed before the request is queued: 504.
    with pytest.raises(utils.InferenceServerException) as info:
        infer(client, good, timeout=1)
    assert info.value.status() == "504"
    # ...and the server still serves.
    assert_close(infer(client, good).as_numpy("output"), expected(good).output, "FP32")


def test_bad_requests_on_the_wire(server: LiveServer) -> None:
    url = f"{server.url}/v2/models/attention/infer"
    post = httpx.Client(headers=AUTH, timeout=30.0)
    # Not JSON.
    _assert_error(post.post(url, content=b"{not json"), 400, "not valid JSON")
    # A missing input.
    body = _v2_infer_json()
    body["inputs"] = body["inputs"][:2]
    _assert_error(post.post(url, json=body), 400, "input 'v' is required")
    # A datatype an input does not take.
    body = _v2_infer_json()
    body["inputs"].append(
        {"name": "key_padding_mask", "shape": [1, 2], "datatype": "FP32", "data": [0.0, 1.0]}
    )
    _assert_error(post.post(url, json=body), 400, "input 'key_padding_mask'", "BOOL")
    # BF16 as JSON.
    body = _v2_infer_json()
    body["inputs"][0]["datatype"] = "BF16"
    _assert_error(post.post(url, json=body), 400, "input 'q'", "binary data")
    # Data that does not fill the shape; ragged data.
    body = _v2_infer_json()
    body["inputs"][1]["data"] = [0.5] * 3
    _assert_error(post.post(url, json=body), 400, "input 'k'", "needs 4")
    body["inputs"][1]["data"] = [[0.5, 0.5], [0.5]]
    _assert_error(post.post(url, json=body), 400, "input 'k'", "ragged")
    # binary_data_size that disagrees with the shape, or with the body.
    header = _v2_infer_json()
    header["inputs"][2] = {"name": "v", "shape": [1, 1, 2, 2], "datatype": "FP32",
                           "parameters": {"binary_data_size": 12}}  # fmt: skip
    raw = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(raw))}
    _assert_error(post.post(url, content=raw + bytes(12), headers=headers), 400, "input 'v'", "16")
    header["inputs"][2]["parameters"]["binary_data_size"] = 16
    raw = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(raw))}
    _assert_error(post.post(url, content=raw + bytes(8), headers=headers), 400, "input 'v'")
    _assert_error(post.post(url, content=raw + bytes(20), headers=headers), 400, "4 bytes")
    bad_length = {"Inference-Header-Content-Length": "999999"}
    _assert_error(post.post(url, content=raw, headers=bad_length), 400,
                  "Inference-Header-Content-Length")  # fmt: skip
    # Over the element limit (SDPA_MAX_ELEMENTS = 65536 here): refused before decoding.
    body = _v2_infer_json()
    body["inputs"][0]["shape"] = [1, 1, 1024, 128]
    _assert_error(post.post(url, json=body), 400, "input 'q'", "SDPA_MAX_ELEMENTS")
    # A body over SDPA_MAX_BODY_BYTES (1 MiB here): 413, and a gzip bomb counts inflated.
    _assert_error(post.post(url, content=b" " * (2 << 20)), 413, "SDPA_MAX_BODY_BYTES")
    bomb = gzip.compress(b" " * (64 << 20))
    assert len(bomb) < 100_000
    _assert_error(
        post.post(url, content=bomb, headers={"Content-Encoding": "gzip"}), 413,
        "SDPA_MAX_BODY_BYTES",
    )  # fmt: skip
    _assert_error(
        post.post(url, content=b"\x1f\x8bnot gzip", headers={"Content-Encoding": "gzip"}),
        400, "gzip",
    )  # fmt: skip
    truncated = zlib.compress(json.dumps(_v2_infer_json()).encode())[:-6]
    _assert_error(
        post.post(url, content=truncated, headers={"Content-Encoding": "deflate"}), 400, "ends"
    )
    _assert_error(post.post(url, content=b"{}", headers={"Content-Encoding": "br"}), 400, "br")
    # An unknown model: 404, still {"error"}.
    _assert_error(post.post(f"{server.url}/v2/models/bert/infer", json=_v2_infer_json()), 404,
                  "'attention'")  # fmt: skip
    # ...and the server still serves.
    ok = post.post(url, json=_v2_infer_json())
    assert ok.status_code == 200, ok.text
    np.testing.assert_allclose(ok.json()["outputs"][0]["data"], [0.5] * 4)


# ---- many at once through the async client -------------------------------------------------


def test_200_concurrent_mixed_length_requests_async(server: LiveServer) -> None:
    rng = np.random.default_rng(2026)
    cases = []
    for i in range(200):
        n_q, n_kv = (int(x) for x in rng.integers(1, 17, size=2))
        options: dict[str, Any] = {}
        if i % 3 == 0:
            options["causal"] = "bottom_right"
        if i % 5 == 0:
            options["key_lengths"] = np.array([int(rng.integers(0, n_kv + 1))], dtype=np.int64)
        cases.append(make_case((1, 2, n_q, 8), (1, 2, n_kv, 8), seed=i, **options))

    async def run_all() -> list[Any]:
        client = aio.InferenceServerClient(server.url.removeprefix("http://"), conn_limit=200)
        client.register_plugin(BearerKey())
        try:

            async def one(i: int, case: Case) -> Any:
                inputs = infer_inputs(case, binary=i % 2 == 0)
                return await client.infer(
                    "attention", inputs, parameters=case.request_parameters() or None
                )

            return await asyncio.wait_for(
                asyncio.gather(*(one(i, c) for i, c in enumerate(cases))), timeout=120
            )
        finally:
            await client.close()

    results = asyncio.run(run_all())
    for case, result in zip(cases, results, strict=True):
        assert_close(result.as_numpy("output"), expected(case).output, "FP32")
    batch_sizes = [r.get_response()["parameters"]["batch_size"] for r in results]
    assert max(batch_sizes) > 1  # they shared batches: the one serving layer batched them
