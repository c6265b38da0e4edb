"""What diagnostics cost beside the output: time and torch calls per path (a benchmark, never
a test).

    .venv/bin/python bench/diagnostics_cost.py                      # [1,4,64,64] and [1,8,1024,64]
    git archive <commit> sdpa_core | tar -x -C /tmp/before
    .venv/bin/python bench/diagnostics_cost.py --before /tmp/before # the same, old vs new

Cases on q, k, v of one shape (fp32, no mask, one torch thread): torch's SDPA called directly
("sdpa"), attention() on the fused path ("fused"), with diagnostics "summary" (the chunked
path), with the weights ("dense_w"), and with both ("dense_w_summary"). Each side runs in its
own subprocess (PYTHONPATH = its tree); sides alternate round by round so that load drifting on
the shared machine falls on both alike. A timing is the median CPU time (process_time, which
on one thread is what the call costs on an idle core) of --reps calls, then the median over
--rounds. "ops" counts the top-level torch calls of one call (torch.profiler): on small shapes
each costs microseconds of dispatch, which is what diagnostics cost there.

Targets (issue 17): summary / fused <= 2 on [1, 4, 64, 64]; summary <= 1.3 x dense_w at
N = 1024, H = 8; fused / sdpa <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, statistics, sys, time
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from sdpa_core import attention
torch.set_num_threads(1)
b, h, n, d = (int(x) for x in sys.argv[1].split(","))
reps = int(sys.argv[2])
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
cases = {
    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
    "fused": lambda: attention(q, k, v),
    "summary": lambda: attention(q, k, v, diagnostics="summary"),
    "dense_w": lambda: attention(q, k, v, return_weights=True),
    "dense_w_summary": lambda: attention(q, k, v, return_weights=True, diagnostics="summary"),
}
out = {}
for name, fn in cases.items():
    fn(); fn()
    times = []
    for _ in range(reps):
        start = time.process_time(); fn(); times.append(time.process_time() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = sum(1 for e in prof.events() if e.cpu_parent is None)
    out[name] = {"us": statistics.median(times) * 1e6, "ops": ops}
print(json.dumps(out))
"""


def run_side(tree: Path, shape: str, reps: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, shape, str(reps)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, dict[str, float]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", type=Path, help="a tree holding another sdpa_core to compare")
    ap.add_argument("--shapes", default="1,4,64,64;1,8,1024,64")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sides = {"after": ROOT} if args.before is None else {"before": args.before, "after": ROOT}
    print(f"load average before: {os.getloadavg()}")
    for shape in args.shapes.split(";"):
        n = int(shape.split(",")[2])
        reps = 300 if n <= 128 else 5
        runs: dict[str, list[dict[str, dict[str, float]]]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, tree in sides.items():
                runs[side].append(run_side(tree, shape, reps))
        print(f"\n[{shape}] median of {args.rounds} rounds x {reps} calls (CPU time, one thread)")
        names = " | ".join(runs[next(iter(sides))][0])
        print(f"| side | {names} | fused/sdpa | summary/fused | summary/dense_w |")
        print("|---" * 9 + "|")
        for side, results in runs.items():
            med = {c: statistics.median(r[c]["us"] for r in results) for c in results[0]}
            ops = {c: results[0][c]["ops"] for c in results[0]}
            cells = [f"{med[c]:.0f} µs ({ops[c]:.0f} ops)" for c in med]
            ratios = (
                med["fused"] / med["sdpa"],
                med["summary"] / med["fused"],
                med["summary"] / med["dense_w"],
            )
            print(
                f"| {side} | "
                + " | ".join(cells)
                + " | "
                + " | ".join(f"{r:.2f}" for r in ratios)
                + " |"
            )
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
