"""What health sampling costs small-payload throughput (a benchmark, never a test).

    .venv/bin/python bench/health_sampling.py                 # 3 rounds x 10 s per rate
    .venv/bin/python bench/health_sampling.py --rounds 5 --duration 20

A real server per run (`sdpa-service serve`, CPU) at SDPA_HEALTH_SAMPLE_RATE 0 (no sampling),
0.01 (the default) and 1 (every request sampled: the worst case, bounded by the queue of
samples), loaded by `sdpa-loadtest --preset small --concurrency 16` (B=1 H=4 N=64 D=64,
diagnostics none: the requests that are sampled). Rates alternate round by round so that load
drifting on the shared machine falls on all alike; the figure is the median throughput of the
rounds, and the sampled/observed counts read back from /metrics show that sampling ran.

Target (issue 17): the default rate costs <= 2% of throughput at c=16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from support import live_server

RATES = ("0", "0.01", "1")


def observed(url: str) -> tuple[float, float]:
    """(sampled observations, dropped samples) from the server's /metrics."""
    sampled = dropped = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("sdpa_health_observations_total{") and 'source="sampled"' in line:
            sampled += float(line.rsplit(" ", 1)[1])
        elif line.startswith("sdpa_health_samples_dropped_total "):
            dropped = float(line.rsplit(" ", 1)[1])
    return sampled, dropped


def one_run(rate: str, duration: float, tmp: Path) -> dict[str, float]:
    with live_server({"SDPA_HEALTH_SAMPLE_RATE": rate}, tmp_path=tmp) as server:
        out = tmp / f"load-{rate}.json"
        subprocess.run(
            [sys.executable, "-m", "sdpa_client.loadtest", "--url", server.url,
             "--preset", "small", "--concurrency", "16", "--duration", str(duration),
             "--warmup", "2s", "--no-progress", "--json", str(out)],
            check=True, capture_output=True, timeout=duration + 120,
        )  # fmt: skip
        report = json.loads(out.read_text(encoding="utf-8"))
        sampled, dropped = observed(server.url)
    return {
        "rps": float(report["report"]["throughput_rps"]),
        "sampled": sampled,
        "dropped": dropped,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    runs: dict[str, list[dict[str, float]]] = {rate: [] for rate in RATES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for rate in RATES:
                runs[rate].append(one_run(rate, args.duration, Path(tmp)))
    base = statistics.median(r["rps"] for r in runs["0"])
    print("| SDPA_HEALTH_SAMPLE_RATE | req/s (median) | vs rate 0 | sampled | dropped |")
    print("|---|---|---|---|---|")
    for rate, results in runs.items():
        rps = statistics.median(r["rps"] for r in results)
        sampled = sum(r["sampled"] for r in results)
        dropped = sum(r["dropped"] for r in results)
        print(f"| {rate} | {rps:.0f} | {rps / base - 1:+.1%} | {sampled:.0f} | {dropped:.0f} |")
    print(f"per round: { {rate: [round(r['rps']) for r in rs] for rate, rs in runs.items()} }")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
