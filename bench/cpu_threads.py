"""torch's CPU threads in the service: the chunked and dense paths' tile size under each OpenMP
wait policy, and what an operator's GOMP_SPINCOUNT buys in a real server.

1. tiles (in process, one fresh interpreter per measurement): the chunked path (summary
   diagnostics), the dense path (weights) and analyze_scaling on a few shapes, with
   sdpa_core.chunked.TILE_ELEMENTS = 2^19, 2^20 and 2^21, under OMP_WAIT_POLICY=PASSIVE (what
   `sdpa-service serve` sets) and with libgomp's default spin. Fastest of three calls after a
   warm one, in ms. Each elementwise op on a tile is one OpenMP parallel region; under PASSIVE
   every region wakes the sleeping workers, so larger tiles amortize the wake-ups until they
   fall out of cache.
2. server (`python -m service.cli serve`, CPU, fresh per configuration, configurations
   alternated): sdpa-loadtest at concurrency 16 for --seconds each (small and medium presets),
   then two long requests of each kind one at a time (q = k = v [1, 8, 8192, 16] with summary
   diagnostics, a 16 MB body; a synthetic /v1/analyze of 8192 x 8192, d_k 128), under the
   default (PASSIVE) and with GOMP_SPINCOUNT=30000.

Writes bench/results/cpu_threads.json and cpu_threads.md.

    .venv/bin/python bench/cpu_threads.py                 # about 5 minutes on 2 cores
    .venv/bin/python bench/cpu_threads.py --part tiles
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
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
EXPONENTS = (19, 20, 21, 22)
POLICIES = {"PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin": {}}
SERVER_CONFIGS = {"default (PASSIVE)": {}, "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"}}

# One interpreter: the cases at one tile size, printed as JSON {case: ms}.
TILE_PROBE = """
import json, sys, time, torch
import sdpa_core.chunked as chunked, sdpa_core.dense as dense
from sdpa_core import analyze_scaling, attention
chunked.TILE_ELEMENTS = dense.TILE_ELEMENTS = 1 << int(sys.argv[1])
x = lambda *shape: torch.randn(*shape, generator=torch.Generator().manual_seed(0))
a, b, c, d = x(1, 8, 4096, 64), x(1, 8, 8192, 16), x(1, 8, 2048, 64), x(1, 1, 8192, 128)
cases = {
    "chunked [1, 8, 4096, 64] summary": lambda: attention(a, a, a, diagnostics="summary"),
    "chunked [1, 8, 8192, 16] summary, causal":
        lambda: attention(b, b, b, diagnostics="summary", causal=True),
    "dense [1, 8, 2048, 64] weights, full":
        lambda: attention(c, c, c, return_weights=True, diagnostics="full"),
    "analyze [1, 1, 8192, 128]": lambda: analyze_scaling(d, d),
}
result = {}
for name, case in cases.items():
    case()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        case()
        times.append(time.perf_counter() - started)
    result[name] = round(min(times) * 1e3, 1)
print(json.dumps(result))
"""


def tiles_part() -> dict[str, dict[str, dict[str, float]]]:
    """policy -> exponent -> case -> ms."""
    results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in POLICIES}
    for name, policy_env in POLICIES.items():
        for exponent in EXPONENTS:
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            env.update(policy_env)
            proc = subprocess.run(
                [sys.executable, "-c", TILE_PROBE, str(exponent)],
                cwd=REPO_ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            results[name][f"2^{exponent}"] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(name, f"2^{exponent}", results[name][f"2^{exponent}"], flush=True)
    return results


def long_bodies() -> dict[str, tuple[str, bytes]]:
    return {
        "attention [1, 8, 8192, 16] summary": ("/v1/attention", long_attention_body()),
        "analyze 8192 x 8192": ("/v1/analyze", json.dumps(LONG_ANALYZE).encode()),
    }


def one_server(env: dict[str, str], seconds: float, tmp: Path) -> dict[str, Any]:
    loadtest = Path(sys.executable).parent / "sdpa-loadtest"
    out: dict[str, Any] = {}
    with live_server(env, tmp_path=tmp) as server:
        for preset in ("small", "medium"):
            report = tmp / f"{preset}.json"
            subprocess.run(
                [str(loadtest), "--url", server.url, "--preset", preset, "--concurrency", "16",
                 "--duration", str(seconds), "--warmup", "1s", "--no-progress",
                 "--json", str(report)],
                check=True, capture_output=True, timeout=seconds + 120,
            )  # fmt: skip
            out[f"{preset} req/s"] = round(
                json.loads(report.read_text())["report"]["throughput_rps"]
            )
        for name, (route, body) in long_bodies().items():
            took = []
            for _ in range(2):
                started = time.perf_counter()
                response = httpx.post(
                    f"{server.url}{route}",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=120.0,
                )
                response.raise_for_status()
                took.append(round(time.perf_counter() - started, 2))
            out[f"{name} (s)"] = took
    return out


def server_part(seconds: float, rounds: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in SERVER_CONFIGS}
    for _ in range(rounds):  # alternated, so a change in the machine's load hits both
        for name, env in SERVER_CONFIGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                results[name].append(one_server(env, seconds, Path(tmp)))
            print(name, results[name][-1], flush=True)
    return results


def markdown(report: dict[str, Any]) -> str:
    lines = ["# torch's CPU threads in the service", "", f"{report['meta']}", ""]
    tiles = report.get("tiles")
    if tiles:
        cases = list(next(iter(next(iter(tiles.values())).values())))
        lines += ["## Tile size (ms, fastest of 3)", "",
                  "| policy | TILE_ELEMENTS | " + " | ".join(cases) + " |",
                  "|---|---|" + "---:|" * len(cases)]  # fmt: skip
        for policy, by_exponent in tiles.items():
            for exponent, times in by_exponent.items():
                row = " | ".join(f"{times[case]:,.1f}" for case in cases)
                lines.append(f"| {policy} | {exponent} | {row} |")
        lines.append("")
    server = report.get("server")
    if server:
        lines += ["## A real server, per configuration (one row per fresh server)", ""]
        columns = list(next(iter(server.values()))[0])
        lines += ["| configuration | " + " | ".join(columns) + " |",
                  "|---|" + "---:|" * len(columns)]  # fmt: skip
        for name, runs in server.items():
            for run in runs:
                cells = " | ".join(
                    ", ".join(map(str, v)) if isinstance(v, list) else str(v) for v in run.values()
                )
                lines.append(f"| {name} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--part", choices=["tiles", "server", "all"], default="all")
    parser.add_argument("--seconds", type=float, default=6.0, help="per load-test run")
    parser.add_argument("--rounds", type=int, default=2, help="server configurations' rounds")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "meta": f"{datetime.now(UTC):%Y-%m-%d}, {platform.machine()}, {os.cpu_count()} cores; "
        f"`python bench/cpu_threads.py {' '.join(sys.argv[1:])}`".strip(),
    }
    if args.part in ("tiles", "all"):
        report["tiles"] = tiles_part()
    if args.part in ("server", "all"):
        report["server"] = server_part(args.seconds, args.rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_threads.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "cpu_threads.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
