"""SDPA_MAX_INFLIGHT_BYTES on a real server, against the bodies that passed it before: six
clients at once send JSON-list bodies (each would parse to about 10x its size) and the same
gzip-compressed (no Content-Length once inflated). Every one is refused before it is parsed,
mid-stream, with 422 (it could never fit) or 503 (others hold the room); the server's peak RSS
growth (VmHWM) stays under twice the bound (the issue's check); a bystander's probes and small
JSON requests keep answering within a second; no 500 and no traceback in the log.

The figures at the issue's size (128 MiB bodies, a 512 MiB bound) are bench/attack_bodies.py
bodies-flood; here the bodies are 25 MB and the bound 128 MiB, for a CI run.
"""

from __future__ import annotations

import collections
import gzip
import multiprocessing
import threading
import time
from collections.abc import Iterator
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import httpx
import pytest

from tests.support.live_server import LiveServer, live_server

pytestmark = pytest.mark.slow

MB = 2**20
BOUND = 128 * MB
SMALL = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_MAX_INFLIGHT_BYTES": str(BOUND), "SDPA_MAX_BODY_BYTES": str(32 * MB)}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("inflight")) as live:
        yield live


def peak_kb(server: LiveServer) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/PID/status")


def reset_peak(server: LiveServer) -> int:
    """Reset the server's VmHWM to its current RSS (Linux: clear_refs 5) -> that RSS in kB."""
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")
    return peak_kb(server)


def json_list_body(rows: int) -> bytes:
    """q, k, v [1, 1, rows, 64] as JSON lists of 0.5: 322 bytes a row, 5 bytes a number."""
    row = "[" + ", ".join(["0.5"] * 64) + "]"
    tensor = "[[[" + ", ".join([row] * rows) + "]]]"
    return f'{{"q": {tensor}, "k": {tensor}, "v": {tensor}}}'.encode()


def probe(url: str, stop: EventType, results: Queue[tuple[float, dict[int, int]]]) -> None:
    """/healthz and a small JSON-list request every 0.15 s until `stop` -> (the longest any one
    of them took, their statuses)."""
    worst_s = 0.0
    statuses: collections.Counter[int] = collections.Counter()
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            for method, path in (("GET", "/healthz"), ("POST", "/v1/attention")):
                started = time.monotonic()
                small = SMALL if method == "POST" else None
                statuses[client.request(method, path, json=small).status_code] += 1
                worst_s = max(worst_s, time.monotonic() - started)
            stop.wait(0.15)
    results.put((worst_s, dict(statuses)))


class Bystander:
    """Another client, in a process of its own: in a thread of this one it would take turns
    with the attacking threads for the GIL, and its latencies would be theirs."""

    def __init__(self, url: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results: Queue[tuple[float, dict[int, int]]] = context.Queue()
        self._process = context.Process(
            target=probe, args=(url, self._stop, self._results), daemon=True
        )
        self.worst_s = 0.0
        self.statuses: dict[int, int] = {}

    def __enter__(self) -> Bystander:
        self._process.start()
        time.sleep(1.0)  # the spawned interpreter imports httpx before it probes
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)  # a few probes after the attack too
        self._stop.set()
        self.worst_s, self.statuses = self._results.get(timeout=60)
        self._process.join(timeout=30)


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
    with Bystander(server.url) as bystander:
        baseline_kb = reset_peak(server)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        growth = (peak_kb(server) - baseline_kb) * 1024
    assert statuses
    assert set(statuses) <= {422, 503}, collections.Counter(statuses)
    assert 503 in statuses  # refused because the others held the room, not only alone
    assert all("SDPA_MAX_INFLIGHT_BYTES" in said for said in details)
    assert growth < 2 * BOUND, f"peak RSS grew {growth / MB:.0f} MiB"
    assert set(bystander.statuses) == {200}
    assert bystander.worst_s < 1.0
    log = server.log()[len(log_before) :]
    assert '"status": 500' not in log
    assert '"status":500' not in log
    assert "Traceback" not in log
