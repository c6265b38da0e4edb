"""429 (a tenant's share of the queue is full) and `priority=`, against httpx.MockTransport.

The fake server plays the answers DESIGN.md "Tenants, fair shares and priority" documents: a 429
with Retry-After and a problem+json body (v1) or {"error": ...} (v2). The priority's wire form
is read back from the bytes the client sent: v1's top-level body field, v2's request parameter
as tritonclient sends it (an int under the request's "parameters").
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import numpy as np
import pytest

from sdpa_client import (
    NO_RETRY,
    AsyncSDPAClient,
    RetryPolicy,
    SDPAClientError,
    SDPARateLimited,
    SDPAServerError,
    build_analyze_body,
    build_attention_body,
    build_infer_request,
)
from tests.client.test_client import (
    Sleeps,
    attention_server,
    client_for,
    ok_attention,
    reference_attention,
    sequence,
    small_qkv,
    v2_server,
)

DETAIL = (
    "tenant 'team-a' holds 512 of its 512 queued requests (SDPA_TENANT_MAX_QUEUE_SHARE 0.5 of "
    "SDPA_MAX_QUEUE 1024); retry after 2 s"
)


def rate_limited_v1(retry_after: str = "2") -> httpx.Response:
    """The server's v1 429: problem+json (with an extra member, as problem+json allows)."""
    body = {"type": "about:blank", "title": "Too Many Requests", "status": 429,
            "detail": DETAIL, "tenant": "team-a"}  # fmt: skip
    return httpx.Response(
        429,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/problem+json", "retry-after": retry_after},
    )


def rate_limited_v2(retry_after: str = "2") -> httpx.Response:
    """The server's v2 429: {"error": ...}, as tritonclient parses it."""
    return httpx.Response(429, json={"error": DETAIL}, headers={"retry-after": retry_after})


# ---- 429 --------------------------------------------------------------------------------------


def test_429_is_a_client_error_retried_after_retry_after_like_a_503() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(rate_limited_v1("2"), rate_limited_v1("3"), ok_attention(calls), calls=calls)
    sleeps = Sleeps()
    policy = RetryPolicy(retry_after_spread=0.0)
    with client_for(handler, sleep=sleeps, retry=policy, rng=random.Random(0)) as client:
        result = client.attention(*small_qkv())
    assert len(calls) == 3
    assert sleeps.delays == [2.0, 3.0]  # exactly the server's Retry-After, no spread
    q, k, v = small_qkv()
    np.testing.assert_allclose(result.output, reference_attention(q, k, v)[0], rtol=1e-5)
    assert calls[0].content == calls[2].content  # the same request again


def test_429_once_the_attempts_are_spent_carries_the_tenant_s_detail() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(*(rate_limited_v1("1") for _ in range(3)), calls=calls)
    sleeps = Sleeps()
    policy = RetryPolicy(max_attempts=3, retry_after_spread=0.0)
    with (
        client_for(handler, sleep=sleeps, retry=policy) as client,
        pytest.raises(SDPARateLimited) as ei,
    ):
        client.attention(*small_qkv())
    err = ei.value
    assert len(calls) == 3
    assert sleeps.delays == [1.0, 1.0]
    assert isinstance(err, SDPAClientError)
    assert not isinstance(err, SDPAServerError)
    assert (err.status, err.title, err.detail) == (429, "Too Many Requests", DETAIL)
    assert (err.retry_after_s, err.attempts) == (1.0, 3)
    assert "429 Too Many Requests: tenant 'team-a' holds 512" in str(err)


def test_a_429_retry_after_beyond_the_total_budget_fails_at_once() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(rate_limited_v1("120"), calls=calls)
    sleeps = Sleeps()
    with (
        client_for(handler, sleep=sleeps, retry=RetryPolicy(max_total_s=30.0)) as client,
        pytest.raises(SDPARateLimited) as ei,
    ):
        client.attention(*small_qkv())
    assert len(calls) == 1
    assert sleeps.delays == []
    assert ei.value.retry_after_s == 120.0


