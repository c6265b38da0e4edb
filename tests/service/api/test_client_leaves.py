"""A client that leaves while its body is being read: a 499 in the access log and the metrics,
no traceback, no error line (the ASGI app driven directly, as uvicorn drives it)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.api.deps import state_of
from service.app import create_app
from tests.support.app import asgi_scope, small_settings


def leave_mid_body(
    path: str,
) -> tuple[list[dict[str, Any]], dict[tuple[str, str], float]]:
    """POST `path` with half a body, then the disconnect -> (what the app sent, the requests
    counted by route and status)."""
    app = create_app(small_settings())
    incoming: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"q": [[1.0, 0.0],', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = asgi_scope("POST", path, content_length=1000)
    asyncio.run(app(scope, receive, send))
    return sent, requests_by_route_and_status(app)


def requests_by_route_and_status(app: Any) -> dict[tuple[str, str], float]:
    text = generate_latest(state_of(app).metrics.registry).decode()
    return {
        (sample.labels["route"], sample.labels["status"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sdpa_requests_total"
    }


@pytest.mark.parametrize("path", ["/v1/attention", "/v1/analyze"])
def test_a_client_leaving_mid_body_is_a_499_without_a_traceback(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        sent, counted = leave_mid_body(path)
    start = next(m for m in sent if m.get("type") == "http.response.start")
    assert start["status"] == 499
    assert counted == {(path, "499"): 1.0}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if r.exc_info]
    access = [r for r in caplog.records if r.name == "sdpa.access"]
    assert access
    assert access[0].json_fields["status"] == 499  # type: ignore[attr-defined]
