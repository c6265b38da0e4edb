"""create_app in process (starlette's TestClient runs the lifespan): the error mapping that a
well-behaved server never shows over HTTP — our own bug must be a generic 500 — and the
middleware order with API keys on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from service.app import create_app
from service.errors import QueueFull
from service.runtime.engine import Engine
from service.settings import Settings
from tests.support.app import in_process_client, ready_engine, requests_total, small_settings


def _boom() -> None:
    raise RuntimeError("secret internal detail /etc/passwd")


def _full() -> None:
    raise QueueFull("the queue is full", retry_after_s=2.5)


@pytest.fixture(scope="module")
def app() -> FastAPI:
    # No statistics kernel compiled and the cost model measured once per process: none of
    # this module's tests is about the warm-up.
    settings = Settings(
        device="cpu", api_keys=(SecretStr("k1"),), max_body_bytes=2048, compile_kernels=False
    )
    app = create_app(settings, engine=ready_engine(settings))
    # Routes that fail the way only a bug (or the batcher) can, added for this test only.
    app.add_api_route("/test/boom", _boom, methods=["GET"])
    app.add_api_route("/test/full", _full, methods=["GET"])
    return app


@pytest.fixture(scope="module")
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


KEY = {"Authorization": "Bearer k1"}


def test_an_unhandled_error_is_a_generic_500(client: TestClient) -> None:
    response = client.get("/test/boom", headers=KEY)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == 500
    assert "secret" not in response.text
    assert "Traceback" not in response.text
    assert problem["detail"].startswith("internal server error")


def test_a_500_carries_the_request_id_it_names(client: TestClient) -> None:
    response = client.get("/test/boom", headers={**KEY, "X-Request-ID": "trace-me-42"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "trace-me-42"
    assert response.json()["detail"] == "internal server error; request id trace-me-42"


def test_service_errors_keep_their_status_and_headers(client: TestClient) -> None:
    response = client.get("/test/full", headers=KEY)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "3"  # whole seconds, rounded up
    assert response.json()["title"] == "Queue full"


def test_auth_runs_before_the_body_limit(client: TestClient) -> None:
    # Without a key the caller learns nothing else, not even that its body is too large.
    big = b"{" + b" " * 4096 + b"}"
    headers = {"content-type": "application/json"}
    assert client.post("/v1/attention", content=big, headers=headers).status_code == 401
    assert client.post("/v1/attention", content=big, headers={**headers, **KEY}).status_code == 413
    assert client.get("/healthz").status_code == 200  # open path


def test_refusals_before_routing_are_labelled_with_their_route(client: TestClient) -> None:
    # Every operation of the OpenAPI document that needs a key, refused for the lack of one
    # (the route never runs), is counted under its own template, not "unmatched".
    doc = client.get("/openapi.json", headers=KEY).json()
    operations = [
        (path, method)
        for path, item in doc["paths"].items()
        for method, operation in item.items()
        if operation.get("security") != [] and "{" not in path
    ]
    assert ("/v1/attention", "post") in operations
    assert ("/v2/models/attention/infer", "post") in operations
    before = requests_total(client.get("/metrics", headers=KEY).text)
    for path, method in operations:
        assert client.request(method, path).status_code == 401, path
    big = b"{" + b" " * 4096 + b"}"
    json = {"content-type": "application/json"}
    assert client.post("/v1/analyze", content=big, headers={**json, **KEY}).status_code == 413
    assert client.post("/v1/attention", content=b"x", headers=KEY).status_code == 415
    after = requests_total(client.get("/metrics", headers=KEY).text)
    grown = {label: after[label] - before.get(label, 0.0) for label in after}
    for path, _ in operations:
        assert grown[(path, "401")] >= 1, path
    assert grown[("/v1/analyze", "413")] == 1
    assert grown[("/v1/attention", "415")] == 1
    assert grown.get(("unmatched", "401"), 0.0) == 0


def test_openapi_declares_the_keys_when_they_are_on(client: TestClient) -> None:
    doc = client.get("/openapi.json", headers=KEY).json()
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    info = client.get("/v1/info", headers=KEY).json()
    assert info["auth"] is True
    assert info["limits"]["max_body_bytes"] == 2048


def test_a_2d_query_takes_key_lengths_as_one_integer(client: TestClient) -> None:
    # One query [1, 0] over keys [1, 0], [0, 1]; key_lengths 1 hides key 1, so by hand the
    # weights are [1, 0] and the output is v[0] = [2, 3].
    body = {
        "q": [[1.0, 0.0]],
        "k": [[1.0, 0.0], [0.0, 1.0]],
        "v": [[2.0, 3.0], [5.0, 7.0]],
        "key_lengths": 1,
        "return_weights": True,
        "response_encoding": "json",
    }
    response = client.post("/v1/attention", json=body, headers=KEY)
    assert response.status_code == 200, response.text
    assert response.json()["weights"]["data"] == [[1.0, 0.0]]
    assert response.json()["output"]["data"] == [[2.0, 3.0]]
    refused = client.post("/v1/attention", json={**body, "key_lengths": True}, headers=KEY)
    assert refused.status_code == 422
    assert all(err["loc"][:2] == ["body", "key_lengths"] for err in refused.json()["errors"])


def test_an_engine_passed_to_create_app_runs_the_requests_and_reports_their_compute() -> None:
    """create_app(settings, engine=...): the app computes on that engine (here one whose tiny
    batch budget sends every request alone) and /metrics counts its compute time."""
    engine = Engine(torch.device("cpu"), max_batch_score_bytes=1)
    with in_process_client(small_settings(), engine=engine) as client:
        body = {"q": [[1.0, 0.0], [0.0, 1.0]], "k": [[1.0, 0.0], [0.0, 1.0]],
                "v": [[2.0, 3.0], [5.0, 7.0]], "diagnostics": "none"}  # fmt: skip
        assert client.post("/v1/attention", json=body).status_code == 200
        assert engine.policy.max_batch_cost == 1.0
        text = client.get("/metrics").text
    samples = {
        (sample.name, sample.labels.get("path")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("sdpa_compute_seconds_count", "fused")] == 1.0
