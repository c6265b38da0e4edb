"""SDPA_MAX_INFLIGHT_BYTES through the app (ASGI, driven as uvicorn drives it): while the
requests in flight hold bodies (declared or read) and answers near the limit, a new request
gets 503 with Retry-After before any of its body is read, probes still answer, and once the
holders leave the budget is free."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

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
        # The holder: declares 4,090 bytes, sends 3,000, then stalls (and later leaves).
        holder = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=4090),
                [
                    {"type": "http.request", "body": b" " * 3000, "more_body": True},
                    {"wait": leave, "reached": stalled},
                ],
            )
        )
        await stalled.wait()
        # Its declared body is held from the start, not only what arrived.
        assert _held(app) == 4090
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
        for path in ("/healthz", "/v2/health/live", "/v2/health/ready"):
            probe, _ = await call(app, asgi_scope("GET", path), [])
            # Probes are never refused for it (this app has no engine: ready says "starting").
            said = b"".join(m.get("body", b"") for m in probe if m["type"] == "http.response.body")
            assert b"SDPA_MAX_INFLIGHT_BYTES" not in said, path
            assert status(probe) == 200 or b"starting" in said, path
        leave.set()
        await holder
        assert _held(app) == 0  # the holder's bytes came back when it ended

    asyncio.run(scenario())


def computed(exposition: str) -> float:
    """How many device calls the engine has timed (sdpa_compute_seconds' counts, every path)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "sdpa_compute_seconds_count"
    )


def _held(app: Any) -> int:
    """The in-flight counter of the app's InflightBytesMiddleware."""
    from service.middleware.inflight import InflightBytesMiddleware

    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, InflightBytesMiddleware):
        layer = getattr(layer, "app", None)
    assert layer is not None
    return int(layer.held)


# Weights [1, 1, 128, 128] from q = k = v [1, 1, 128, 4] in base64, no diagnostics, by hand:
# the answer holds 128·4 + 128·128 = 16,896 numbers at 4·4/3 bytes plus the 4,096-byte
# envelope = 94,208 bytes; the working set adds the inputs (3·128·4·4 = 6,144), the results
# (output 2,048 + weights 65,536) and the encoder's copy (94,208): 262,144 bytes.
WORKING_SET = 262_144


def weights_request() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    tensors = {name: to_wire(torch.randn(1, 1, 128, 4, generator=gen), "b64") for name in "qkv"}
    return {**tensors, "return_weights": True, "diagnostics": "none"}


def test_an_answer_that_can_never_fit_is_a_422_before_it_is_computed() -> None:
    """The request holds its body besides its working set."""
    body = json.dumps(weights_request()).encode()
    alone = WORKING_SET + len(body)
    headers = {"content-type": "application/json"}
    with in_process_client(small_settings(max_inflight_bytes=alone - 1)) as client:
        refused = client.post("/v1/attention", content=body, headers=headers)
        assert refused.status_code == 422
        error = refused.json()["errors"][0]
        assert error["type"] == "inflight_limit"
        assert "SDPA_MAX_INFLIGHT_BYTES" in error["msg"]
        assert "base64" in error["msg"]
        assert computed(client.get("/metrics").text) == 0
    with in_process_client(small_settings(max_inflight_bytes=alone)) as client:
        assert client.post("/v1/attention", content=body, headers=headers).status_code == 200


def test_an_answer_that_does_not_fit_beside_others_waits_with_a_503() -> None:
    """A stalled upload holds 50,000 bytes: the weights request's working set no longer fits
    beside it (503 before compute); once the upload leaves, it is served, and the bytes held
    come back to zero."""
    body = json.dumps(weights_request()).encode()
    app = create_app(small_settings(max_inflight_bytes=WORKING_SET + len(body) + 40_000))

    async def scenario() -> None:
        async with app.router.lifespan_context(app):  # the engine, as uvicorn starts it
            leave, stalled = asyncio.Event(), asyncio.Event()
            holder = asyncio.create_task(
                call(
                    app,
                    asgi_scope("POST", "/v1/attention", content_length=100_000),
                    [
                        {"type": "http.request", "body": b" " * 50_000, "more_body": True},
                        {"wait": leave, "reached": stalled},
                    ],
                )
            )
            await stalled.wait()
            request = [{"type": "http.request", "body": body, "more_body": False}]
            scope = asgi_scope("POST", "/v1/attention", content_length=len(body))
            refused, _ = await call(app, scope, list(request))
            assert status(refused) == 503
            metrics, _ = await call(app, asgi_scope("GET", "/metrics"), [])
            exposition = b"".join(m.get("body", b"") for m in metrics).decode()
            assert computed(exposition) == 0
            assert 'sdpa_rejected_total{reason="inflight_bytes"} 1.0' in exposition
            leave.set()
            await holder
            stays = {"wait": asyncio.Event(), "reached": asyncio.Event()}  # a client that stays
            served, _ = await call(app, scope, [*request, stays])
            assert status(served) == 200
            assert _held(app) == 0

    asyncio.run(scenario())


def test_bodies_declared_together_cannot_pass_the_limit_together() -> None:
    """Two clients send their headers at once, each declaring 3,000 bytes under a 4,096-byte
    limit: the first reserves its body before a byte arrives, the second gets 503 before any of
    its body is read. A body declared larger than the limit allows at all is a 413."""
    app = create_app(small_settings(max_inflight_bytes=LIMIT))

    async def scenario() -> None:
        leave, stalled = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=3000),
                [{"wait": leave, "reached": stalled}],  # nothing sent yet
            )
        )
        await stalled.wait()
        assert _held(app) == 3000
        second, read = await call(
            app, asgi_scope("POST", "/v1/attention", content_length=3000),
            [{"type": "http.request", "body": b" " * 3000, "more_body": False}],
        )  # fmt: skip
        assert status(second) == 503
        assert read == []
        too_big, read = await call(
            app, asgi_scope("POST", "/v1/attention", content_length=LIMIT + 1),
            [{"type": "http.request", "body": b" " * (LIMIT + 1), "more_body": False}],
        )  # fmt: skip
        assert status(too_big) == 413
        assert read == []
        leave.set()
        await first
        assert _held(app) == 0

    asyncio.run(scenario())
