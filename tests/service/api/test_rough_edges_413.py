"""A 413 fits what was sent (issue 29): its advice matches the body's encoding (v1 JSON lists,
v1 base64, v2 JSON, v2 binary), and it is counted and logged under its route, never
"unmatched", however it was refused (Content-Length, a streamed body, a gzip body, either v2
path)."""

from __future__ import annotations

import base64
import gzip
import json
import logging
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from service.middleware.body_limit import (
    ADVICE_V1_BASE64,
    ADVICE_V1_LISTS,
    ADVICE_V1_UNKNOWN,
    ADVICE_V2_BINARY,
    ADVICE_V2_JSON,
)
from tests.support.app import API_SERVER_ENV, requests_total

LIMIT = int(API_SERVER_ENV["SDPA_MAX_BODY_BYTES"])
JSON = {"content-type": "application/json"}
# Enough elements that every encoding passes the 1 MiB limit of the test app.
N = 400_000


def _lists_body() -> bytes:
    values = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    q = values.reshape(1, 1000, 400).tolist()
    return json.dumps({"q": q, "k": q, "v": q}).encode()


def _b64_body() -> bytes:
    raw = np.zeros(N, dtype=np.float32).tobytes()
    tensor = {"dtype": "float32", "shape": [1, 1000, 400], "b64": base64.b64encode(raw).decode()}
    return json.dumps({"q": tensor, "k": tensor, "v": tensor}).encode()


def _chunks(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    # A generator body: httpx sends it without a Content-Length, so the middleware counts it.
    for i in range(0, len(body), size):
        yield body[i : i + size]


def _detail(response: httpx.Response) -> str:
    assert response.status_code == 413, response.text[:300]
    payload = response.json()
    return str(payload.get("detail") or payload.get("error"))


def test_a_streamed_v1_body_of_json_lists_is_told_to_use_base64(client: httpx.Client) -> None:
    detail = _detail(client.post("/v1/attention", content=_chunks(_lists_body()), headers=JSON))
    assert detail.endswith(ADVICE_V1_LISTS)
    assert "base64" in detail
    assert f"{LIMIT} bytes" in detail


def test_a_streamed_v1_base64_body_is_not_told_to_use_base64(client: httpx.Client) -> None:
    detail = _detail(client.post("/v1/attention", content=_chunks(_b64_body()), headers=JSON))
    assert detail.endswith(ADVICE_V1_BASE64)
    assert "instead of JSON lists" not in detail
    assert "split it into smaller requests" in detail


def test_a_declared_v1_body_names_both_cases(client: httpx.Client) -> None:
    # Refused on its Content-Length alone: no byte of it is read, so its encoding is unknown.
    detail = _detail(client.post("/v1/attention", content=_b64_body(), headers=JSON))
    assert detail.endswith(ADVICE_V1_UNKNOWN)


def test_a_v2_json_body_is_told_to_use_binary_data(client: httpx.Client) -> None:
    body = json.dumps(
        {"inputs": [{"name": "q", "shape": [N], "datatype": "FP32", "data": [0.5] * N}]}
    ).encode()
    detail = _detail(client.post("/v2/models/attention/infer", content=body, headers=JSON))
    assert detail.endswith(ADVICE_V2_JSON)


def test_a_v2_binary_body_is_told_to_split(client: httpx.Client) -> None:
    header = json.dumps(
        {"inputs": [{"name": "q", "shape": [N], "datatype": "FP32",
                     "parameters": {"binary_data_size": 4 * N}}]}
    ).encode()  # fmt: skip
    body = header + np.zeros(N, dtype=np.float32).tobytes()
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
    detail = _detail(client.post("/v2/models/attention/infer", content=body, headers=headers))
    assert detail.endswith(ADVICE_V2_BINARY)
    assert "binary data (" not in detail  # not told to switch to what it sent


def test_every_kind_of_413_is_counted_and_logged_under_its_route(
    client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    big = b"[" + b"0," * LIMIT + b"0]"
    binary = {"content-type": "application/octet-stream", "inference-header-content-length": "2"}
    sent = [
        ("/v1/attention", big, JSON),  # declared length
        ("/v1/analyze", _chunks(big), JSON),  # streamed, counted chunk by chunk
        ("/v1/attention", gzip.compress(big), {**JSON, "content-encoding": "gzip"}),  # inflated
        ("/v2/models/attention/infer", big, binary),
        ("/v2/models/attention/versions/1/infer", _chunks(big), JSON),
    ]
    before = requests_total(client.get("/metrics").text)
    with caplog.at_level(logging.INFO, logger="sdpa.access"):
        for path, content, headers in sent:
            assert client.post(path, content=content, headers=headers).status_code == 413, path
    after = requests_total(client.get("/metrics").text)
    routes = [
        r.json_fields["route"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "sdpa.access" and r.json_fields["status"] == 413  # type: ignore[attr-defined]
    ]
    assert routes == [path for path, _, _ in sent]
    grown = {label: after[label] - before.get(label, 0.0) for label in after}
    assert grown[("/v1/attention", "413")] == 2
    assert grown[("/v1/analyze", "413")] == 1
    assert grown[("/v2/models/attention/infer", "413")] == 1
    assert grown[("/v2/models/attention/versions/1/infer", "413")] == 1
    assert grown.get(("unmatched", "413"), 0.0) == 0
