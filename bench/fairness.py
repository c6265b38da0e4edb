"""Small requests beside long ones, with and without slices: head-of-line blocking measured.

A real server (`python -m service.cli serve`, CPU) is measured twice in one run, each time
fresh: with the default SDPA_SLICE_MS=50 (long requests run in tiles) and with
SDPA_SLICE_MS=60000 (nothing is long enough to be cut: every request runs to its end, as
before tiles). On each:

1. idle: a small request ([2, 2] q, k and v) at a time, with 20 ms between them;
2. beside long ones: the same small client while other clients keep long requests in a
   closed loop: (a) one client sending a synthetic /v1/analyze (8192 x 8192 scores, d_k 128:
   about 2.4 s, a body of a few bytes); (b) that client and one sending an attention with
   summary diagnostics (q = k = v [1, 8, 8192, 16], the chunked path, a 16 MB body whose
   decoding and encoding compete with the compute for the two cores);
3. deadlines: a long analyze with timeout_ms 800, alone, five times: when its 504 arrives and
   how long the next small request then takes;
4. the long requests alone (three of each, one at a time): what the tiles cost them;
5. in process, without HTTP: the same two computations whole and in tiles of about 50 ms
   (AttentionRun, AnalysisRun), alternated three times, fastest of each: the tiles' own cost.

The goal (issue 15): beside long requests, the small requests' p99 <= 3 x their idle p99 plus
one slice. Writes bench/results/fairness.json and fairness.md.

    .venv/bin/python bench/fairness.py            # about 3 minutes on 2 cores
    .venv/bin/python bench/fairness.py --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import LONG_ANALYZE, live_server, long_attention_body  # noqa: E402
from sdpa_core import (  # noqa: E402
    AnalysisRun,
    AttentionOptions,
    AttentionRun,
    make_synthetic_qk,
)

RESULTS = REPO_ROOT / "bench" / "results"
SMALL = {
    "q": [[1.0, 0.0], [0.0, 1.0]],
    "k": [[1.0, 0.0], [0.0, 1.0]],
    "v": [[1.0, 2.0], [3.0, 4.0]],
}
SLICED_MS, UNSLICED_MS = 50.0, 60_000.0
THINK_S = 0.02


def percentiles(latencies: list[float]) -> dict[str, float]:
    ms = sorted(x * 1e3 for x in latencies)
    cuts = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"n": len(ms), "p50_ms": cuts[49], "p99_ms": cuts[98], "max_ms": ms[-1]}


def small_client(url: str, seconds: float, max_requests: int = 2000) -> list[float]:
    """One small request at a time for `seconds` (bounded in count too)."""
    latencies = []
    with httpx.Client(timeout=120) as client:
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at and len(latencies) < max_requests:
            started = time.perf_counter()
            response = client.post(f"{url}/v1/attention", json=SMALL)
            latencies.append(time.perf_counter() - started)
            if response.status_code != 200:
                raise RuntimeError(f"small request: {response.status_code} {response.text}")
            time.sleep(THINK_S)
    return latencies


def long_client(url: str, path: str, body: bytes, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=300, headers={"content-type": "application/json"}) as client:
        while not stop.is_set():
            started = time.perf_counter()
            response = client.post(f"{url}{path}", content=body)
            if response.status_code != 200:
                raise RuntimeError(f"long request: {response.status_code} {response.text[:200]}")
            out.append(time.perf_counter() - started)


def measure(slice_ms: float, seconds: float, tmp: Path) -> dict[str, Any]:
    big = long_attention_body()
    analyze = json.dumps(LONG_ANALYZE).encode()
    with live_server({"SDPA_SLICE_MS": str(slice_ms)}, tmp_path=tmp) as server:
        url = server.url
        small_client(url, 2.0)  # warm-up
        idle = small_client(url, seconds)

        beside: dict[str, Any] = {}
        for streams_name, paths in (
            ("analyze", [("/v1/analyze", analyze)]),
            ("analyze+attention", [("/v1/analyze", analyze), ("/v1/attention", big)]),
        ):
            stop = threading.Event()
            done: list[list[float]] = [[] for _ in paths]
            streams = [
                threading.Thread(target=long_client, args=(url, path, body, stop, out))
                for (path, body), out in zip(paths, done, strict=True)
            ]
            for stream in streams:
                stream.start()
            time.sleep(1.0)  # the long streams under way
            latencies = small_client(url, seconds)
            stop.set()
            for stream in streams:
                stream.join(timeout=300)
            beside[streams_name] = {
                **percentiles(latencies),
                "long_completed": [len(out) for out in done],
            }

        deadlines = []
        with httpx.Client(timeout=120) as client:
            for _ in range(5):
                started = time.perf_counter()
                with_deadline = {**LONG_ANALYZE, "timeout_ms": 800}
                response = client.post(f"{url}/v1/analyze", json=with_deadline)
                answered = time.perf_counter() - started
                started = time.perf_counter()
                client.post(f"{url}/v1/attention", json=SMALL)
                deadlines.append(
                    {
                        "status": response.status_code,
                        "answered_s": answered,
                        "next_small_ms": (time.perf_counter() - started) * 1e3,
                    }
                )
                time.sleep(0.5)

            alone: dict[str, list[float]] = {"analyze": [], "attention": []}
            for _ in range(3):
                for name, path, body in (("analyze", "/v1/analyze", analyze),
                                         ("attention", "/v1/attention", big)):  # fmt: skip
                    started = time.perf_counter()
                    response = client.post(
                        f"{url}{path}", content=body, headers={"content-type": "application/json"}
                    )
                    assert response.status_code == 200, response.text[:200]
                    alone[name].append(time.perf_counter() - started)
    return {
        "slice_ms": slice_ms,
        "idle": percentiles(idle),
        "beside_long": beside,
        "deadline_800ms": deadlines,
        "long_alone_s": {k: statistics.median(v) for k, v in alone.items()},
    }


def tile_overhead() -> list[dict[str, Any]]:
    """Whole vs in tiles of about a slice, in this process (section 5 of the docstring)."""
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 8, 8192, 16))).float()
    q, k = make_synthetic_qk(n_q=8192, n_k=8192, d_k=128, std=1.0, seed=0)
    cases: dict[str, Callable[[int], AttentionRun | AnalysisRun]] = {
        "attention [1, 8, 8192, 16], summary (chunked)": lambda tiles: AttentionRun(
            x, x, x, options=AttentionOptions(diagnostics="summary"), tiles=tiles
        ),
        "analyze synthetic 8192 x 8192, d_k 128": lambda tiles: AnalysisRun(q, k, tiles=tiles),
    }
    rows = []
    for name, make in cases.items():
        started = time.perf_counter()
        make(1).run()
        tiles = max(1, round((time.perf_counter() - started) / (SLICED_MS / 1e3)))
        times: dict[int, list[float]] = {1: [], tiles: []}
        for count in (1, tiles, tiles, 1, 1, tiles):
            run = make(count)
            started = time.perf_counter()
            run.run()
            times[count].append(time.perf_counter() - started)
        whole, tiled = min(times[1]), min(times[tiles])
        rows.append(
            {
                "case": name,
                "tiles_asked": tiles,
                "tiles": make(tiles).tiles_total,
                "whole_s": whole,
                "tiled_s": tiled,
                "ratio": tiled / whole,
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Small requests beside long ones (bench/fairness.py)",
        "",
        f"{report['date']}, {report['machine']}, load average before: {report['load_before']}.",
        "",
        "| slices | long streams | small idle p50 / p99 | beside long: p50 / p99 / max | goal "
        "p99 <= 3 x idle p99 + slice | long alone: analyze / attention |",
        "|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        idle = run["idle"]
        goal = 3 * idle["p99_ms"] + min(run["slice_ms"], SLICED_MS)
        for streams, beside in run["beside_long"].items():
            met = "met" if beside["p99_ms"] <= goal else "missed"
            lines.append(
                f"| {run['slice_ms']:.0f} ms | {streams} | {idle['p50_ms']:.1f} / "
                f"{idle['p99_ms']:.1f} ms (n={idle['n']}) | {beside['p50_ms']:.1f} / "
                f"{beside['p99_ms']:.1f} / {beside['max_ms']:.1f} ms (n={beside['n']}) | "
                f"{goal:.1f} ms: {met} | {run['long_alone_s']['analyze']:.2f} s / "
                f"{run['long_alone_s']['attention']:.2f} s |"
            )
    lines += ["", "Deadline 800 ms on a running analyze (5 tries): status, answered after, the "
              "next small request.", ""]  # fmt: skip
    for run in report["runs"]:
        tries = ", ".join(
            f"{d['status']} at {d['answered_s']:.3f} s / {d['next_small_ms']:.0f} ms"
            for d in run["deadline_800ms"]
        )
        lines.append(f"- slices of {run['slice_ms']:.0f} ms: {tries}")
    lines += ["", "In process, whole vs in tiles of about 50 ms (fastest of three each):", ""]
    for row in report["tile_overhead"]:
        lines.append(
            f"- {row['case']}: whole {row['whole_s']:.2f} s, {row['tiles']} tiles "
            f"{row['tiled_s']:.2f} s ({row['ratio']:.2f}x)"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="per small-client phase")
    parser.add_argument(
        "--slices-ms",
        type=float,
        nargs="+",
        default=[SLICED_MS, UNSLICED_MS],
        help="SDPA_SLICE_MS of each server measured (default: 50 and 60000)",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(ms, args.seconds, Path(tmp)) for ms in args.slices_ms]
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_before": round(load_before, 2),
        "runs": runs,
        "tile_overhead": tile_overhead(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fairness.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (RESULTS / "fairness.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
