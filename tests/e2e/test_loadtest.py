"""sdpa-loadtest: the run core with fake senders, and the CLI against a real server."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sdpa_client.loadgen import LatencySummary, LoadPlan, LoadReport, Sender, run_load
from tests.support.live_server import REPO_ROOT, LiveServer, live_server

pytestmark = pytest.mark.xdist_group("loadtest-live")


def cycling_sender(statuses: list[int]) -> Sender:
    cycle = itertools.cycle(statuses)

    async def send() -> int:
        await asyncio.sleep(0)
        return next(cycle)

    return send


def assert_consistent(report: LoadReport) -> None:
    assert report.sent == len(report.records)
    assert report.sent == report.ok + sum(report.errors.values())
    assert report.ok == sum(1 for r in report.records if r.error is None)
    lat = report.latency
    assert lat.min_ms <= lat.p50_ms <= lat.p90_ms <= lat.p99_ms <= lat.max_ms


# ---- the core, with fake senders ---------------------------------------------------------------


def test_closed_loop_counts_statuses_and_stops_at_the_request_bound() -> None:
    plan = LoadPlan(concurrency=4, requests=30, duration_s=30.0)
    report = asyncio.run(run_load(cycling_sender([200, 200, 503]), plan))
    assert report.mode == "closed"
    assert report.sent == 30
    assert report.ok == 20
    assert dict(report.errors) == {"503": 10}
    assert_consistent(report)


def test_transport_errors_and_timeouts_are_counted_by_kind() -> None:
    calls = itertools.count()

    async def send() -> int:
        n = next(calls)
        if n % 3 == 0:
            raise httpx.ConnectError("refused")
        if n % 3 == 1:
            await asyncio.sleep(30)  # cut by the plan's per-request timeout
        return 200

    plan = LoadPlan(concurrency=3, requests=9, duration_s=30.0, timeout_s=0.05)
    report = asyncio.run(run_load(send, plan))
    assert dict(report.errors) == {"ConnectError": 3, "timeout": 3}
    assert report.ok == 3
    assert {r.status for r in report.records if r.error is not None} == {0}
    assert_consistent(report)


def test_open_loop_drops_arrivals_beyond_the_in_flight_bound() -> None:
    async def main() -> LoadReport:
        gate = asyncio.Event()

        async def send() -> int:
            await gate.wait()  # every admitted request hangs until the arrivals are over
            return 200

        plan = LoadPlan(rate=5000.0, max_in_flight=5, requests=60, duration_s=30.0, seed=1)
        task = asyncio.create_task(run_load(send, plan))
        # 60 arrivals at 5000/s take ~12 ms; then let the 5 admitted requests finish.
        await asyncio.sleep(0.5)
        gate.set()
        return await task

    report = asyncio.run(main())
    assert report.mode == "open"
    assert report.sent == 5
    assert report.dropped == 55
    assert report.ok == 5
    assert_consistent(report)


def test_latency_percentiles_match_hand_computed_values() -> None:
    lat = LatencySummary.of([i / 1000 for i in range(1, 101)])  # 1..100 ms
    # numpy's default (linear) interpolation: rank p/100 * (n - 1) between sorted samples.
    assert lat.p50_ms == pytest.approx(50.5)
    assert lat.p90_ms == pytest.approx(90.1)
    assert lat.p99_ms == pytest.approx(99.01)
    assert (lat.min_ms, lat.max_ms, lat.count) == (pytest.approx(1.0), pytest.approx(100.0), 100)


def test_a_plan_must_end() -> None:
    with pytest.raises(ValueError, match="must end"):
        LoadPlan(concurrency=2)


# ---- the CLI against a real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path=tmp_path_factory.mktemp("loadtest-server")) as srv:
        yield srv


def loadtest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sdpa_client.loadtest", "--no-progress", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_closed_loop_cli_report_files(server: LiveServer, tmp_path: Path) -> None:
    out_json, out_csv, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "h.png"
    proc = loadtest(
        "--url", server.url, "--preset", "small", "--concurrency", "4", "--duration", "1",
        "--requests", "300", "--warmup", "5", "--json", str(out_json), "--csv", str(out_csv),
        "--histogram", str(png),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    document = json.loads(out_json.read_text())
    report = document["report"]
    assert report["mode"] == "closed"
    assert report["ok"] > 0
    assert report["sent"] == report["ok"] + sum(report["errors"].values())
    assert report["sent"] <= 300
    lat = report["latency"]
    assert lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    assert report["client_cpu_percent"] > 0
    assert document["target"]["body_bytes"] > 3 * 4 * 64 * 64 * 4  # q, k, v as base64
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == report["sent"]
    assert sum(1 for r in rows if r["error"] == "") == report["ok"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"sent        {report['sent']}" in proc.stdout


def test_open_loop_cli_json_to_stdout(server: LiveServer) -> None:
    proc = loadtest(
        "--url", server.url, "--preset", "small", "--encoding", "json", "--rate", "30",
        "--duration", "1", "--json", "-",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["report"]
    assert report["mode"] == "open"
    assert report["ok"] > 0
    assert report["sent"] == report["ok"] + sum(report["errors"].values())
    lat = report["latency"]
    assert lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    assert "latency ms" in proc.stderr  # the human report moves to stderr


def test_http_errors_are_reported_by_status(server: LiveServer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"q": [[1.0, 2.0]], "k": [[1.0, 2.0, 3.0]], "v": [[1.0]]}))
    proc = loadtest("--url", server.url, "--request-file", str(bad), "--requests", "5",
                    "--concurrency", "1", "--json", "-")  # fmt: skip
    assert proc.returncode == 1  # nothing succeeded
    report = json.loads(proc.stdout)["report"]
    assert report["errors"] == {"422": 5}
    assert report["latency"]["p50_ms"] is None
