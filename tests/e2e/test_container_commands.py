"""The image's CMD and HEALTHCHECK, parsed from the Dockerfile as written, run as real processes.

This is the fast check, without building the image (tests/deploy/test_container.py builds it and
runs the same commands inside it, where buildah and root are available). The commands run on
this machine with what the image sets up around them: PATH starts with the environment that
holds `sdpa-service` (the image's /opt/venv and /opt/app are this checkout's .venv) and the final
stage's ENV (SDPA_PORT, SDPA_DRAIN_TIMEOUT_S, ...).

One deliberate change: the CMD binds --host 0.0.0.0, which a container needs (its loopback is
its own), but a test process must not listen on every interface of a shared machine. The test
swaps that one value for 127.0.0.1 after checking it is 0.0.0.0; everything else runs as
written. The port comes from SDPA_PORT (a free one), which also exercises the healthcheck's
default URL: it must find the server through SDPA_PORT alone, exactly as in the image.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.dockerfile_parser import cmd, final_stage, healthcheck
from tests.support.live_server import free_port


def _image_like_env(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDPA_")}
    for key, value in final_stage().env().items():
        if key in {"PATH", "HOME"}:
            continue  # the image's paths; PATH is set below, HOME stays the test's
        env[key] = value
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["SDPA_PORT"] = str(port)
    env["SDPA_DEVICE"] = "cpu"
    return env


def _resolve(argv: list[str], env: dict[str, str]) -> list[str]:
    program = shutil.which(argv[0], path=env["PATH"])
    if program is None:
        pytest.fail(f"{argv[0]!r} is not installed in {env['PATH'].split(os.pathsep)[0]}")
    return [program, *argv[1:]]


def _on_loopback(argv: list[str]) -> list[str]:
    index = argv.index("--host")
    assert argv[index + 1] == "0.0.0.0"  # what the container needs
    return [*argv[: index + 1], "127.0.0.1", *argv[index + 2 :]]


def _run_healthcheck(argv: list[str], env: dict[str, str], timeout_s: float) -> int:
    proc = subprocess.run(argv, env=env, capture_output=True, timeout=timeout_s, check=False)
    return proc.returncode


def test_cmd_serves_and_healthcheck_tells_ready_from_down(tmp_path: Path) -> None:
    stage = final_stage()
    options, health_argv = healthcheck(stage)
    health_timeout = float(options["timeout"].rstrip("s"))
    port = free_port()
    env = _image_like_env(port)
    serve_argv = _resolve(_on_loopback(cmd(stage)), env)
    health_argv = _resolve(health_argv, env)

    # Nothing listens yet: unhealthy.
    assert _run_healthcheck(health_argv, env, health_timeout + 10) != 0

    log_path = tmp_path / "cmd.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            serve_argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        # Docker's view: poll the HEALTHCHECK command until it passes (bounded).
        deadline = time.monotonic() + 120
        healthy = False
        while not healthy and time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()
            healthy = _run_healthcheck(health_argv, env, health_timeout + 10) == 0
            if not healthy:
                time.sleep(0.2)
        assert healthy, log_path.read_text()[-3000:]
        # Independent truth: the server on SDPA_PORT is ready and computes.
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        response = httpx.post(
            f"{url}/v1/attention",
            json={"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[2.5, -1.0]], "diagnostics": "none"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        # The image's STOPSIGNAL ends it cleanly.
        stop = stage.last("STOPSIGNAL")
        assert stop is not None
        process.send_signal(getattr(signal, stop.args))
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)

    # Down again: unhealthy.
    assert _run_healthcheck(health_argv, env, health_timeout + 10) != 0
    # It served on the loopback address only, on SDPA_PORT.
    assert f"127.0.0.1:{port}" in log_path.read_text()
