"""`sdpa-service serve`'s ports on a real process: a gRPC port someone else holds stops start-up
at once with a message that names both ways out (another port, or no gRPC door), and each way
out works: --grpc-port serves the door where it says, --no-grpc serves HTTP alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.live_server import REPO_ROOT, free_port, live_server

tritongrpc = pytest.importorskip("tritonclient.grpc")

STARTUP_FAILURE = 3  # uvicorn's exit code for a start-up that failed


def test_a_taken_grpc_port_stops_start_up_naming_both_ways_out() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SDPA_")}
        env |= {"SDPA_DEVICE": "cpu", "SDPA_COMPILE_KERNELS": "false"}
        proc = subprocess.run(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(free_port()),
             "--grpc-port", str(port)],
            capture_output=True, text=True, timeout=180, cwd=REPO_ROOT, env=env,
        )  # fmt: skip
    assert proc.returncode == STARTUP_FAILURE, proc.stderr
    said = proc.stderr + proc.stdout
    assert str(port) in said
    assert "--grpc-port N, or SDPA_GRPC_PORT=N" in said  # another port
    assert "--no-grpc, or SDPA_GRPC_PORT=0" in said  # or none


def test_grpc_port_serves_the_door_there_and_no_grpc_serves_http_alone(tmp_path: Path) -> None:
    port = free_port()
    with live_server(tmp_path=tmp_path, extra_args=("--grpc-port", str(port))):
        client = tritongrpc.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert client.is_server_live()
        finally:
            client.close()
    with live_server(
        {"SDPA_GRPC_PORT": str(port)}, tmp_path=tmp_path, extra_args=("--no-grpc",)
    ) as server:
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there
        assert "grpc_port" not in server.log()
