"""JSON access log of a real server: one line per request, request ids, no tensors, no keys."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.live_server import LiveServer, live_server

KEY = "log-test-key-0b7d5e"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Distinctive values: if any tensor data reached the log, these digits would show up there.
PAYLOAD = {
    "q": [[0.7315926, -1.4142857]],
    "k": [[0.2718281, 0.5772156], [-0.6931471, 0.3183098]],
    "v": [[1.6180339, -2.5029078], [4.6692016, 0.9159655]],
    "diagnostics": "summary",
}
DISTINCTIVE = ("7315926", "4142857", "2718281", "5772156", "6931471", "3183098", "6180339",
               "5029078", "6692016", "9159655")  # fmt: skip
FIELDS = {"ts", "request_id", "method", "route", "status", "latency_ms", "batch_size", "client"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server({"SDPA_API_KEYS": KEY}, tmp_path=tmp_path_factory.mktemp("log")) as srv:
        yield srv


def _json_lines(server: LiveServer) -> list[dict[str, Any]]:
    lines = [line for line in server.log().splitlines() if line.strip()]
    parsed = []
    for line in lines:
        value = json.loads(line)  # every line the server writes is JSON (uvicorn's too)
        assert isinstance(value, dict)
        parsed.append(value)
    return parsed


def _access_lines(server: LiveServer, request_id: str, *, expect: int = 1) -> list[dict[str, Any]]:
    # The line is written after the response went out: wait (bounded) until it is there.
    deadline = time.monotonic() + 10
    while True:
        found = [
            r
            for r in _json_lines(server)
            if r.get("logger") == "sdpa.access" and r.get("request_id") == request_id
        ]
        if len(found) >= expect or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_one_line_per_request_with_the_callers_request_id(server: LiveServer) -> None:
    rid = "trace-4f2a/req-0001"
    response = httpx.post(
        f"{server.url}/v1/attention",
        json=PAYLOAD,
        headers={**AUTH, "X-Request-ID": rid},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == rid
    assert response.json()["meta"]["request_id"] == rid

    (line,) = _access_lines(server, rid)
    assert set(line) >= FIELDS
    assert line["method"] == "POST"
    assert line["route"] == "/v1/attention"
    assert line["status"] == 200
    assert line["client"] == "127.0.0.1"
    assert isinstance(line["latency_ms"], float)
    assert line["latency_ms"] >= 0
    assert line["batch_size"] == response.json()["meta"]["batch_size"] >= 1
    assert line["level"] == "info"


@pytest.mark.parametrize(
    "sent",
    [None, "x" * 129, "has space", "", "caf\u00e9"],
    ids=["none", "long", "space", "empty", "utf8"],
)
def test_missing_or_insane_request_ids_are_replaced(server: LiveServer, sent: str | None) -> None:
    headers = {name.encode(): value.encode() for name, value in AUTH.items()}
    if sent is not None:
        headers[b"X-Request-ID"] = sent.encode("utf-8")  # raw bytes: httpx sends them as they are
    response = httpx.get(f"{server.url}/v1/info", headers=headers, timeout=10)
    assert response.status_code == 200
    generated = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    (line,) = _access_lines(server, generated)
    assert line["route"] == "/v1/info"
    assert line["batch_size"] is None


def test_route_templates_statuses_and_metrics(server: LiveServer) -> None:
    def count(text: str, route: str, status: str) -> float:
        labels = rf'route="{re.escape(route)}",status="{status}",tenant="[^"]+"'
        pattern = rf"^sdpa_requests_total\{{{labels}\}} (\S+)$"
        match = re.search(pattern, text, re.M)
        return float(match.group(1)) if match else 0.0

    before = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    missing = httpx.get(f"{server.url}/no/such/path/123", headers=AUTH)
    assert missing.status_code == 404
    denied = httpx.post(f"{server.url}/v1/attention", json=PAYLOAD)
    assert denied.status_code == 401
    bad = httpx.post(f"{server.url}/v1/attention", json={**PAYLOAD, "casual": True}, headers=AUTH)
    assert bad.status_code == 422
    after = httpx.get(f"{server.url}/metrics", headers=AUTH).text

    assert count(after, "unmatched", "404") - count(before, "unmatched", "404") == 1
    assert count(after, "/v1/attention", "422") - count(before, "/v1/attention", "422") == 1
    # Auth answers before routing, yet the refusal is labelled with the route it was made at.
    assert count(after, "/v1/attention", "401") - count(before, "/v1/attention", "401") == 1
    assert count(after, "unmatched", "401") == count(before, "unmatched", "401")
    assert re.search(r'^sdpa_request_duration_seconds_count\{route="/v1/attention"\} ', after, re.M)

    (line,) = _access_lines(server, missing.headers["x-request-id"])
    assert (line["route"], line["status"]) == ("unmatched", 404)
    (line,) = _access_lines(server, bad.headers["x-request-id"])
    assert (line["route"], line["status"]) == ("/v1/attention", 422)
    (line,) = _access_lines(server, denied.headers["x-request-id"])
    assert (line["route"], line["status"]) == ("/v1/attention", 401)


def test_the_log_holds_neither_tensors_nor_keys(server: LiveServer) -> None:
    for encoding in ("json", "base64"):
        response = httpx.post(
            f"{server.url}/v1/attention",
            json={**PAYLOAD, "response_encoding": encoding, "return_weights": True},
            headers=AUTH,
            timeout=30,
        )
        assert response.status_code == 200
    httpx.post(f"{server.url}/v1/attention", json={**PAYLOAD, "q": [[0.7315926]]}, headers=AUTH)
    _access_lines(server, response.headers["x-request-id"])
    log = server.log()
    for digits in DISTINCTIVE:
        assert digits not in log
    assert KEY not in log
    assert "Bearer" not in log
