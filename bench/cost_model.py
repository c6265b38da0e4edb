"""The cost model against measurement: estimated ÷ actual device time over a grid of shapes.

    .venv/bin/python bench/cost_model.py            # ~4 min on 2 cores
    .venv/bin/python bench/cost_model.py --quick    # N up to 4096

The service's engine calibrates its cost model at warm-up (Engine.calibrate: each path's
seconds per FLOP and head-dim floor, from two shapes); the work limit (SDPA_MAX_REQUEST_FLOPS)
trusts its estimates for every other shape. Here the same calibration runs once, on the CPU
with the service's thread count, then every cell of the grid is timed (the fastest of a few
calls, each bounded) and compared with the model's estimate:

- fused (diagnostics "none"), chunked (diagnostics "summary", no weights) and dense (weights
  and summary diagnostics) attention on [1, H, N, D] with D in 1, 4, 16, 64, 256 and N in 16,
  256, 4096, 16384 (dense stops where its weights pass the service's default weights limit,
  2^26 elements); H = 4 below N = 4096, 1 from there;
- the scaling analysis (five standard strategies) on [1, 1, N, D] up to N = 4096.

The target: every ratio within 3x (1/3 to 3). Writes bench/results/cost_model.json and
bench/results/cost_model.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `service` and `sdpa_core` importable
    sys.path.insert(0, str(REPO_ROOT))

from sdpa_core import analyze_scaling, attention  # noqa: E402
from service.runtime.engine import Engine  # noqa: E402
from service.runtime.policy import CostModel, WorkShape  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
HEAD_DIMS = (1, 4, 16, 64, 256)
LENGTHS = (16, 256, 4096, 16384)
MAX_WEIGHTS = 2**26
CALL_BUDGET_S = 20.0  # per cell: fewer repeats for slow cells


def timed(call: Callable[[], object]) -> float:
    """The fastest of up to five calls after a warm one, within CALL_BUDGET_S."""
    started = time.perf_counter()
    call()
    first = time.perf_counter() - started
    repeats = max(1, min(5, int(CALL_BUDGET_S / max(first, 1e-6))))
    times = [first]
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return min(times)


def cells(lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in lengths:
        heads = 4 if n < 4096 else 1
        for d in HEAD_DIMS:
            q, k, v = (torch.randn(1, heads, n, d) for _ in range(3))
            cases: dict[str, Callable[[], object]] = {
                "fused": functools.partial(attention, q, k, v),
                "chunked": functools.partial(attention, q, k, v, diagnostics="summary"),
            }
            if heads * n * n <= MAX_WEIGHTS:
                cases["dense"] = functools.partial(
                    attention, q, k, v, return_weights=True, diagnostics="summary"
                )
            if n <= 4096:
                cases["analyze"] = functools.partial(analyze_scaling, q[:, :1], k[:, :1])
            for path, call in cases.items():
                head_count = 1 if path == "analyze" else heads
                row = {"path": path, "heads": head_count, "n": n, "d": d}
                rows.append({**row, "actual_s": timed(call)})
    return rows


def estimate(row: dict[str, Any], model: CostModel) -> float:
    strategies = 5 if row["path"] == "analyze" else 0
    shape = WorkShape(1, row["heads"], row["n"], row["n"], row["d"], row["d"], strategies)
    return model.seconds(shape, row["path"])


def run(quick: bool) -> dict[str, Any]:
    engine = Engine(torch.device("cpu"))
    engine.warmup()
    model = engine.calibrate()
    lengths = tuple(n for n in LENGTHS if not quick or n <= 4096)
    rows = cells(lengths)
    for row in rows:
        row["estimated_s"] = estimate(row, model)
        row["ratio"] = row["estimated_s"] / row["actual_s"]
    ratios = [row["ratio"] for row in rows]
    return {
        "benchmark": "cost_model",
        "command": ".venv/bin/python bench/cost_model.py" + (" --quick" if quick else ""),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "model": model.as_json(),
        "rows": rows,
        "summary": {
            "cells": len(rows),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
            "median_ratio": statistics.median(ratios),
            "within_3x": sum(1 for r in ratios if 1 / 3 <= r <= 3),
        },
    }


def markdown(report: dict[str, Any]) -> str:
    model, summary = report["model"], report["summary"]
    lines = [
        "# Cost model: estimated ÷ actual device time",
        "",
        f"`{report['command']}` — {report['when']}, torch {report['machine']['torch']}, "
        f"{report['machine']['cpus']} threads.",
        "",
        "Calibrated at warm-up, by path (GFLOP/s above the head-dim floor; floor; fixed cost of "
        "a call): "
        + "; ".join(
            f"{path} {cost['gflops_per_second']:.1f} GFLOP/s, {cost['d_floor']}, "
            f"{cost['overhead_ms']:.3g} ms"
            for path, cost in model["paths"].items()
        )
        + ".",
        "",
        "| path | H | N | D | actual (ms) | estimated (ms) | estimated ÷ actual |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['path']} | {row['heads']} | {row['n']} | {row['d']} | "
            f"{row['actual_s'] * 1e3:.3g} | {row['estimated_s'] * 1e3:.3g} | "
            f"{row['ratio']:.2f} |"
        )
    lines += [
        "",
        f"{summary['within_3x']} of {summary['cells']} cells within 3x; ratios from "
        f"{summary['min_ratio']:.2f} to {summary['max_ratio']:.2f} (median "
        f"{summary['median_ratio']:.2f}).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="N up to 4096")
    args = parser.parse_args()
    report = run(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cost_model.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (RESULTS / "cost_model.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
