"""SDPA_MAX_INFLIGHT_BYTES through the app (ASGI, driven as uvicorn drives it): while one
request holds more body bytes than the limit, a new request gets 503 with Retry-After before
any of its body is read, probes still answer, and once the holder leaves the budget is free."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from service.app import create_app
from tests.support.app import asgi_scope, in_process_client, small_settings
from tests.support.wire import to_wire

LIMIT = 4096


async def call(app: Any, scope: dict[str, Any], incoming: list[dict[str, Any]]) -> list[Any]:
    sent: list[dict[str, Any]] = []
    read: list[int] = []

    async def receive() -> dict[str, Any]:
        if not incoming:
            return {"type": "http.disconnect"}
        message = incoming.pop(0)
        if message.get("wait") is not None:
            message["reached"].set()  # the chunks before were read (and counted)
            await message["wait"].wait()
            return {"type": "http.disconnect"}
        read.append(len(message.get("body", b"")))
        return message

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return [sent, read]


def status(sent: list[dict[str, Any]]) -> int:
    return int(next(m for m in sent if m["type"] == "http.response.start")["status"])


def test_a_new_request_waits_for_the_bytes_in_flight_to_come_back() -> None:
    app = create_app(small_settings(max_inflight_bytes=LIMIT))

    async def scenario() -> None:
        leave, stalled = asyncio.Event(), asyncio.Event()
        # The holder: 5,000 body bytes read, then it stalls (and later leaves).
        holder = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=10_000),
                [
                    {"type": "http.request", "body": b" " * 5000, "more_body": True},
                    {"wait": leave, "reached": stalled},
                ],
            )
        )
        await stalled.wait()
        assert _held(app) == 5000
        body = b'{"q": [[1.0]], "k": [[1.0]], "v": [[1.0]]}'
        refused, read = await call(
            app, asgi_scope("POST", "/v1/attention", content_length=len(body)),
            [{"type": "http.request", "body": body, "more_body": False}],
        )  # fmt: skip
        assert status(refused) == 503
        headers = dict(next(m for m in refused if m["type"] == "http.response.start")["headers"])
        assert headers[b"retry-after"] == b"1"
        assert b"SDPA_MAX_INFLIGHT_BYTES" in b"".join(
            m.get("body", b"") for m in refused if m["type"] == "http.response.body"
        )
        assert read == []  # refused before a byte of its body was read
        probe, _ = await call(app, asgi_scope("GET", "/healthz"), [])
        assert status(probe) == 200  # probes are never refused for it
        leave.set()
        await holder
        assert _held(app) == 0  # the holder's bytes came back when it ended

    asyncio.run(scenario())


def _held(app: Any) -> int:
    """The in-flight counter of the app's InflightBytesMiddleware."""
    from service.middleware.inflight import InflightBytesMiddleware

    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, InflightBytesMiddleware):
        layer = getattr(layer, "app", None)
    assert layer is not None
    return int(layer.held)


def test_an_answer_that_would_not_fit_is_refused_before_it_is_computed() -> None:
    """Weights [1, 1, 128, 128] in base64: about 92 KB estimated (16,384 + 128·4 numbers at
    4/3 of 4 bytes, plus the 4 KiB envelope), over a 50,000-byte budget: 503 before the device
    sees it; without weights the answer fits."""
    gen = torch.Generator().manual_seed(0)
    tensors = {name: to_wire(torch.randn(1, 1, 128, 4, generator=gen), "b64") for name in "qkv"}
    with in_process_client(small_settings(max_inflight_bytes=50_000)) as client:
        before = client.get("/metrics").text.count('sdpa_compute_seconds_count{path="dense"}')
        refused = client.post("/v1/attention", json={**tensors, "return_weights": True})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "SDPA_MAX_INFLIGHT_BYTES" in refused.json()["detail"]
        metrics = client.get("/metrics").text
        assert metrics.count('sdpa_compute_seconds_count{path="dense"}') == before == 0
        assert 'sdpa_rejected_total{reason="inflight_bytes"} 1.0' in metrics
        fits = client.post("/v1/attention", json={**tensors, "diagnostics": "none"})
        assert fits.status_code == 200
