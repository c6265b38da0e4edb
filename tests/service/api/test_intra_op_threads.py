"""An app that owns its process (`serve`: create_app(own_process=True)) on the CPU gives
torch's intra-op threads to the device thread alone: the device thread keeps the count torch
chose, and every other thread (the event loop, anyio's decoding and encoding workers) gets 1, so
it runs its torch calls inline and starts no OpenMP team of its own (libgomp throttles every
team's spin once all teams hold more threads than the process has CPUs; BENCHMARKS.md). An app
inside another program leaves the counts alone.

Each case runs in a fresh interpreter: the counts are process-wide, and torch fixes a thread's
count at its first torch call.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.support.live_server import REPO_ROOT

PROBE = """
import json, threading
import torch
from fastapi.testclient import TestClient
from service.api.deps import state_of
from service.app import create_app
from tests.support.app import small_settings

chosen = torch.get_num_threads()
app = create_app(small_settings(), own_process={own_process})
with TestClient(app) as client:
    batcher = state_of(app).batcher
    device = client.portal.call(batcher.run_on_device, torch.get_num_threads)
    # A thread started now, as anyio starts its workers: its count is set at its first call.
    other = []
    worker = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    served = client.post("/v1/attention", json={{"q": [[1.0]], "k": [[1.0]], "v": [[2.0]]}})
print(json.dumps({{"chosen": chosen, "device": device, "other": other[0],
                  "status": served.status_code}}))
"""


def probe(own_process: bool) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(own_process=own_process)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


needs_two_threads = pytest.mark.skipif(
    torch.get_num_threads() < 2, reason="torch runs one intra-op thread here: nothing to give"
)


@needs_two_threads
@pytest.mark.slow  # a fresh interpreter
def test_an_app_that_owns_its_process_gives_the_threads_to_the_device_thread() -> None:
    counts = probe(own_process=True)
    assert counts["chosen"] >= 2
    assert counts["device"] == counts["chosen"]
    assert counts["other"] == 1
    assert counts["status"] == 200


@needs_two_threads
@pytest.mark.slow  # a fresh interpreter
def test_an_app_inside_another_program_leaves_the_counts_alone() -> None:
    counts = probe(own_process=False)
    assert counts["device"] == counts["other"] == counts["chosen"] >= 2
