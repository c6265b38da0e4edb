"""An idle server's clean shutdown says nothing alarming: started with the diagnostics kernel
compiled from a cold cache (a fresh TORCHINDUCTOR_CACHE_DIR: what a first `make serve` does),
ready, then stopped with SIGTERM, it exits 0 and logs no warning or error.

A cold compile once left inductor's pool of compile threads behind, idle but not daemonic, and
the exit reported "exiting with 1 threads still busy" (sdpa_core.stats_kernel compiles in its
own thread since). Slow: the compile takes tens of seconds, minutes on a loaded machine.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.support.live_server import live_server

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)
def test_an_idle_server_that_compiled_its_kernel_exits_quietly(tmp_path: Path) -> None:
    env = {"SDPA_COMPILE_KERNELS": "true", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    with live_server(env, tmp_path=tmp_path, ready_timeout=1000.0) as server:
        code = server.stop(signal.SIGTERM, timeout=60.0)
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    assert code == 0
    compiled = [line for line in lines if "diagnostics kernel compiled" in line["msg"]]
    assert compiled, "the kernel was not compiled: nothing was tested"
    loud = [line["msg"] for line in lines if line["level"] in {"warning", "error", "critical"}]
    assert loud == []