def test_without_retries_a_429_is_raised_at_once() -> None:
    calls: list[httpx.Request] = []
    handler = sequence(rate_limited_v1(), calls=calls)
    with client_for(handler, retry=NO_RETRY) as client, pytest.raises(SDPARateLimited):
        client.analyze(synthetic={"n_q": 4, "n_k": 4, "d_k": 8})
    assert len(calls) == 1


def test_a_v2_429_is_read_from_its_error_member_and_retried() -> None:
    calls: list[httpx.Request] = []
    seen: list[dict[str, Any]] = []
    compute = v2_server(seen)
    pending = [rate_limited_v2("2")]

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return pending.pop(0) if pending else compute(request)

    sleeps = Sleeps()
    with client_for(
        handler, sleep=sleeps, protocol="v2", retry=RetryPolicy(retry_after_spread=0.0)
    ) as client:
        result = client.attention(*small_qkv(), diagnostics="none")
    assert len(calls) == 2
    assert sleeps.delays == [2.0]
    q, k, v = small_qkv()
    np.testing.assert_allclose(result.output, reference_attention(q, k, v)[0], rtol=1e-5)

    calls.clear()
    with (
        client_for(sequence(rate_limited_v2("1"), calls=calls), protocol="v2",
                   retry=NO_RETRY) as client,
        pytest.raises(SDPARateLimited) as ei,
    ):  # fmt: skip
        client.attention(*small_qkv())
    assert (ei.value.status, ei.value.detail, ei.value.retry_after_s) == (429, DETAIL, 1.0)


def test_the_async_client_retries_a_429_after_retry_after() -> None:
    calls: list[httpx.Request] = []
    seen: list[dict[str, Any]] = []
    compute = attention_server(seen)
    pending = [rate_limited_v1("4")]

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return pending.pop(0) if pending else compute(request)

    delays: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        delays.append(seconds)

    async def run() -> Any:
        async with AsyncSDPAClient(
            "http://sdpa.test", transport=httpx.MockTransport(handler), sleep=fake_sleep,
            retry=RetryPolicy(retry_after_spread=0.0),
        ) as client:  # fmt: skip
            return await client.attention(*small_qkv(), priority=1)

    result = asyncio.run(run())
    assert len(calls) == 2
    assert delays == [4.0]
    assert seen[0]["body"]["priority"] == 1
    q, k, v = small_qkv()
    np.testing.assert_allclose(result.output, reference_attention(q, k, v)[0], rtol=1e-5)


# ---- priority on the wire ---------------------------------------------------------------------


def v1_bodies(priority: Any) -> list[dict[str, Any]]:
    """The JSON bodies the sync client sends for attention and analyze with this priority."""
    bodies: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        if request.url.path == "/v1/analyze":
            report = {"d_k": 4, "raw_score_variance": 1.0, "recommended_divisor": 2.0,
                      "strategies": []}  # fmt: skip
            return httpx.Response(200, json=report)
        return ok_attention([])

    with client_for(handle) as client:
        client.attention(*small_qkv(), tag="m/layer0", timeout_ms=500, priority=priority)
        client.analyze(synthetic={"n_q": 4, "n_k": 4, "d_k": 8}, priority=priority)
    return bodies


def test_v1_sends_priority_as_a_top_level_int_beside_tag_and_timeout_ms() -> None:
    attention, analyze = v1_bodies(1)
    assert attention["priority"] == 1
    assert type(attention["priority"]) is int
    assert (attention["tag"], attention["timeout_ms"]) == ("m/layer0", 500.0)
    assert analyze["priority"] == 1
    assert "priority" not in analyze["synthetic"]


