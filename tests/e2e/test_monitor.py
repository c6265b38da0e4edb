"""`make monitor`, attention health on one machine: the command itself, as documented
(docs/monitoring.md), runs Debian's `prometheus` against a live server with the project's rules
and alerts loaded, and a health series of the requests it served comes back from a query.

The truth: requests of known attention (q = 0: every row uniform over its keys, so each head's
normalized entropy is exactly 1), counted by hand; the rule names of deploy/monitoring's
sdpa.rules.yml. Skips without the prometheus binary (Debian: apt-get install prometheus; CI's
.ci/run installs it) or `make`.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from tests.support.live_server import REPO_ROOT, LiveServer, free_port, live_server

RULES = REPO_ROOT / "deploy" / "monitoring" / "sdpa.rules.yml"
TAG = "newcomer"
HEADS, REQUESTS = 2, 3


def tensor(array: np.ndarray[Any, Any]) -> dict[str, Any]:
    data = np.ascontiguousarray(array, dtype="<f4")
    return {"dtype": "float32", "shape": list(data.shape), "b64": base64.b64encode(data).decode()}


@contextmanager
def make_monitor(repo: Path, target: str, tmp: Path) -> Iterator[str]:
    """`make monitor` in `repo`, scraping `target`, listening on a free port -> its URL."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    listen = f"127.0.0.1:{free_port()}"
    log = tmp / "monitor.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["make", "--no-print-directory", "monitor", f"MONITOR_TARGET={target}",
             f"MONITOR_LISTEN={listen}", f"MONITOR_DIR={tmp / 'monitor'}"],
            cwd=repo, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://{listen}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(log.read_text(encoding="utf-8"))
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def query(prometheus: str, expr: str, *, until: float = 60.0) -> list[dict[str, Any]]:
    """`expr`'s instant vector, waiting (scrapes are 5 s apart) until it is not empty."""
    deadline = time.monotonic() + until
    while True:
        response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10.0)
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()["data"]["result"]
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def uniform_requests(url: str) -> None:
    """REQUESTS requests of HEADS heads whose every row is uniform (q = 0), tagged TAG."""
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((1, HEADS, 5, 8)) for _ in range(2))
    body = {
        "q": tensor(np.zeros((1, HEADS, 4, 8))),
        "k": tensor(k),
        "v": tensor(v),
        "diagnostics": "summary",
        "tag": TAG,
    }
    for _ in range(REQUESTS):
        response = httpx.post(f"{url}/v1/attention", json=body, timeout=60.0)
        assert response.status_code == 200, response.text
        assert response.json()["diagnostics"]["summary"]["normalized_entropy"] == pytest.approx(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {"SDPA_HEALTH_SAMPLE_RATE": "0"}  # only the requests that ask feed the histograms
    with live_server(env, tmp_path=tmp_path_factory.mktemp("monitor_server")) as running:
        yield running


def test_make_monitor_watches_a_live_server_with_the_rules_loaded(
    server: LiveServer, tmp_path: Path
) -> None:
    uniform_requests(server.url)
    with make_monitor(REPO_ROOT, server.url.removeprefix("http://"), tmp_path) as prometheus:
        up = query(prometheus, 'up{job="sdpa-service"} == 1')
        assert [sample["metric"]["instance"] for sample in up] == [
            server.url.removeprefix("http://")
        ]
        # One observation per head of each request; every one of them exactly 1 (uniform rows).
        count = query(prometheus, f'sdpa_attention_entropy_normalized_count{{tag="{TAG}"}}')
        assert [float(sample["value"][1]) for sample in count] == [HEADS * REQUESTS]
        total = query(prometheus, f'sdpa_attention_entropy_normalized_sum{{tag="{TAG}"}}')
        assert float(total[0]["value"][1]) == pytest.approx(HEADS * REQUESTS, rel=1e-6)
        below = query(
            prometheus, f'sdpa_attention_entropy_normalized_bucket{{tag="{TAG}",le="0.95"}}'
        )
        assert float(below[0]["value"][1]) == 0
        # The project's rules and alerts, every one of them, loaded and evaluated.
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10.0).json()["data"]["groups"]
        loaded = {rule["name"] for group in groups for rule in group["rules"]}
        written = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
        names = {rule.get("alert") or rule["record"] for g in written for rule in g["rules"]}
        assert loaded == names
        assert all(rule["health"] != "err" for g in groups for rule in g["rules"])
