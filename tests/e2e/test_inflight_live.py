"""SDPA_MAX_INFLIGHT_BYTES on a real server, against the bodies that passed it before: six
clients at once send JSON-list bodies (each reserved at what parsing it holds: its body, and
16 bytes a number once it is parsed in pieces) and the same gzip-compressed (no Content-Length
once inflated). What fits beside the others is served; the rest is refused mid-stream, before
it is parsed, with 503 (others hold the room); the server's peak RSS growth (VmHWM) stays
under twice the bound (the issue's check); a bystander's probes and small JSON requests keep
answering within a second; no 500 and no traceback in the log.

The figures at the issue's size (128 MiB bodies, a 512 MiB bound) are bench/attack_bodies.py
bodies-flood; here the bodies are 25 MB and the bound 128 MiB, for a CI run.
"""

from __future__ import annotations

import collections
import gzip
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.attack import Bystander, memory_kb, reset_peak
from tests.support.live_server import LiveServer, live_server

pytestmark = pytest.mark.slow

MB = 2**20
BOUND = 128 * MB
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # The work limit is what the device does in SDPA_MAX_COMPUTE_S as measured at warm-up: on a
    # loaded CI machine the measurement came out slow enough that a body's 26,000-row request
    # crossed it (a 422 "work" among the 503s). This test is about bytes in flight: room.
    env = {
        "SDPA_MAX_INFLIGHT_BYTES": str(BOUND),
        "SDPA_MAX_BODY_BYTES": str(32 * MB),
        "SDPA_MAX_COMPUTE_S": "120",
    }
    with live_server(env, tmp_path=tmp_path_factory.mktemp("inflight")) as live:
        yield live


def json_list_body(rows: int) -> bytes:
    """q, k, v [1, 1, rows, 64] as JSON lists of 0.5: 322 bytes a row, 5 bytes a number."""
    row = "[" + ", ".join(["0.5"] * 64) + "]"
    tensor = "[[[" + ", ".join([row] * rows) + "]]]"
    return f'{{"q": {tensor}, "k": {tensor}, "v": {tensor}}}'.encode()


def test_json_list_and_gzip_bodies_are_refused_before_they_are_parsed(
    server: LiveServer,
) -> None:
    body = json_list_body(26_000)  # 25 MB, under the 32 MiB body limit
    packed = gzip.compress(body)
    kinds = [(body, JSON), (packed, {**JSON, "content-encoding": "gzip"})]
    statuses: list[int] = []
    details: list[str] = []
    stop = time.monotonic() + 8.0

    def client(i: int) -> None:
        content, headers = kinds[i % 2]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for _ in range(30):
                if time.monotonic() > stop:
                    return
                response = http.post("/v1/attention", content=content, headers=headers)
                statuses.append(response.status_code)
                details.append(response.text[:300])

    log_before = server.log()
    with Bystander(server) as bystander:
        baseline_kb = reset_peak(server)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        growth = (memory_kb(server)["VmHWM"] - baseline_kb) * 1024
    assert statuses
    assert set(statuses) <= {200, 503}, collections.Counter(statuses)
    assert 503 in statuses  # refused because the others held the room
    refusals = [said for status, said in zip(statuses, details, strict=True) if status == 503]
    assert all("SDPA_MAX_INFLIGHT_BYTES" in said for said in refusals)
    assert growth < 2 * BOUND, f"peak RSS grew {growth / MB:.0f} MiB"
    bystander.assert_served()
    log = server.log()[len(log_before) :]
    assert '"status": 500' not in log
    assert '"status":500' not in log
    assert "Traceback" not in log
