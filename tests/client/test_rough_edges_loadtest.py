"""sdpa-loadtest's rough edges of issue 29: nothing at --url fails within seconds (exit 1, the
URL named) while a run with some failures goes on; --help names the default URL and the
`plot` extra; the histogram has a log latency axis with log-spaced bins."""

from __future__ import annotations

import asyncio
import itertools
import math
import socket
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from sdpa_client.loadgen import LoadPlan, run_load
from sdpa_client.loadgen.report import histogram_figure, latency_bin_edges, write_histogram
from sdpa_client.loadtest import DEFAULT_URL, build_parser, main

CLIENT_PYPROJECT = Path(__file__).resolve().parents[2] / "sdpa_client" / "pyproject.toml"


def closed_port() -> int:
    """A port nothing listens on: bound by the OS a moment ago, then released."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_closed_port_fails_within_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    code = main(["--url", url, "--duration", "60", "--concurrency", "2", "--no-progress"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert elapsed < 10, f"took {elapsed:.1f} s of a 60 s run"
    assert f"target {url}" in err
    assert f"cannot connect to {url}" in err
    assert "ConnectError" in err


def _connect_error(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_an_open_loop_gives_up_too() -> None:
    async def send() -> int:
        raise httpx.ConnectError("refused")

    plan = LoadPlan(rate=200.0, duration_s=30.0, connect_give_up_s=0.2)
    started = time.monotonic()
    report = asyncio.run(run_load(send, plan))
    assert time.monotonic() - started < 5
    assert report.gave_up == "ConnectError"
    assert report.ok == 0
    assert report.sent > 0


def test_a_run_with_some_failures_keeps_going() -> None:
    # One HTTP answer (even an error status) proves the server is there: later connect
    # failures are counted, not a reason to stop.
    calls = 0

    async def send() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            return 503
        raise httpx.ConnectError("refused")

    plan = LoadPlan(duration_s=0.6, connect_give_up_s=0.1)
    started = time.monotonic()
    report = asyncio.run(run_load(send, plan))
    assert time.monotonic() - started >= 0.6
    assert report.gave_up is None
    assert report.errors["503"] == 1
    assert report.errors["ConnectError"] == report.sent - 1


def test_help_names_the_default_url_and_the_plot_extra() -> None:
    text = " ".join(build_parser().format_help().split())
    assert f"default {DEFAULT_URL}" in text
    assert "sdpa-client[plot]" in text
    extras = tomllib.loads(CLIENT_PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("matplotlib") for req in extras["plot"])


def test_a_missing_matplotlib_is_said_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError

    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing may be sent")

    with pytest.raises(SystemExit) as ei:
        main(["--histogram", "h.png", "--requests", "1"], transport=httpx.MockTransport(refuse))
    assert "sdpa-client[plot]" in str(ei.value.code)


def test_bin_edges_are_log_spaced_over_the_latencies() -> None:
    latencies = [2.0, 2.1, 2.2, 2.5, 3.0, 40.0, 800.0]
    edges = latency_bin_edges(latencies, 100)
    assert len(edges) == 101
    assert edges[0] == 2.0
    assert edges[-1] == 800.0
    ratios = [b / a for a, b in itertools.pairwise(edges)]
    assert all(math.isclose(r, (800.0 / 2.0) ** (1 / 100), rel_tol=1e-9) for r in ratios)
    # The bulk (2-3 ms) spreads over several bins, where 100 linear bins (7.98 ms wide) hold
    # it in one.
    bulk_bins = {sum(1 for e in edges if e <= x) for x in latencies[:5]}
    assert len(bulk_bins) >= 4
    width = (800.0 - 2.0) / 100
    assert len({int((x - 2.0) // width) for x in latencies[:5]}) == 1
    assert latency_bin_edges([], 10) == []
    one = latency_bin_edges([5.0], 4)
    assert one[0] < 5.0 < one[-1]


def test_the_histogram_is_written_with_a_log_axis(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={})

    path = tmp_path / "latency.png"
    code = main(
        ["--requests", "50", "--no-progress", "--histogram", str(path)],
        transport=httpx.MockTransport(answer),
    )
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    async def send() -> int:
        await asyncio.sleep(0)
        return 200

    report = asyncio.run(run_load(send, LoadPlan(requests=40)))
    fig = histogram_figure(report, title="t")
    try:
        assert fig.axes[0].get_xscale() == "log"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    write_histogram(report, tmp_path / "again.png", title="t")
    assert (tmp_path / "again.png").stat().st_size > 0
