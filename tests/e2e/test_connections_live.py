"""Read and send timeouts and the connection cap against a real server (loopback only): idle,
trickling and stalled clients are dropped (a body below SDPA_MIN_BODY_RATE too), one that
reads nothing has its connection aborted, a connection past the cap closes the one waiting
longest without a request, and the server keeps answering everyone else. The header,
pipelining and shutdown bounds of the same layer are in test_protocol_limits_live.py."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from tests.support.attack import connect
from tests.support.live_server import LiveServer, live_server

# Long enough that a loaded CI machine opens all the trickling connections before the first
# one times out (the test counts them open together).
READ_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 1500
TRICKLERS = 1000
_BODY_TOO_SLOW = 'sdpa_rejected_total{reason="body_too_slow"}'
# One big request's working set (big_answer_request: inputs 0.8 MB, output and weights 67 MB,
# the base64 answer 90 MB twice while it is encoded) and body fit alone (about 238 MiB); beside
# another's unread 90 MB answer they do not.
MAX_INFLIGHT_BYTES = 280 * 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # Room for the trickling clients' sockets on both sides (the server inherits the limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 4 * TRICKLERS)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    env = {
        "SDPA_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
        "SDPA_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S),
        "SDPA_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "SDPA_MAX_INFLIGHT_BYTES": str(MAX_INFLIGHT_BYTES),
    }
    with live_server(env, tmp_path=tmp_path_factory.mktemp("connections")) as live:
        yield live
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_fds(server: LiveServer) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


def held_connections(server: LiveServer, client_ports: set[int]) -> int:
    """How many connections from these client ports the server holds a descriptor for.

    Counted by socket inode (the kernel's loopback table joined with the server's descriptors),
    so a probe's keep-alive connection that the server is still closing counts for nothing, as
    a raw descriptor count would have (one CI run waited for 1,015 descriptors and saw 1,014).
    """
    port = urlsplit(server.url).port
    inodes = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        if local_port == port and remote_port in client_ports:
            inodes.add(f"socket:[{fields[9]}]")
    fd_dir = Path(f"/proc/{server.process.pid}/fd")
    held = 0
    for fd in fd_dir.iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed while we looked
            held += os.readlink(fd) in inodes
    return held


def healthy(server: LiveServer) -> bool:
    started = time.monotonic()
    ok = httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
    return ok and time.monotonic() - started < 1.0


def test_an_idle_connection_gets_408_after_the_read_timeout(server: LiveServer) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        reply = sock.recv(65536)
        waited = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b"application/problem+json" in reply
    assert b"SDPA_READ_TIMEOUT_S" in reply
    assert READ_TIMEOUT_S - 0.1 <= waited <= READ_TIMEOUT_S + 1.0


def test_a_stalled_body_is_dropped_and_logged_as_499(server: LiveServer) -> None:
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/attention HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"q": ['
        )
        started = time.monotonic()
        assert sock.recv(65536) == b""  # closed, nothing to say to a request the app had
        assert time.monotonic() - started <= READ_TIMEOUT_S + 1.0
    time.sleep(0.2)
    log = server.log()
    assert '"status":499' in log.replace(" ", "")
    assert "Traceback" not in log


def test_a_body_trickled_below_the_minimum_rate_is_dropped_at_its_deadline(
    server: LiveServer,
) -> None:
    """A byte every 0.5 s never lets the idle timer (2 s) fire; before SDPA_MIN_BODY_RATE such a
    body held its connection for as long as the client liked, and the cap never closes one
    whose request the app holds. At the default 32 KiB/s, its deadline is about
    SDPA_READ_TIMEOUT_S after the app's first read: closed (499 in the log), counted."""
    slow = counter(httpx.get(f"{server.url}/metrics").text, _BODY_TOO_SLOW)
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/attention HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'X-Request-ID: trickled-body\r\nContent-Length: 1000\r\n\r\n{"q": ['
        )
        started = time.monotonic()
        closed_after = None
        sock.settimeout(0.5)
        while time.monotonic() - started < 4 * READ_TIMEOUT_S:  # bounded: 16 bytes at most
            try:
                sock.sendall(b" ")
                if sock.recv(65536) == b"":
                    closed_after = time.monotonic() - started
                    break
            except TimeoutError:
                continue  # nothing from the server yet: the next byte
            except OSError:  # reset: closed
                closed_after = time.monotonic() - started
                break
    assert closed_after is not None
    assert READ_TIMEOUT_S - 0.1 <= closed_after <= READ_TIMEOUT_S + 1.5
    time.sleep(0.2)
    assert access_record(server, "trickled-body")["status"] == 499
    assert counter(httpx.get(f"{server.url}/metrics").text, _BODY_TOO_SLOW) == slow + 1
    assert "Traceback" not in server.log()


