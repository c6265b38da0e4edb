"""API keys against a real server on loopback, plus the middleware's header handling in-process.

Truth for the 200 case: a 1x2 query against two keys, computed by hand in the test.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from service.metrics import Metrics
from service.middleware.access_log import AccessLogMiddleware
from service.middleware.auth import ApiKeyMiddleware
from service.serving.exchange import exchange_of
from service.tenants import ANONYMOUS
from tests.support.live_server import LiveServer, live_server

KEYS = ("k-alpha-7d1f0c", "k-beta-93be22")
PAYLOAD = {
    "q": [[1.0, 0.0]],
    "k": [[1.0, 0.0], [0.0, 1.0]],
    "v": [[1.0, 2.0], [3.0, 4.0]],
    "diagnostics": "none",
    "response_encoding": "json",
}


def _expected_output() -> list[float]:
    # scores = q.k^T / sqrt(2) = [1/sqrt(2), 0]; softmax; weighted sum of v's rows.
    s0 = 1.0 / math.sqrt(2.0)
    p0 = math.exp(s0) / (math.exp(s0) + 1.0)
    return [p0 * 1.0 + (1 - p0) * 3.0, p0 * 2.0 + (1 - p0) * 4.0]


def _output_values(response: httpx.Response) -> list[float]:
    output = response.json()["output"]
    data = output["data"] if isinstance(output, dict) else output
    while isinstance(data[0], list):
        assert len(data) == 1
        data = data[0]
    return [float(x) for x in data]


def _assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.headers["www-authenticate"].startswith("Bearer")
    body = response.json()
    assert body["status"] == 401
    assert body["title"] == "Unauthorized"
    for key in KEYS:
        assert key not in response.text


def _unauthorized_count(text: str) -> float:
    match = re.search(r'^sdpa_rejected_total\{reason="unauthorized"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_API_KEYS": ",".join(KEYS)}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("auth")) as srv:
        yield srv


def test_missing_and_wrong_keys_get_401_problem_json(server: LiveServer) -> None:
    url = f"{server.url}/v1/attention"
    for headers in (
        {},
        {"Authorization": "Bearer wrong-key"},
        {"X-API-Key": "wrong-key"},
        {"Authorization": f"Basic {KEYS[0]}"},  # the key, but not as a Bearer token
        {"Authorization": f"Bearer {KEYS[0]}x"},  # a longer key with a valid prefix
        {"Authorization": f"Bearer {KEYS[0][:-1]}"},  # a valid key's prefix
        {"Authorization": "Bearer"},  # the scheme without a token
    ):
        _assert_401(httpx.post(url, json=PAYLOAD, headers=headers, timeout=30))


def test_the_right_key_gets_200_as_bearer_or_x_api_key(server: LiveServer) -> None:
    url = f"{server.url}/v1/attention"
    for headers in (
        {"Authorization": f"Bearer {KEYS[0]}"},
        {"Authorization": f"bearer {KEYS[1]}"},  # the scheme is case-insensitive (RFC 9110)
        {"X-API-Key": KEYS[1]},
    ):
        response = httpx.post(url, json=PAYLOAD, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        assert _output_values(response) == pytest.approx(_expected_output(), rel=1e-5)


def test_health_stays_open_and_metrics_need_a_key(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
    _assert_401(httpx.get(f"{server.url}/metrics", timeout=10))
    _assert_401(httpx.get(f"{server.url}/v1/info", timeout=10))

    headers = {"X-API-Key": KEYS[0]}
    before = _unauthorized_count(httpx.get(f"{server.url}/metrics", headers=headers).text)
    for _ in range(3):
        _assert_401(httpx.post(f"{server.url}/v1/attention", json=PAYLOAD, timeout=30))
    after = _unauthorized_count(httpx.get(f"{server.url}/metrics", headers=headers).text)
    assert after - before == 3


def test_the_explorer_page_loads_without_a_key_but_its_api_calls_need_one(
    server: LiveServer,
) -> None:
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    script = httpx.get(f"{server.url}/static/app.js", timeout=10)
    assert script.status_code == 200
    _assert_401(httpx.post(f"{server.url}/v1/attention", json=PAYLOAD, timeout=30))


def test_keys_never_reach_the_log(server: LiveServer) -> None:
    httpx.post(
        f"{server.url}/v1/attention",
        json=PAYLOAD,
        headers={"Authorization": f"Bearer {KEYS[0]}"},
        timeout=30,
    )
    httpx.post(f"{server.url}/v1/attention", json=PAYLOAD, headers={"X-API-Key": "guess-1234"})
    log = server.log()
    assert "sdpa.access" in log
    for secret in (*KEYS, "guess-1234"):
        assert secret not in log


def test_a_key_file_works(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# rotated 2026-11\n\n  file-key-5c2e  \nfile-key-other\n", "utf-8")
    with live_server({"SDPA_API_KEYS_FILE": str(key_file)}, tmp_path=tmp_path) as srv:
        url = f"{srv.url}/v1/attention"
        ok = httpx.post(url, json=PAYLOAD, headers={"X-API-Key": "file-key-5c2e"}, timeout=30)
        assert ok.status_code == 200, ok.text
        assert _output_values(ok) == pytest.approx(_expected_output(), rel=1e-5)
        _assert_401(httpx.post(url, json=PAYLOAD, headers={"X-API-Key": "# rotated 2026-11"}))
        _assert_401(httpx.post(url, json=PAYLOAD, headers={"X-API-Key": KEYS[0]}))
        assert httpx.get(f"{srv.url}/readyz", timeout=10).status_code == 200


def test_without_keys_everything_is_open(tmp_path: Path) -> None:
    with live_server({}, tmp_path=tmp_path) as srv:
        response = httpx.post(f"{srv.url}/v1/attention", json=PAYLOAD, timeout=30)
        assert response.status_code == 200, response.text
        assert httpx.get(f"{srv.url}/metrics", timeout=10).status_code == 200


# --- the middleware alone, in-process (a tiny Starlette app: fast, no torch) -------------------


def _app(metrics: Metrics) -> AccessLogMiddleware:
    async def echo(request: Request) -> PlainTextResponse:
        # The tenant the middleware named in the request's Exchange, for the rooms behind it.
        tenant = exchange_of(request.scope).tenant
        return PlainTextResponse(f"{request.url.path} {'-' if tenant == ANONYMOUS else tenant}")

    inner = Starlette(routes=[Route("/{path:path}", echo, methods=["GET", "POST"])])
    keyed = ApiKeyMiddleware(inner, keys={"a": "team-a", "bb": "team-b"}, metrics=metrics)
    return AccessLogMiddleware(keyed, metrics=Metrics())  # the edge makes the Exchange


def test_middleware_header_handling() -> None:
    metrics = Metrics()

    async def statuses() -> dict[str, httpx.Response]:
        transport = httpx.ASGITransport(app=_app(metrics))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            both = {"Authorization": "Bearer nope", "X-API-Key": "a"}
            right_twice = [("X-API-Key", "bb"), ("X-API-Key", "bb")]
            # Many guesses in one request: each header a key, the right one among them.
            guesses = [("X-API-Key", f"guess{i}") for i in range(50)] + [("X-API-Key", "a")]
            return {
                "healthz": await client.get("/healthz"),
                "readyz": await client.get("/readyz"),
                "healthz/extra": await client.get("/healthz/extra"),
                "readyzz": await client.get("/readyzz"),
                "x-api-key": await client.get("/x", headers={"X-API-Key": "bb"}),
                "bearer": await client.get("/x", headers={"Authorization": "Bearer  a "}),
                "both": await client.get("/x", headers=both),
                "right_twice": await client.get("/x", headers=right_twice),
                "guesses": await client.get("/x", headers=guesses),
                "missing": await client.get("/x"),
                "wrong": await client.get("/x", headers={"X-API-Key": "b"}),
            }

    got = asyncio.run(statuses())
    assert got["healthz"].status_code == got["readyz"].status_code == 200
    # Open paths match exactly: a longer path is not a loophole.
    assert got["healthz/extra"].status_code == got["readyzz"].status_code == 401
    assert got["x-api-key"].status_code == got["bearer"].status_code == 200
    # Each key's requests belong to its tenant; the open paths to nobody.
    assert got["x-api-key"].text == "/x team-b"
    assert got["bearer"].text == "/x team-a"
    assert got["healthz"].text == "/healthz -"
    # One request is one guess: several keys are refused, none tried, even when one is right.
    assert got["both"].status_code == got["right_twice"].status_code == 401
    assert got["guesses"].status_code == 401
    assert got["both"].json()["detail"].startswith("2 API keys presented, none tried")
    assert got["guesses"].json()["detail"].startswith("51 API keys presented, none tried")
    assert got["missing"].json()["detail"].startswith("missing API key")
    assert got["wrong"].json()["detail"].startswith("invalid API key")
    count = metrics.registry.get_sample_value("sdpa_rejected_total", {"reason": "unauthorized"})
    assert count == 7  # healthz/extra, readyzz, both, right_twice, guesses, missing, wrong


def test_middleware_refuses_an_empty_key_set() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeyMiddleware(_app(Metrics()), keys={})
