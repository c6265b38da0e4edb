"""The endpoints are written once: both clients send the same requests, built the same way."""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

import httpx
import numpy as np
import pytest

from sdpa_client import (
    AsyncSDPAClient,
    SDPAClient,
    SDPAServerError,
    SDPAUnavailable,
    build_analyze_body,
    build_attention_body,
)
from sdpa_client.calls import Call, RequestBuilder


def qkv() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4), dtype=np.float32) for _ in range(3))
    return q, k, v


def answer(request: httpx.Request) -> httpx.Response:
    if request.url.path in ("/healthz", "/readyz"):
        return httpx.Response(503 if request.url.path == "/readyz" else 200)
    if request.url.path == "/v1/info":
        return httpx.Response(200, json={"device": "cpu"})
    out = {"dtype": "float32", "shape": [1], "data": [0.0]}
    if request.url.path == "/v1/analyze":
        return httpx.Response(
            200, json={"d_k": 4, "raw_score_variance": 1.0, "recommended_divisor": 1.0,
                       "strategies": []},
        )  # fmt: skip
    return httpx.Response(200, json={"output": out, "weights": None, "diagnostics": None})


def exercise(client: Any) -> Any:
    """Every endpoint once, with options; the same calls for either client."""
    q, k, v = qkv()
    return [
        client.attention(q, k, v, causal="bottom_right", key_lengths=[2], scale=0.5,
                         diagnostics="full", timeout_ms=250, request_id="r-7"),
        client.analyze(q, k, strategies=["none", ("t2", 2.0)], encoding="json"),
        client.info(),
        client.healthz(),
        client.readyz(),
    ]  # fmt: skip


def seen(request: httpx.Request) -> dict[str, Any]:
    headers = {k: v for k, v in request.headers.items() if k not in ("user-agent",)}
    return {
        "method": request.method,
        "url": str(request.url),
        "headers": headers,
        "body": request.content,
        "timeout": request.extensions["timeout"],
    }


def test_sync_and_async_clients_send_the_same_requests_and_read_the_same_results() -> None:
    sync_seen: list[dict[str, Any]] = []
    async_seen: list[dict[str, Any]] = []

    def record(into: list[dict[str, Any]]) -> Any:
        def handle(request: httpx.Request) -> httpx.Response:
            into.append(seen(request))
            return answer(request)

        return handle

    with SDPAClient("http://sdpa.test", transport=httpx.MockTransport(record(sync_seen))) as c:
        sync_results = exercise(c)

    async def run() -> list[Any]:
        transport = httpx.MockTransport(record(async_seen))
        async with AsyncSDPAClient("http://sdpa.test", transport=transport) as c:
            return [await coroutine for coroutine in exercise(c)]

    async_results = asyncio.run(run())
    assert len(sync_seen) == 5
    assert async_seen == sync_seen
    assert [type(r) for r in async_results] == [type(r) for r in sync_results]
    assert sync_results[2:] == async_results[2:] == [{"device": "cpu"}, True, False]


def test_async_methods_do_nothing_until_awaited() -> None:
    calls: list[httpx.Request] = []

    async def run() -> None:
        def handle(request: httpx.Request) -> httpx.Response:
            calls.append(request)
            return answer(request)

        transport = httpx.MockTransport(handle)
        async with AsyncSDPAClient("http://sdpa.test", transport=transport) as client:
            pending = client.attention(np.arange(4), np.arange(4), np.arange(4))  # int64
            assert calls == []
            with pytest.raises(TypeError, match="int64"):
                await pending  # the body is built, and refused, only now

    asyncio.run(run())
    assert calls == []


def test_the_request_builder_returns_the_call_and_the_body_builders_its_body() -> None:
    q, k, v = qkv()
    call = RequestBuilder().attention(q, k, v, return_weights=True, request_id="x")
    assert isinstance(call, Call)
    assert (call.method, call.path, call.request_id, call.retryable) == (
        "POST", "/v1/attention", "x", True,
    )  # fmt: skip
    assert call.body == build_attention_body(q, k, v, return_weights=True)
    body = build_attention_body(q, k, v, return_weights=True, encoding="json")
    assert body["return_weights"] is True
    assert body["q"]["data"] == q.tolist()
    probe = RequestBuilder().readyz()
    assert (probe.method, probe.path, probe.body, probe.retryable) == (
        "GET",
        "/readyz",
        None,
        False,
    )


def test_body_builders_show_the_endpoint_s_signature() -> None:
    attention = inspect.signature(SDPAClient.attention)
    built = inspect.signature(build_attention_body)
    assert list(built.parameters) == list(attention.parameters)[1:]  # without self
    assert built.parameters["diagnostics"].default == "summary"
    assert "SDPAClient.analyze" in (build_analyze_body.__doc__ or "")
    with pytest.raises(ValueError, match="both q and k"):
        build_analyze_body(qkv()[0])


def test_a_probe_raises_for_what_is_not_a_yes_or_no() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"title": "boom"})

    with (
        SDPAClient("http://sdpa.test", transport=httpx.MockTransport(handle)) as client,
        pytest.raises(SDPAServerError, match="500 boom") as ei,
    ):
        client.healthz()
    assert not isinstance(ei.value, SDPAUnavailable)
    assert ei.value.attempts == 1


def test_a_request_is_encoded_once_for_every_attempt() -> None:
    bodies: list[bytes] = []
    pending = [httpx.Response(503, headers={"retry-after": "0"})]

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return pending.pop() if pending else answer(request)

    client = SDPAClient(
        "http://sdpa.test", transport=httpx.MockTransport(handle), sleep=lambda s: None
    )
    with client:
        client.attention(*qkv())
    assert len(bodies) == 2
    assert bodies[0] is bodies[1] or bodies[0] == bodies[1]
    assert json.loads(bodies[0])["diagnostics"] == "summary"
