"""The resource attacks of the resources issue, reproduced against a real server with its default
limits: each is refused before compute (the status, the compute counter in /metrics, the
time), the server's peak RSS (VmHWM, reset before each attack) barely moves, and all along
/healthz and a small request from another client are answered within a second.

The slow, trickling, stalled and never-reading clients of the same issue are in
test_connections_live.py; here the dozen clients that never read their ~90 MB answers are
measured for memory: peak RSS growth under SDPA_MAX_INFLIGHT_BYTES and the memory returned
after the send timeout.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from tests.support.attack import SMALL, Bystander, memory_kb, reset_peak
from tests.support.live_server import LiveServer, live_server

pytestmark = pytest.mark.slow

MB = 2**20
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Default limits: the work limit is what this machine does in 10 s (measured at warm-up)."""
    with live_server({}, tmp_path=tmp_path_factory.mktemp("attacks")) as live:
        yield live


def computations(server: LiveServer) -> float:
    """How many computations the engine has run (sdpa_compute_seconds' counts, every path)."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("sdpa_compute_seconds_count"):
            total += float(line.split()[-1])
    return total


def tensor(n: int, d: int) -> dict[str, object]:
    x = np.random.default_rng(0).standard_normal((1, 1, n, d)).astype(np.float32)
    encoded = base64.b64encode(x.tobytes()).decode()
    return {"dtype": "float32", "shape": list(x.shape), "b64": encoded}


def qkv_body(n: int, d: int, **options: object) -> bytes:
    t = tensor(n, d)
    return json.dumps({"q": t, "k": t, "v": t, **options}).encode()


@dataclass(frozen=True)
class Attack:
    name: str
    path: str
    body: Callable[[], bytes]
    times: int  # sent this many at once
    status: int
    error_type: str  # the 4xx's errors[0].type
    names: str  # what the error's message must name


ATTACKS = [
    # 1 MB that held the device for 39 s with default diagnostics.
    Attack("work, summary", "/v1/attention", lambda: qkv_body(65536, 1), 1, 422,
           "work_limit", "SDPA_MAX_REQUEST_FLOPS"),
    # 16 MB that would hold it for about 7 minutes without diagnostics.
    Attack("work, none", "/v1/attention", lambda: qkv_body(2**20, 1, diagnostics="none"), 1,
           422, "work_limit", "SDPA_MAX_REQUEST_FLOPS"),
    # 78 bytes that allocated 1.6 GB before they were queued; ten at once reached 13.5 GB.
    Attack("synthetic amplification", "/v1/analyze",
           lambda: b'{"synthetic": {"n_q": 8192, "n_k": 8192, "d_k": 8192}}', 10, 422,
           "work_limit", "SDPA_MAX_REQUEST_FLOPS"),
    # 131 KB asking for a 954 MB JSON answer.
    Attack("response amplification", "/v1/attention",
           lambda: qkv_body(8192, 1, return_weights=True, diagnostics="full",
                            response_encoding="json"), 1, 422,
           "response_limit", "SDPA_MAX_RESPONSE_BYTES"),
]  # fmt: skip


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_each_attack_is_refused_before_compute_and_costs_no_memory(
    server: LiveServer, attack: Attack
) -> None:
    body = attack.body()
    computed_before = computations(server)
    with Bystander(server) as bystander:
        baseline_kb = reset_peak(server)
        started = time.monotonic()
        with ThreadPoolExecutor(attack.times) as pool:
            responses = list(
                pool.map(
                    lambda _: httpx.post(
                        f"{server.url}{attack.path}", content=body, headers=JSON, timeout=60
                    ),
                    range(attack.times),
                )
            )
        elapsed = time.monotonic() - started
        peak_growth_mb = (memory_kb(server)["VmHWM"] - baseline_kb) / 1024
    for response in responses:
        assert response.status_code == attack.status, response.text[:300]
        error = response.json()["errors"][0]
        assert error["type"] == attack.error_type
        assert attack.names in error["msg"]
    # Before compute: the engine ran only the bystander's small requests, and the refusal came
    # at parsing speed (the attacks would take from 39 s to minutes).
    assert computations(server) - computed_before == bystander.small.count(200)
    assert elapsed < 5.0
    # The body and decoded inputs at most (16 MB for the largest), never the work's memory.
    assert peak_growth_mb < 128, f"peak RSS grew {peak_growth_mb:.0f} MB"
    assert bystander.small
    assert set(bystander.health) == set(bystander.small) == {200}
    assert bystander.worst_s < 1.0


def test_a_dozen_clients_that_never_read_stay_under_the_in_flight_limit(
    tmp_path: Path,
) -> None:
    """SDPA_SEND_TIMEOUT_S=3, SDPA_MAX_INFLIGHT_BYTES=600 MiB: twelve clients ask at once for
    weights [1, 1, 4096, 4096] in base64 (89 MB each) and read nothing. The server's peak RSS
    grows by less than the limit, comes back after the send timeout, and a reading client and
    the probes are answered within a second throughout."""
    limit_mb = 600
    env = {"SDPA_SEND_TIMEOUT_S": "3", "SDPA_MAX_INFLIGHT_BYTES": str(limit_mb * MB)}
    with live_server(env, tmp_path=tmp_path) as server:
        url = urlsplit(server.url)
        assert url.hostname is not None
        body = qkv_body(4096, 16, return_weights=True, diagnostics="none")
        request = (
            b"POST /v1/attention HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        baseline_kb = reset_peak(server)
        unread: list[socket.socket] = []
        try:
            with Bystander(server) as bystander:
                for _ in range(12):
                    sock = socket.create_connection((url.hostname, url.port or 80), timeout=10)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
                    sock.sendall(request)
                    unread.append(sock)
                time.sleep(3 + 3)  # the send timeout, and time for the aborts to free memory
            peak_growth_mb = (memory_kb(server)["VmHWM"] - baseline_kb) / 1024
            rss_growth_mb = (memory_kb(server)["VmRSS"] - baseline_kb) / 1024
        finally:
            for sock in unread:
                sock.close()
        assert peak_growth_mb < limit_mb, f"peak RSS grew {peak_growth_mb:.0f} MB"
        assert rss_growth_mb < 64, f"RSS still {rss_growth_mb:.0f} MB above its baseline"
        # The reading client: every small request answered (200; 503 while memory is busy).
        assert bystander.small
        assert set(bystander.small) <= {200, 503}
        assert bystander.small[-1] == 200
        assert set(bystander.health) == {200}
        assert bystander.worst_s < 1.0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'sdpa_rejected_total{reason="inflight_bytes"}' in metrics


# -- the wrong or misleading answers of the hardening issue --------------------------------


def test_a_scale_that_is_infinite_in_float32_is_refused_not_answered_with_zeros(
    server: LiveServer,
) -> None:
    # Every q·k is positive: -1e308 (-inf in float32) made every score -inf, and the fused
    # path answered 200 with an output of zeros.
    x = [[1.0, 0.0], [2.0, 0.0]]
    for diagnostics in ("none", "summary"):
        body = {"q": x, "k": x, "v": x, "scale": -1e308, "diagnostics": diagnostics}
        response = httpx.post(f"{server.url}/v1/attention", json=body)
        assert response.status_code == 422, response.text
        assert response.json()["errors"][0]["loc"] == ["body", "scale"]


def test_tags_sent_in_a_stream_cannot_take_the_slots_of_tags_in_use(server: LiveServer) -> None:
    # The module's server keeps SDPA_HEALTH_MAX_TAGS at 256; 300 distinct tags arrive in turn
    # beside one tag in use. Tags in use keep their series, the others share "other", and no
    # slot is taken from a tag idle for less than 10 minutes.
    small = {**SMALL, "diagnostics": "summary"}
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for i in range(300):
            assert client.post("/v1/attention", json={**small, "tag": "in-use"}).status_code == 200
            assert client.post("/v1/attention", json={**small, "tag": f"t{i}"}).status_code == 200
        metrics = client.get("/metrics").text
    tags = set(re.findall(r'^sdpa_health_observations_total\{[^}]*tag="([^"]+)"', metrics, re.M))
    assert "in-use" in tags
    assert "other" in tags
    assert len(tags - {"other"}) <= 256
    assert re.search(r"^sdpa_health_tags_evicted_total 0\.0$", metrics, re.M)


def test_one_request_is_one_guess_of_the_api_key(tmp_path: Path) -> None:
    """90 keys in one request (the other header lines stay under SDPA_MAX_HEADERS, 100) are
    refused without trying any, even with the right key among them, and counted once; a refusal is
    labelled with its route."""
    with live_server({"SDPA_API_KEYS": "right-key"}, tmp_path=tmp_path) as keyed:
        headers = [("X-API-Key", f"guess-{i}") for i in range(89)] + [("X-API-Key", "right-key")]
        with httpx.Client(base_url=keyed.url, timeout=10) as client:
            refused = client.post("/v1/attention", json=SMALL, headers=headers)
            assert refused.status_code == 401
            assert refused.json()["detail"].startswith("90 API keys presented, none tried")
            one = client.post("/v1/attention", json=SMALL, headers={"X-API-Key": "right-key"})
            assert one.status_code == 200
            metrics = client.get("/metrics", headers={"X-API-Key": "right-key"}).text
        assert re.search(r'^sdpa_rejected_total\{reason="unauthorized"\} 1\.0$', metrics, re.M)
        refused = 'sdpa_requests_total{route="/v1/attention",status="401",tenant="anonymous"}'
        assert f"{refused} 1.0" in metrics
