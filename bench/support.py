"""What the benchmarks share: a free loopback port, a real `sdpa-service serve` to measure, and
the long requests the issue-15 benchmarks send it.

The benchmarks import nothing from tests/: they run from a checkout without the test suite.
"""

from __future__ import annotations

import base64
import collections
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import httpx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]

# A synthetic /v1/analyze of seconds of device time in a body of a few bytes: five chunked
# passes over 8192 x 8192 scores of d_k 128.
LONG_ANALYZE = {"synthetic": {"n_q": 8192, "n_k": 8192, "d_k": 128, "std": 1.0, "seed": 0}}


def long_attention_body() -> bytes:
    """q = k = v [1, 8, 8192, 16] with summary diagnostics (the chunked path): a 16 MB JSON
    body whose decoding competes with the compute for the cores."""
    x = np.random.default_rng(0).standard_normal((1, 8, 8192, 16)).astype(np.float32)
    b64 = base64.b64encode(x.tobytes()).decode()
    tensor = {"dtype": "float32", "shape": list(x.shape), "b64": b64}
    return json.dumps({"q": tensor, "k": tensor, "v": tensor, "diagnostics": "summary"}).encode()


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_ready(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Poll url/readyz until it answers 200; fail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        try:
            if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready within {timeout} s")
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} exited with {process.returncode}")


@dataclass(frozen=True)
class BenchServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


# The code the benchmarks serve unless they name a tree: this checkout's, or another one's
# (bench/attacks.py --tree) for before-and-after figures.
_served_tree = REPO_ROOT


def serve_from(tree: Path) -> None:
    """Serve `tree` (a worktree of another commit, run with this .venv) from now on."""
    global _served_tree
    _served_tree = tree.resolve()


@contextmanager
def live_server(
    env: Mapping[str, str],
    *,
    tmp_path: Path,
    tree: Path | None = None,
    ready_timeout: float = 90.0,
) -> Iterator[BenchServer]:
    """`python -m service.cli serve` on a free port with SDPA_* settings from `env` (the rest of
    SDPA_* cleared); its output goes to a log file in tmp_path. Stopped with SIGTERM.

    `tree`: the code to serve (cwd and PYTHONPATH); None: serve_from's, this checkout's unless
    it was told otherwise."""
    tree = _served_tree if tree is None else tree
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SDPA_")}
    # The tree first, then whatever PYTHONPATH already says (packages installed beside it).
    python_path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    # The gRPC door off unless asked for: servers side by side would all take port 8001.
    child_env.update(
        {"SDPA_DEVICE": "cpu", "SDPA_GRPC_PORT": "0", "PYTHONPATH": python_path, **env}
    )
    command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    log_path = tmp_path / f"server-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=tree, env=child_env, stdout=log, stderr=subprocess.STDOUT
        )
    server = BenchServer(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    try:
        wait_until_ready(server.url, process, timeout=ready_timeout)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextmanager
def attacked_server(env: Mapping[str, str], *, tree: Path | None = None) -> Iterator[BenchServer]:
    """live_server() with its log in a temporary directory of its own."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server(env, tmp_path=Path(tmp), tree=tree) as server,
    ):
        yield server


# ---- what the attack benchmarks measure --------------------------------------------------


def memory_mb(server: BenchServer) -> dict[str, float]:
    """The server's VmRSS and VmHWM (peak RSS) in MiB."""
    fields = {}
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            name, value = line.split(":")
            fields[name] = int(value.split()[0]) / 1024
    return fields


def reset_peak(server: BenchServer) -> float:
    """Reset the server's VmHWM to its RSS now (Linux: clear_refs 5) -> that RSS in MiB."""
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")
    return memory_mb(server)["VmHWM"]


def metric(server: BenchServer, prefix: str, *, headers: dict[str, str] | None = None) -> float:
    """The sum of the /metrics samples whose line starts with `prefix` (`headers`: an API key)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10, headers=headers).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def log_summary(log: str) -> str:
    """The 500s in the access log and the tracebacks in the server's output."""
    answers_500 = len(re.findall(r'"status": ?500\b', log))
    return f"log: {answers_500} answers 500, {log.count('Traceback')} tracebacks"


SMALL = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}
# What a bystander saw: its latencies (ms), its statuses, the requests that got no answer.
Probed = tuple[list[float], dict[int, int], int]


def _probe(
    url: str,
    headers: dict[str, str],
    small: bool,
    every_s: float,
    stop: EventType,
    results: Queue[Probed],
) -> None:
    """GET /healthz (and a small POST /v1/attention) every `every_s` seconds until `stop`."""
    latencies_ms: list[float] = []
    statuses: collections.Counter[int] = collections.Counter()
    failures = 0
    requests = [("GET", "/healthz", None)] + ([("POST", "/v1/attention", SMALL)] if small else [])
    with httpx.Client(base_url=url, timeout=10, headers=headers) as client:
        while not stop.is_set():
            for method, path, body in requests:
                started = time.perf_counter()
                try:
                    statuses[client.request(method, path, json=body).status_code] += 1
                except httpx.HTTPError:
                    failures += 1
                latencies_ms.append((time.perf_counter() - started) * 1e3)
            stop.wait(every_s)
    results.put((latencies_ms, dict(statuses), failures))


class Bystander:
    """Another client while an attack runs: GET /healthz and, with `small`, a small
    POST /v1/attention every `every_s`. In a process of its own: the attack's client threads
    would otherwise take turns with it for this process's GIL, and its latencies would be
    theirs."""

    def __init__(
        self,
        url: str,
        *,
        small: bool = True,
        every_s: float = 0.15,
        headers: dict[str, str] | None = None,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results: Queue[Probed] = context.Queue()
        self._process = context.Process(
            target=_probe,
            args=(url, headers or {}, small, every_s, self._stop, self._results),
            daemon=True,
        )
        self.latencies_ms: list[float] = []
        self.statuses: dict[int, int] = {}
        self.failures = 0

    def __enter__(self) -> Bystander:
        self._process.start()
        time.sleep(1.0)  # the spawned interpreter imports httpx before it probes
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.5)  # a few probes after the attack too
        self._stop.set()
        self.latencies_ms, self.statuses, self.failures = self._results.get(timeout=60)
        self._process.join(timeout=30)

    def summary(self) -> str:
        ms = sorted(self.latencies_ms) or [float("nan")]
        p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        return (
            f"bystander: {len(self.latencies_ms)} requests, p50 {ms[len(ms) // 2]:.0f} ms, "
            f"p99 {p99:.0f} ms, max {ms[-1]:.0f} ms, statuses {self.statuses}, "
            f"no answer {self.failures}"
        )
