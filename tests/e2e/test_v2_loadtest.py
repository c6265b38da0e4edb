"""`sdpa-loadtest --protocol v2` against a real server: every request a 200, and the body the
binary extension's size (the raw bytes of q, k and v plus a JSON header: no base64)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.live_server import REPO_ROOT, LiveServer, live_server

pytestmark = pytest.mark.xdist_group("v2-loadtest")

SMALL_QKV_BYTES = 3 * 4 * 64 * 64 * 4  # the small preset: q, k, v [1, 4, 64, 64] float32


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path=tmp_path_factory.mktemp("v2-loadtest")) as srv:
        yield srv


def loadtest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sdpa_client.loadtest", "--no-progress", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("encoding", ["base64", "json"])
def test_loadtest_over_v2(server: LiveServer, encoding: str) -> None:
    proc = loadtest(
        "--url", server.url, "--protocol", "v2", "--preset", "small", "--encoding", encoding,
        "--concurrency", "4", "--requests", "40", "--json", "-",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    report = document["report"]
    assert report["sent"] == report["ok"] == 40, report["errors"]
    body_bytes = document["target"]["body_bytes"]
    if encoding == "base64":  # binary data: the raw bytes and a header of a few hundred bytes
        assert SMALL_QKV_BYTES < body_bytes < SMALL_QKV_BYTES + 1024
    else:
        assert body_bytes > 2 * SMALL_QKV_BYTES  # JSON lists: longer than the bytes
    assert "/v2/models/attention/infer" in proc.stderr + proc.stdout + json.dumps(document)
