"""What the end-to-end attack tests measure on a real server: its memory, its metrics and log,
and a bystander's experience while an attack runs."""

from __future__ import annotations

import multiprocessing
import socket
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.support.live_server import LiveServer

# The small request a bystander sends beside /healthz.
SMALL = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}


def connect(server: LiveServer, timeout: float = 10) -> socket.socket:
    """A raw TCP connection to the server, for what an HTTP client would refuse to send."""
    url = urlsplit(server.url)
    assert url.hostname is not None
    return socket.create_connection((url.hostname, url.port or 80), timeout=timeout)


def memory_kb(server: LiveServer) -> dict[str, int]:
    """The server's VmRSS and VmHWM (peak RSS) in kB."""
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return {
        name: int(value.split()[0])
        for name, value in (line.split(":", 1) for line in status.splitlines())
        if name in ("VmRSS", "VmHWM")
    }


def reset_peak(server: LiveServer) -> int:
    """Reset the server's VmHWM to its current RSS (Linux: clear_refs 5) -> that RSS in kB."""
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")
    return memory_kb(server)["VmHWM"]


def metric(server: LiveServer, series: str) -> float:
    """The value of one series of /metrics (`name{labels}` as written there), 0 when absent."""
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def assert_clean_log(server: LiveServer) -> None:
    """No 500 in the access log and no traceback anywhere in the server's output."""
    log = server.log()
    assert '"status":500' not in log
    assert "Traceback" not in log


def _probe(
    url: str,
    small: bool,
    every_s: float,
    stop: Event,
    results: Queue[tuple[float, list[int], list[int]]],
) -> None:
    """GET /healthz (and a small POST /v1/attention) every `every_s` until `stop` -> (the
    longest any one request took, the /healthz statuses, the small request's statuses)."""
    worst_s = 0.0
    health: list[int] = []
    smalls: list[int] = []
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            started = time.monotonic()
            health.append(client.get("/healthz").status_code)
            answered = time.monotonic()
            worst_s = max(worst_s, answered - started)
            if small:
                smalls.append(client.post("/v1/attention", json=SMALL).status_code)
                worst_s = max(worst_s, time.monotonic() - answered)
            stop.wait(every_s)
    results.put((worst_s, health, smalls))


class Bystander:
    """Another client, probing the server while an attack runs: GET /healthz and, with `small`,
    a small POST /v1/attention every `every_s`.

    It runs in a process of its own: in a thread of the test it would take turns for the GIL
    with the attacking client threads, and its latencies would be theirs, not the server's.
    After the block: `worst_s` (the longest any one of its requests took), `health` and
    `small` (the statuses).
    """

    def __init__(self, server: LiveServer, *, small: bool = True, every_s: float = 0.1) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results: Queue[tuple[float, list[int], list[int]]] = context.Queue()
        self._process = context.Process(
            target=_probe,
            args=(server.url, small, every_s, self._stop, self._results),
            daemon=True,
        )
        self.worst_s = 0.0
        self.health: list[int] = []
        self.small: list[int] = []

    def __enter__(self) -> Bystander:
        self._process.start()
        time.sleep(1.0)  # the spawned interpreter imports httpx before it probes
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)  # a few probes after the attack too
        self._stop.set()
        self.worst_s, self.health, self.small = self._results.get(timeout=60)
        self._process.join(timeout=30)

    def assert_served(self, within_s: float = 1.0) -> None:
        """Every probe answered 200, none slower than `within_s` (a second unless the caller
        says why the attack's own CPU work needs more on this machine)."""
        assert self.health
        assert set(self.health) | set(self.small) == {200}
        assert self.worst_s < within_s, f"a bystander's request took {self.worst_s:.2f} s"
