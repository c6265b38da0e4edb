"""Eight long requests sharing a deadline, the old batcher against the new: how many finish.

Each round sends CLIENTS synthetic /v1/analyze requests (3072 x 3072 scores, d_k 64: about
0.4 s of device time on 2 cores, eight slices) at once, on their own connections, each with
timeout_ms = --factor x one request's device time (the median of three sent alone just before
the round, as the server reports it in meta.compute_ms). The default is the issue's ratio
(8 analyzes of 0.38 s, 1.5 s to go: 0 of 8 finished with the round robin of tiles): three one
after the other fit, four do not.

Two real servers (`python -m service.cli serve`, CPU, default settings) run side by side and
the rounds alternate between them, so that a change in the machine's load hits both:

- new: this checkout;
- old: this checkout with service/runtime/batcher.py as of --baseline (default: the newest
  commit whose batcher has no deadline admission), copied to a temporary directory.

Per round: each answer's status, time and Retry-After. Per server: the answers by status and
the rounds in which at least three finished. Writes bench/results/long_deadlines.json and
long_deadlines.md. Bounded: at most --rounds rounds per server, no round started after
--max-seconds, every request with a 60 s client timeout.

    .venv/bin/python bench/long_deadlines.py                 # about a minute on 2 cores
    .venv/bin/python bench/long_deadlines.py --rounds 1 --only new
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import live_server  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
ANALYZE = {"synthetic": {"n_q": 3072, "n_k": 3072, "d_k": 64, "std": 1.0, "seed": 0}}
CLIENTS = 8
BATCHER = "service/runtime/batcher.py"
# What the deadline admission added to the batcher: a baseline's batcher lacks it.
ADMISSION_MARK = "deadline_unreachable"
CLIENT_TIMEOUT_S = 60.0


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout


def default_baseline() -> str:
    """The newest commit whose batcher has no deadline admission."""
    for rev in git("log", "--format=%H", "--", BATCHER).split():
        if ADMISSION_MARK not in git("show", f"{rev}:{BATCHER}"):
            return rev
    raise SystemExit(f"no commit of {BATCHER} without {ADMISSION_MARK!r}")


def old_tree(baseline: str, into: Path) -> Path:
    """This checkout's service and sdpa_core with the baseline's batcher, under `into`."""
    for package in ("service", "sdpa_core"):
        shutil.copytree(
            REPO_ROOT / package, into / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    (into / BATCHER).write_text(git("show", f"{baseline}:{BATCHER}"))
    return into


def compute_seconds(url: str) -> float:
    """One request's device time now: the median of three sent alone."""
    times = []
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        for _ in range(3):
            response = client.post(f"{url}/v1/analyze", json=ANALYZE)
            response.raise_for_status()
            times.append(response.json()["meta"]["compute_ms"] / 1e3)
    return float(statistics.median(times))


def one_round(url: str, factor: float) -> dict[str, Any]:
    """CLIENTS requests released together -> each one's status, seconds and Retry-After."""
    one_s = compute_seconds(url)
    timeout_s = factor * one_s
    body = {**ANALYZE, "timeout_ms": timeout_s * 1e3}
    answers: list[dict[str, Any]] = [{} for _ in range(CLIENTS)]
    clients = [httpx.Client(timeout=CLIENT_TIMEOUT_S) for _ in range(CLIENTS)]
    for client in clients:  # connected first, so that the requests leave together
        client.get(f"{url}/healthz").raise_for_status()
    barrier = threading.Barrier(CLIENTS)

    def post(i: int) -> None:
        barrier.wait(timeout=30)
        started = time.perf_counter()
        status: int | str
        retry_after: str | None = None
        try:
            response = clients[i].post(f"{url}/v1/analyze", json=body)
            status, retry_after = response.status_code, response.headers.get("retry-after")
        except httpx.HTTPError as exc:  # reported as such, never a crash of the benchmark
            status = type(exc).__name__
        answers[i] = {
            "status": status,
            "seconds": round(time.perf_counter() - started, 3),
            "retry_after": retry_after,
        }

    threads = [threading.Thread(target=post, args=(i,)) for i in range(CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=CLIENT_TIMEOUT_S + 30)
    finally:
        for client in clients:
            client.close()
    answers.sort(key=lambda answer: answer.get("seconds", float("inf")))
    return {"one_s": round(one_s, 3), "timeout_s": round(timeout_s, 3), "answers": answers}


def count(answers: list[dict[str, Any]], status: int) -> int:
    return sum(answer.get("status") == status for answer in answers)


def describe(name: str, number: int, result: dict[str, Any]) -> str:
    answers = result["answers"]
    finished = [f"{a['seconds']:.2f}" for a in answers if a.get("status") == 200]
    retry = sorted({a["retry_after"] for a in answers if a.get("retry_after")})
    others = len(answers) - sum(count(answers, s) for s in (200, 503, 504))
    return (
        f"| {name} | {number} | {result['one_s']:.3f} s | {result['timeout_s']:.3f} s "
        f"| {count(answers, 200)} | {count(answers, 503)} | {count(answers, 504)} | {others} "
        f"| {', '.join(finished) or '-'} | {', '.join(retry) or '-'} |"
    )


def markdown(results: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    lines = [
        f"# {CLIENTS} long requests sharing a deadline: old batcher against new",
        "",
        f"{meta['date']}, {meta['machine']}; `{meta['command']}`; old = batcher of "
        f"{meta['baseline'][:10]}. timeout = {meta['factor']:.2f} x one request's device time "
        "(measured alone just before each round).",
        "",
        "| server | round | one request | timeout | 200 | 503 | 504 | other | 200 after (s) "
        "| Retry-After |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, rounds in results.items():
        lines += [describe(name, i, result) for i, result in enumerate(rounds, 1)]
    lines += [
        "",
        "| server | rounds | with >= 3 finished | finished, all rounds |",
        "|---|---:|---:|---:|",
    ]
    for name, rounds in results.items():
        finished = [count(result["answers"], 200) for result in rounds]
        lines.append(
            f"| {name} | {len(rounds)} | {sum(n >= 3 for n in finished)} "
            f"| {sum(finished)} of {CLIENTS * len(rounds)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per server")
    parser.add_argument("--factor", type=float, default=1.5 / 0.38, help="timeout / one")
    parser.add_argument("--baseline", default=None, help="the old batcher's commit")
    parser.add_argument("--only", choices=("old", "new"), default=None)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="no round after")
    args = parser.parse_args()
    baseline = args.baseline or default_baseline()
    names = [args.only] if args.only else ["old", "new"]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        trees = {"new": REPO_ROOT, "old": old_tree(baseline, Path(tmp) / "old")}
        servers = {
            name: stack.enter_context(live_server({}, tmp_path=Path(tmp), tree=trees[name]))
            for name in names
        }
        for number in range(1, args.rounds + 1):
            for name in names:  # alternated, so a change in the machine's load hits both
                if time.monotonic() - started > args.max_seconds:
                    break
                result = one_round(servers[name].url, args.factor)
                results[name].append(result)
                print(describe(name, number, result), flush=True)
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python bench/long_deadlines.py " + " ".join(sys.argv[1:]),
        "baseline": baseline,
        "factor": args.factor,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "long_deadlines.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2) + "\n"
    )
    (RESULTS / "long_deadlines.md").write_text(markdown(results, meta))
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