def test_a_thousand_trickling_clients_are_dropped_and_their_descriptors_freed(
    server: LiveServer,
) -> None:
    baseline = open_fds(server)
    sockets = [connect(server) for _ in range(TRICKLERS)]
    ports = {sock.getsockname()[1] for sock in sockets}
    try:
        for sock in sockets:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")  # headers never finished
        # The server accepts the backlog over a few event-loop turns (under 1 s with three
        # CPU hogs on two cores), well before the first read timeout.
        accepted_by = time.monotonic() + READ_TIMEOUT_S
        while held_connections(server, ports) < TRICKLERS and time.monotonic() < accepted_by:
            time.sleep(0.05)
        assert held_connections(server, ports) == TRICKLERS
        assert healthy(server)  # everyone else is still served
        deadline = time.monotonic() + READ_TIMEOUT_S + 1.0
        replies = []
        for sock in sockets:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            replies.append(sock.recv(64))
        assert all(reply.startswith(b"HTTP/1.1 408 ") for reply in replies)
    finally:
        for sock in sockets:
            sock.close()
    time.sleep(0.5)
    assert held_connections(server, ports) == 0
    assert open_fds(server) <= baseline + 5  # nothing else leaked either
    assert healthy(server)


def test_a_connection_past_the_cap_closes_the_one_waiting_longest_and_is_served(
    server: LiveServer,
) -> None:
    """At the cap, a newcomer is admitted by closing the connection that waited longest without
    a request (408, naming the setting); a connection whose request the app holds is never
    closed for it, and the newcomer is refused only when every one is busy
    (test_protocol_limits_live.py)."""
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    ports = {sock.getsockname()[1] for sock in held}
    try:
        accepted_by = time.monotonic() + READ_TIMEOUT_S
        while held_connections(server, ports) < MAX_CONNECTIONS and time.monotonic() < accepted_by:
            time.sleep(0.05)
        assert held_connections(server, ports) == MAX_CONNECTIONS
        with connect(server) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            assert extra.recv(65536).startswith(b"HTTP/1.1 200 ")
        held[0].settimeout(5)
        evicted = held[0].recv(65536)  # the first accepted: it waited longest
        assert evicted.startswith(b"HTTP/1.1 408 ")
        assert b"SDPA_MAX_CONNECTIONS" in evicted
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert healthy(server)


def big_answer_request(request_id: str = "big") -> bytes:
    """Weights [1, 1, 4096, 4096] in base64: an 89 MB answer, far more than socket buffers hold."""
    x = np.random.default_rng(0).standard_normal((1, 1, 4096, 16)).astype(np.float32)
    tensor = {"dtype": "float32", "shape": list(x.shape), "b64": base64.b64encode(x).decode()}
    body = json.dumps({"q": tensor, "k": tensor, "v": tensor, "return_weights": True,
                       "diagnostics": "none"}).encode()  # fmt: skip
    return (
        b"POST /v1/attention HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"X-Request-ID: %s\r\nContent-Length: %d\r\n\r\n" % (request_id.encode(), len(body)) + body
    )


def access_record(server: LiveServer, request_id: str) -> dict[str, object]:
    """The access-log record of one request (the server logs JSON lines)."""
    for line in server.log().splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("logger") == "sdpa.access" and record.get("request_id") == request_id:
            return dict(record)
    raise AssertionError(f"no access-log line for {request_id}")


def test_a_client_that_reads_nothing_is_aborted_after_the_send_timeout(
    server: LiveServer,
) -> None:
    """...and its answer, which never reached it, is logged and counted as a 499."""
    metrics_before = httpx.get(f"{server.url}/metrics").text
    with connect(server) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(big_answer_request("never-read"))
        time.sleep(SEND_TIMEOUT_S + 3.0)  # read nothing
        assert healthy(server)
        received = 0
        sock.settimeout(10)
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
    assert 0 < received < 20_000_000  # cut off: what the buffers held, not the 89 MB
    assert access_record(server, "never-read")["status"] == 499
    aborted = 'sdpa_requests_total{route="/v1/attention",status="499",tenant="anonymous"}'
    assert counter(httpx.get(f"{server.url}/metrics").text, aborted) == (
        counter(metrics_before, aborted) + 1
    )
    assert "Traceback" not in server.log()


def counter(exposition: str, series: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_unsent_answers_count_in_flight_until_the_send_timeout_frees_them(
    server: LiveServer,
) -> None:
    """One client leaves its 89 MB answer unread. Another 89 MB answer would take the bytes in
    flight past the 280 MiB limit: that request gets 503 with Retry-After before it is
    computed, while a small one is served and probes answer. After the send timeout frees the
    unread answer, the big request is served too."""
    small = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}
    big = big_answer_request()
    big_body = big[big.index(b"\r\n\r\n") + 4 :]
    headers = {"content-type": "application/json"}
    with connect(server) as unread:
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        unread.sendall(big)
        statuses = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            response = httpx.post(
                f"{server.url}/v1/attention", content=big_body, headers=headers, timeout=60
            )
            statuses.append(response.status_code)
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                assert "SDPA_MAX_INFLIGHT_BYTES" in response.text
                assert httpx.post(f"{server.url}/v1/attention", json=small).status_code == 200
                assert healthy(server)
            elif 503 in statuses:
                break  # served again: the send timeout freed the unread answer
            time.sleep(0.2)
    assert 503 in statuses
    assert statuses[-1] == 200
