"""sdpa_backlog_seconds while one long request computes, against the time it really had left.

A real server (`python -m service.cli serve`, CPU, default settings) gets 20 tiny requests as
warm-up, then long requests one at a time, each alone on the device:

- analyze: a synthetic /v1/analyze (8192 x 8192 scores, d_k 128; five chunked passes);
- attention: q = k = v [1, 8, 8192, 16] with summary diagnostics (the chunked path; a 16 MB
  body).

While each computes, /metrics is read every --every seconds. Once it is answered, each reading
is set against the time that was really left then (the answer's arrival minus the reading's
time). A long request's steps on the CPU stop at a time budget, so they may outnumber the tiles
its plan counted: the backlog must follow the run's own progress (share_done), not the plan.

Readings before the request is admitted (its body still arriving or being decoded) are left
out. Writes bench/results/long_backlog.json and long_backlog.md.

    .venv/bin/python bench/long_backlog.py            # about a minute on 2 cores
    .venv/bin/python bench/long_backlog.py --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import LONG_ANALYZE, live_server, long_attention_body  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
TINY = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0]], "v": [[1.0, 2.0]]}
# Readings with less than this left are rounding: the gauge is set between tiles.
MIN_LEFT_S = 0.3


def long_requests() -> dict[str, tuple[str, bytes]]:
    """name -> (route, JSON body)."""
    return {
        "analyze": ("/v1/analyze", json.dumps(LONG_ANALYZE).encode()),
        "attention": ("/v1/attention", long_attention_body()),
    }


def backlog_gauge(client: httpx.Client, url: str) -> float:
    match = re.search(r"^sdpa_backlog_seconds (\S+)$", client.get(f"{url}/metrics").text, re.M)
    assert match is not None, "no sdpa_backlog_seconds on /metrics"
    return float(match.group(1))


def one_run(url: str, route: str, body: bytes, every_s: float) -> dict[str, Any]:
    """One long request, the gauge read beside it -> its readings against the time left."""
    answered: dict[str, float] = {}

    def send() -> None:
        response = httpx.post(
            f"{url}{route}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=120.0,
        )
        answered["at"] = time.monotonic()
        answered["status"] = response.status_code

    sender = threading.Thread(target=send)
    started = time.monotonic()
    sender.start()
    readings: list[tuple[float, float]] = []  # (monotonic time, gauge)
    with httpx.Client(timeout=10.0) as client:
        while sender.is_alive() and time.monotonic() - started < 120.0:
            readings.append((time.monotonic(), backlog_gauge(client, url)))
            time.sleep(every_s)
    sender.join()
    assert answered.get("status") == 200, answered
    took = answered["at"] - started
    points = [
        {"at_s": at - started, "backlog_s": gauge, "left_s": answered["at"] - at}
        for at, gauge in readings
    ]
    # From the first reading that counts the request (before, its body was still arriving
    # or being decoded: not yet admitted, so in no backlog).
    counted = next((i for i, p in enumerate(points) if p["backlog_s"] > 0), len(points))
    points = points[counted:]
    ratios = [p["backlog_s"] / p["left_s"] for p in points if p["left_s"] >= MIN_LEFT_S]
    assert points, "sdpa_backlog_seconds never counted the long request"
    halfway = min(points, key=lambda p: abs(p["left_s"] - took / 2))
    return {
        "took_s": took,
        "points": points,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "min_ratio": min(ratios) if ratios else None,
        "max_ratio": max(ratios) if ratios else None,
        "halfway": halfway,
    }


def markdown(results: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    lines = [
        "# sdpa_backlog_seconds during one long request",
        "",
        f"{meta['date']}, {meta['machine']}; `{meta['command']}`.",
        f"Readings every {meta['every_s']} s; ratios over those with at least {MIN_LEFT_S} s "
        "really left.",
        "",
        "| request | run | took | backlog halfway (real left) | backlog ÷ real left: "
        "median (min to max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        for i, run in enumerate(runs, 1):
            half = run["halfway"]
            spread = (
                "n/a"
                if run["median_ratio"] is None
                else f"{run['median_ratio']:.2f} ({run['min_ratio']:.2f} to {run['max_ratio']:.2f})"
            )
            lines.append(
                f"| {name} | {i} | {run['took_s']:.2f} s | {half['backlog_s']:.2f} s "
                f"({half['left_s']:.2f} s) | {spread} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3, help="long requests of each kind")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between readings")
    args = parser.parse_args()
    requests = long_requests()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in requests}
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server({}, tmp_path=Path(tmp)) as server,
    ):
        for _ in range(20):
            httpx.post(f"{server.url}/v1/attention", json=TINY, timeout=30.0).raise_for_status()
        for _ in range(args.runs):  # alternated, so a change in the machine's load hits both
            for name, (route, body) in requests.items():
                run = one_run(server.url, route, body, args.every)
                results[name].append(run)
                half = run["halfway"]
                print(
                    f"{name}: {run['took_s']:.2f} s; halfway the backlog said "
                    f"{half['backlog_s']:.2f} s with {half['left_s']:.2f} s left; "
                    f"median ratio {run['median_ratio']}"
                )
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python bench/long_backlog.py " + " ".join(sys.argv[1:]),
        "every_s": args.every,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "long_backlog.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2) + "\n"
    )
    (RESULTS / "long_backlog.md").write_text(markdown(results, meta))
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
