"""Body limits on a real socket: a chunked body is cut while it streams in, a huge declared
Content-Length is refused after the headers alone, and numbers and codings in headers are read
as the server's HTTP parser hands them on."""

from __future__ import annotations

import gzip
import json
import select
import socket
import time
import zlib
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.app import API_SERVER_ENV
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.xdist_group("api_server")

MAX_BODY = int(API_SERVER_ENV["SDPA_MAX_BODY_BYTES"])


@pytest.fixture(scope="module")
def session(api_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_server.url, timeout=60.0) as c:
        yield c


def test_a_streamed_body_is_cut_at_the_limit(session: httpx.Client) -> None:
    """No Content-Length (chunked): the server counts while reading and answers 413."""
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        chunk = b" " * 65536
        for _ in range(2 * MAX_BODY // len(chunk)):  # twice the limit, then stop
            sent += len(chunk)
            yield chunk

    response = session.post(
        "/v1/attention", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["errors"][0]["loc"] == ["body"]
    assert session.get("/healthz").status_code == 200


def test_a_huge_declared_body_is_refused_before_it_is_sent(api_server: LiveServer) -> None:
    """A 1 GB Content-Length gets its 413 after the headers alone: nothing is read first."""
    url = urlsplit(api_server.url)
    assert url.hostname is not None
    with socket.create_connection((url.hostname, url.port or 80), timeout=10) as sock:
        head = (
            f"POST /v1/attention HTTP/1.1\r\nHost: {url.netloc}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{"
        )
        sock.sendall(head.encode())
        deadline = time.monotonic() + 10
        reply = b""
        while b"\r\n\r\n" not in reply and time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0.5)
            if readable:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
    status_line = reply.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"application/problem+json" in reply
    assert httpx.get(f"{api_server.url}/healthz").status_code == 200


def raw_post(api_server: LiveServer, headers: list[str], body: bytes) -> tuple[bytes, bytes]:
    """POST /v1/attention with header lines as written (ones an HTTP client would not write),
    on its own connection -> (the status line, the response body)."""
    url = urlsplit(api_server.url)
    assert url.hostname is not None
    head = ["POST /v1/attention HTTP/1.1", f"Host: {url.netloc}", "Connection: close",
            "Content-Type: application/json", *headers]  # fmt: skip
    with socket.create_connection((url.hostname, url.port or 80), timeout=10) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        reply = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head_bytes, _, said = reply.partition(b"\r\n\r\n")
    return head_bytes.split(b"\r\n", 1)[0], said


SMALL_BODY = b'{"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}'


def test_numbers_and_codings_in_headers_as_a_real_parser_passes_them(
    api_server: LiveServer,
) -> None:
    """llhttp (httptools) passes a Content-Length of 5,000 leading zeros on (they never
    overflow its count), and two Content-Encoding headers as two: the first was a 500 (int()
    refuses strings past 4,300 digits), the second read as the last header alone (a 422)."""
    log_before = api_server.log()
    plain = httpx.post(f"{api_server.url}/v1/attention", content=SMALL_BODY, headers={
        "content-type": "application/json"}).json()["output"]  # fmt: skip
    status, said = raw_post(api_server, [f"Content-Length: {'0' * 5000}{len(SMALL_BODY)}"],
                            SMALL_BODY)  # fmt: skip
    assert status == b"HTTP/1.1 200 OK", said[:300]
    assert json.loads(said)["output"] == plain
    packed = gzip.compress(zlib.compress(SMALL_BODY))
    two = ["Content-Encoding: deflate", "Content-Encoding: gzip", f"Content-Length: {len(packed)}"]
    status, said = raw_post(api_server, two, packed)
    assert status == b"HTTP/1.1 200 OK", said[:300]
    assert json.loads(said)["output"] == plain
    members = gzip.compress(SMALL_BODY[:20]) + gzip.compress(SMALL_BODY[20:])
    status, said = raw_post(
        api_server, ["Content-Encoding: gzip", f"Content-Length: {len(members)}"], members
    )
    assert status == b"HTTP/1.1 200 OK", said[:300]
    assert json.loads(said)["output"] == plain
    log = api_server.log()[len(log_before) :]
    assert "Traceback" not in log
