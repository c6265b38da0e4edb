"""Old vs new server on the normal path: sdpa-loadtest's small payload at concurrency 16, the two
code trees alternated round by round in one run (a benchmark, never a test).

    git worktree add /tmp/before <commit>      # or: git archive <commit> | tar -x -C /tmp/before
    .venv/bin/python bench/ab_throughput.py --before /tmp/before           # ~3 min on 2 cores
    .venv/bin/python bench/ab_throughput.py --before /tmp/before --protocol v2

Each side is `python -m service.cli serve` started from its own tree (cwd and PYTHONPATH: the
scripts import the code beside them), with the same .venv and the same SDPA_* settings, on a
free loopback port; the load is `sdpa-loadtest --preset small --concurrency 16` (closed loop)
for --seconds after a warm-up, run from this tree's client. Sides alternate (old, new, new,
old, ...) so that load drifting on the shared machine falls on both alike. Prints each run's
throughput and p50/p99, then the medians and the new/old ratio.

Target (issue 23): small-payload throughput at c=16 within noise of the old code.
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

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import live_server  # noqa: E402


def load(
    url: str, *, seconds: float, concurrency: int, protocol: str, out: Path
) -> dict[str, float]:
    """One sdpa-loadtest run (its JSON report written to `out`) -> throughput (req/s), p50 and
    p99 (ms), errors."""
    command = [
        str(Path(sys.executable).with_name("sdpa-loadtest")), "--url", url,
        "--protocol", protocol, "--preset", "small", "--concurrency", str(concurrency),
        "--duration", str(seconds), "--warmup", "2s", "--no-progress", "--json", str(out),
    ]  # fmt: skip
    subprocess.run(command, capture_output=True, check=True, timeout=seconds + 120)
    report = json.loads(out.read_text())["report"]
    latency = report["latency"]
    return {
        "throughput": float(report["throughput_rps"]),
        "p50_ms": float(latency["p50_ms"]),
        "p99_ms": float(latency["p99_ms"]),
        "errors": float(sum(report["errors"].values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old code's tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--protocol", choices=("v1", "v2"), default="v1")
    args = parser.parse_args()
    trees = {"old": args.before.resolve(), "new": REPO_ROOT}
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            for side in order:
                with live_server({}, tmp_path=Path(tmp), tree=trees[side]) as server:
                    result = load(
                        server.url,
                        seconds=args.seconds,
                        concurrency=args.concurrency,
                        protocol=args.protocol,
                        out=Path(tmp) / f"{side}-{round_}.json",
                    )
                runs[side].append(result)
                print(
                    f"round {round_} {side}: {result['throughput']:.0f} req/s, p50 "
                    f"{result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, "
                    f"errors {result['errors']:.0f}",
                    flush=True,
                )
    median = {
        side: statistics.median(r["throughput"] for r in results) for side, results in runs.items()
    }
    print(
        f"median throughput: old {median['old']:.0f}, new {median['new']:.0f} req/s "
        f"(new/old {median['new'] / median['old']:.3f}); load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