def test_v1_sends_no_priority_when_none_and_zero_when_zero() -> None:
    attention, analyze = v1_bodies(None)
    assert "priority" not in attention  # a server older than the field still takes it
    assert "priority" not in analyze
    attention, analyze = v1_bodies(0)  # 0 = the server's default level, sent as asked
    assert (attention["priority"], analyze["priority"]) == (0, 0)
    # a numpy integer is an int on the wire
    attention, _ = v1_bodies(np.int64(3))
    assert attention["priority"] == 3
    assert b'"priority":3' in json.dumps(attention, separators=(",", ":")).encode()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_v2_sends_priority_as_the_request_parameter_tritonclient_sends(binary: bool) -> None:
    seen: list[dict[str, Any]] = []
    handle = v2_server(seen) if binary else _v2_json_server(seen)  # each records the JSON header
    with client_for(handle, protocol="v2") as client:
        encoding: Any = "base64" if binary else "json"
        client.attention(*small_qkv(), diagnostics="none", priority=2, encoding=encoding)
        client.attention(*small_qkv(), diagnostics="none", encoding=encoding)
    with_priority, without = seen
    # tritonclient: infer_request["parameters"]["priority"] = priority (an int), beside the
    # request's other parameters; no tensor carries it.
    assert with_priority["parameters"] == {"diagnostics": "none", "priority": 2}
    assert type(with_priority["parameters"]["priority"]) is int
    assert all("priority" not in (i.get("parameters") or {}) for i in with_priority["inputs"])
    assert without["parameters"] == {"diagnostics": "none"}


def _v2_json_server(seen: list[dict[str, Any]]) -> Any:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        q, k, v = small_qkv()
        out = reference_attention(q, k, v)[0]
        return httpx.Response(200, json={"outputs": [{
            "name": "output", "datatype": "FP64", "shape": list(out.shape),
            "data": out.reshape(-1).tolist()}]})  # fmt: skip

    return handle


def test_the_body_builders_carry_priority_too() -> None:
    q, k, v = small_qkv()
    assert build_attention_body(q, k, v, priority=1)["priority"] == 1
    assert "priority" not in build_attention_body(q, k, v)
    assert build_analyze_body(q, k, priority=3)["priority"] == 3
    body, headers = build_infer_request(q, k, v, priority=1, diagnostics="none")
    header = json.loads(body[: int(headers["Inference-Header-Content-Length"])])
    assert header["parameters"]["priority"] == 1


@pytest.mark.parametrize(
    ("priority", "error"),
    [(True, TypeError), (np.bool_(False), TypeError), (1.0, TypeError), ("1", TypeError),
     (-1, ValueError)],
    ids=["bool", "numpy-bool", "float", "str", "negative"],
)  # fmt: skip
@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_a_priority_that_is_not_a_non_negative_int_is_refused_before_sending(
    priority: Any, error: type[Exception], protocol: Any
) -> None:
    calls: list[httpx.Request] = []
    with client_for(sequence(calls=calls), protocol=protocol) as client:
        with pytest.raises(error, match="priority"):
            client.attention(*small_qkv(), priority=priority)
        with pytest.raises(error, match="priority"):
            client.analyze(synthetic={"n_q": 4, "n_k": 4, "d_k": 8}, priority=priority)
    assert calls == []


def test_the_async_client_sends_the_same_priority_as_the_sync_one() -> None:
    sync_seen: list[bytes] = []
    async_seen: list[bytes] = []

    def record(into: list[bytes]) -> Any:
        def handle(request: httpx.Request) -> httpx.Response:
            into.append(request.content)
            return (
                v2_server([])(request) if request.url.path.startswith("/v2") else ok_attention([])
            )

        return handle

    q, k, v = small_qkv()
    for protocol in ("v1", "v2"):
        with client_for(record(sync_seen), protocol=protocol) as client:
            client.attention(q, k, v, priority=5, diagnostics="none")

    async def run() -> None:
        for protocol in ("v1", "v2"):
            async with AsyncSDPAClient(
                "http://sdpa.test", transport=httpx.MockTransport(record(async_seen)),
                protocol=protocol,  # type: ignore[arg-type]
            ) as client:  # fmt: skip
                await client.attention(q, k, v, priority=5, diagnostics="none")

    asyncio.run(run())
    assert async_seen == sync_seen
    assert json.loads(sync_seen[0])["priority"] == 5
    assert b'"parameters":{"diagnostics":"none","priority":5}' in sync_seen[1]
