"""A real `sdpa-service serve` process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait for the exit code (kills after `timeout`)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return int(self.process.returncode)


def wait_until_ready(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server at {url} not ready within {timeout} s")


@contextmanager
def live_server(
    env: Mapping[str, str] | None = None,
    *,
    tmp_path: Path,
    ready_timeout: float = 90.0,
    extra_args: tuple[str, ...] = (),
    port: int | None = None,
) -> Iterator[LiveServer]:
    """Start `python -m service.cli serve` on a free port with SDPA_* settings from `env`.

    The server's stdout and stderr go to tmp_path/server-PORT.log (read it with .log()). `port`:
    a given port (to start a replica again where it was), else a free one.
    """
    port = free_port() if port is None else port
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SDPA_")}
    child_env.update(env or {})
    child_env.setdefault("SDPA_DEVICE", "cpu")
    # Compiling the diagnostics kernel takes seconds per process: the servers of the tests
    # that do not test it run the eager loop (the same numbers; tests/e2e/test_kernel.py
    # serves with it).
    child_env.setdefault("SDPA_COMPILE_KERNELS", "false")
    # The gRPC door would take Triton's port 8001 in every server a test starts, side by side:
    # off unless the test gives it a port of its own.
    child_env.setdefault("SDPA_GRPC_PORT", "0")
    log_path = tmp_path / f"server-{port}.log"
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port), *extra_args],
            cwd=REPO_ROOT,
            env=child_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = LiveServer(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    try:
        wait_until_ready(server.url, process, ready_timeout)
        yield server
    finally:
        server.stop(signal.SIGTERM, timeout=30.0)
