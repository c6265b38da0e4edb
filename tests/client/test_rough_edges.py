"""The client's rough edges of issue 29: an exception's text says its message once, and a body
over the server's advertised limit (/v1/info limits.max_body_bytes) is refused before it is
sent, as the server's 413 would refuse it, at the cost of at most one question per client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from sdpa_client import AsyncSDPAClient, SDPAClient
from sdpa_client.errors import (
    FieldProblem,
    SDPAPayloadTooLarge,
    SDPARequestError,
    SDPAValidationError,
)
from sdpa_client.retry import NO_RETRY
from tests.support.app import app_transport, in_process_client, small_settings

# The test app's body limit: far under SIZE_CHECK_FROM_BYTES, so that a small body meets the
# server's own 413 (the client does not ask the limit for it) and a large one the client's.
LIMIT = 4096


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    with in_process_client(small_settings(max_body_bytes=LIMIT)) as client:
        yield client


class Recorder:
    """An httpx transport that counts the requests and body bytes that reach the app."""

    def __init__(self, app_client: TestClient) -> None:
        self.inner = app_transport(app_client)
        self.requests: list[tuple[str, str, int]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.method, request.url.path, len(request.content)))
        return self.inner.handle_request(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def _qkv(n: int, d: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, n, d)).astype(np.float32) for _ in range(3))  # type: ignore[return-value]


def test_a_413_from_the_server_says_its_message_once(app_client: TestClient) -> None:
    # A body the client does not check (under SIZE_CHECK_FROM_BYTES it never asks the limit),
    # refused by the server: the server's own 413.
    transport = app_transport(app_client)
    with (
        SDPAClient("http://testserver", transport=transport, retry=NO_RETRY) as c,
        pytest.raises(SDPAPayloadTooLarge) as ei,
    ):
        c.attention(*_qkv(16))
    err = ei.value
    assert err.status == 413
    assert err.attempts == 1  # the server refused it
    assert f"exceeds the limit of {LIMIT} bytes" in err.detail
    assert str(err).count(err.detail) == 1, str(err)


def test_a_422_says_each_problem_once(app_client: TestClient) -> None:
    q = np.zeros((1, 4, 8), dtype=np.float32)
    k = np.zeros((1, 4, 5), dtype=np.float32)  # D differs from q's
    with (
        SDPAClient("http://testserver", transport=app_transport(app_client)) as c,
        pytest.raises(SDPAValidationError) as ei,
    ):
        c.attention(q, k, k)
    err = ei.value
    text = str(err)
    assert err.errors, "the server names the field at fault"
    for problem in err.errors:
        assert text.count(problem.msg) == 1, text


def test_field_problems_the_detail_does_not_say_are_still_shown() -> None:
    err = SDPARequestError(
        422,
        "Invalid request",
        "2 problems",
        errors=[FieldProblem(("body", "q"), "q is empty"), FieldProblem(("body", "k"), "bad k")],
    )
    assert str(err) == "422 Invalid request: 2 problems [body.q: q is empty; body.k: bad k]"


def test_a_body_over_the_advertised_limit_is_not_sent(app_client: TestClient) -> None:
    recorder = Recorder(app_client)
    big = _qkv(2048)  # 3 x 2048 x 64 float32: 1.5 MiB raw, 2 MiB in base64
    with SDPAClient("http://testserver", transport=recorder.transport()) as c:
        with pytest.raises(SDPAPayloadTooLarge) as ei:
            c.attention(*big)
        # The client asked the limit once, and sent no byte of the body.
        assert recorder.requests == [("GET", "/v1/info", 0)]
        assert c.max_body_bytes == LIMIT
        err = ei.value
        assert (err.status, err.attempts, err.limit_bytes) == (413, 0, LIMIT)
        assert err.body_bytes is not None
        assert err.body_bytes > LIMIT
        assert f"{err.body_bytes} bytes" in str(err)
        assert f"limit of {LIMIT} bytes" in str(err)
        assert "split it into smaller requests" in err.detail
        assert "encoding='base64'" not in err.detail  # it already was base64
        # Its truth: the same body, sent, is what the server refuses.
        sent = app_client.post(
            "/v1/attention", content=b"x" * err.body_bytes,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert sent.status_code == 413
        # A second large body does not ask again; a small one still goes through.
        with pytest.raises(SDPAPayloadTooLarge):
            c.attention(*big, encoding="json")
        assert [r[:2] for r in recorder.requests] == [("GET", "/v1/info")]
        small = c.attention(*_qkv(4, d=8))
        assert small.output is not None
        assert [r[:2] for r in recorder.requests][-1] == ("POST", "/v1/attention")


def test_json_lists_over_the_limit_are_told_base64(app_client: TestClient) -> None:
    recorder = Recorder(app_client)
    with SDPAClient("http://testserver", transport=recorder.transport()) as c:
        c.info()  # the caller asked: the client keeps the limit, and never asks itself
        with pytest.raises(SDPAPayloadTooLarge) as ei:
            c.attention(*_qkv(2048), encoding="json")
    assert [r[:2] for r in recorder.requests] == [("GET", "/v1/info")]
    assert "encoding='base64' is about 3x smaller" in ei.value.detail


def test_a_body_under_the_limit_is_sent_after_one_question() -> None:
    # A server whose limit (8 MiB) holds a body over SIZE_CHECK_FROM_BYTES (2 MiB of base64).
    roomy_settings = small_settings(
        max_body_bytes=8 << 20, max_elements=1 << 18, max_weights_elements=1 << 23
    )
    with in_process_client(roomy_settings) as roomy:
        recorder = Recorder(roomy)
        with SDPAClient("http://testserver", transport=recorder.transport()) as c:
            got = c.attention(*_qkv(2048))
            again = c.attention(*_qkv(2048))
        assert got.output is not None
        assert again.output is not None
        paths = [r[:2] for r in recorder.requests]
        assert paths == [("GET", "/v1/info"), ("POST", "/v1/attention"), ("POST", "/v1/attention")]


def test_a_server_that_does_not_say_is_asked_once_and_the_body_sent() -> None:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v1/info":
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(413, json={"title": "Payload too large", "detail": "too big"})

    with SDPAClient("http://testserver", transport=httpx.MockTransport(handle)) as c:
        for _ in range(2):
            with pytest.raises(SDPAPayloadTooLarge) as ei:
                c.attention(*_qkv(2048))
            assert ei.value.attempts == 1  # the server's own 413
    assert seen == ["GET /v1/info", "POST /v1/attention", "POST /v1/attention"]


def test_the_async_client_refuses_before_sending_too(app_client: TestClient) -> None:
    seen: list[tuple[str, int]] = []
    info = app_client.get("/v1/info").json()

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, len(request.content)))
        return httpx.Response(200, json=info)

    async def run() -> SDPAPayloadTooLarge:
        async with AsyncSDPAClient("http://testserver", transport=httpx.MockTransport(handle)) as c:
            with pytest.raises(SDPAPayloadTooLarge) as ei:
                await c.attention(*_qkv(2048))
            return ei.value

    err = asyncio.run(run())
    assert seen == [("/v1/info", 0)]
    assert err.limit_bytes == info["limits"]["max_body_bytes"] == LIMIT
