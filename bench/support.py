"""What the benchmarks share: a free loopback port, a real `sdpa-service serve` to measure, and
the long requests the issue-15 benchmarks send it.

The benchmarks import nothing from tests/: they run from a checkout without the test suite.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
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


@contextmanager
def live_server(env: Mapping[str, str], *, tmp_path: Path) -> Iterator[BenchServer]:
    """`python -m service.cli serve` on a free port with SDPA_* settings from `env` (the rest of
    SDPA_* cleared); its output goes to a log file in tmp_path. Stopped with SIGTERM."""
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SDPA_")}
    child_env.update({"SDPA_DEVICE": "cpu", **env})
    command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    with (tmp_path / f"server-{port}.log").open("wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT
        )
    server = BenchServer(url=f"http://127.0.0.1:{port}", process=process)
    try:
        wait_until_ready(server.url, process, timeout=90.0)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
