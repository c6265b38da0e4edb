"""What diagnostics cost beside the output: time and torch calls per path (a benchmark, never
a test).

    .venv/bin/python bench/diagnostics_cost.py                      # [1,4,64,64] and [1,8,1024,64]
    git archive <commit> sdpa_core | tar -x -C /tmp/before
    .venv/bin/python bench/diagnostics_cost.py --before /tmp/before # the same, old vs new

Cases on q, k, v of one shape (fp32, no mask or causal, one torch thread): torch's SDPA
called directly ("sdpa"), attention() on the fused path ("fused"), with diagnostics "summary"
(the chunked path; with the statistics kernel compiled first where the tree has it, as the
service's warm-up does), the same with the kernel disabled ("summary_eager": the eager loop),
with the weights ("dense_w"), and with both ("dense_w_summary"). Each side runs in its
own subprocess (PYTHONPATH = its tree); sides alternate round by round so that load drifting on
the shared machine falls on both alike. A timing is the median CPU time (process_time, which
on one thread is what the call costs on an idle core) of --reps calls, then the median over
--rounds. "ops" counts the top-level torch calls of one call (torch.profiler): on small shapes
each costs microseconds of dispatch, which is what diagnostics cost there.

Targets (issue 26): summary / fused <= 2.0 at [1,4,64,64], <= 1.5 at [1,8,1024,64] and
[1,8,2048,64] causal; fused / sdpa <= 1.10.
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
CASES = ("sdpa", "fused", "summary", "summary_eager", "dense_w", "dense_w_summary")

_CHILD = r"""
import contextlib, json, statistics, sys, time
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from sdpa_core import attention
torch.set_num_threads(1)
parts = sys.argv[1].split(",")
b, h, n, d = (int(x) for x in parts[:4])
causal = parts[4:] == ["causal"]
reps = int(sys.argv[2])
import os, sdpa_core
try:  # a tree with the compiled statistics kernel: compile it, as the service's warm-up does
    from sdpa_core import stats_kernel
    # An editable install's finder serves the working tree's modules to a tree without them.
    if os.path.dirname(stats_kernel.__file__) != os.path.dirname(sdpa_core.__file__):
        raise ImportError("not this tree's")
    from sdpa_core.stats_kernel import compile_kernels, kernel_mode
    kernel = compile_kernels().compiled
except ImportError:
    kernel, kernel_mode = False, None
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
def eager_summary():
    with kernel_mode("off"):
        return attention(q, k, v, causal=causal, diagnostics="summary")
cases = {
    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "fused": lambda: attention(q, k, v, causal=causal),
    "summary": lambda: attention(q, k, v, causal=causal, diagnostics="summary"),
    "summary_eager": eager_summary if kernel else None,
    "dense_w": lambda: attention(q, k, v, causal=causal, return_weights=True),
    "dense_w_summary": lambda: attention(
        q, k, v, causal=causal, return_weights=True, diagnostics="summary"
    ),
}
out = {}
for name, fn in cases.items():
    if fn is None:
        out[name] = {"us": float("nan"), "ops": float("nan")}
        continue
    fn(); fn()
    times = []
    for _ in range(reps):
        start = time.process_time(); fn(); times.append(time.process_time() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = sum(1 for e in prof.events() if e.cpu_parent is None)
    out[name] = {"us": statistics.median(times) * 1e6, "ops": ops}
out["kernel"] = {"us": float(kernel), "ops": 0}
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
    ap.add_argument(
        "--shapes",
        default="1,4,64,64;1,8,1024,64;1,8,2048,64,causal",
        help="B,H,N,D[,causal] shapes, ';'-separated",
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sides = {"after": ROOT} if args.before is None else {"before": args.before, "after": ROOT}
    print(f"load average before: {os.getloadavg()}")
    for shape in args.shapes.split(";"):
        n = int(shape.split(",")[2])
        reps = 300 if n <= 128 else 5 if n <= 1024 else 3
        runs: dict[str, list[dict[str, dict[str, float]]]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, tree in sides.items():
                runs[side].append(run_side(tree, shape, reps))
        print(f"\n[{shape}] median of {args.rounds} rounds x {reps} calls (CPU time, one thread)")
        cases = [c for c in CASES if any(c in r for rs in runs.values() for r in rs)]
        print(f"| side | kernel | {' | '.join(cases)} | fused/sdpa | summary/fused |")
        print("|---" * (len(cases) + 4) + "|")
        for side, results in runs.items():
            med = {
                c: statistics.median(r[c]["us"] for r in results) for c in cases if c in results[0]
            }
            ops = {c: results[0][c]["ops"] for c in med}
            cells = [
                f"{med[c]:.0f} µs ({ops[c]:.0f} ops)" if c in med and med[c] == med[c] else "-"
                for c in cases
            ]
            kernel = "compiled" if results[0].get("kernel", {}).get("us") else "eager"
            ratios = (med["fused"] / med["sdpa"], med["summary"] / med["fused"])
            print(
                f"| {side} | {kernel} | "
                + " | ".join(cells)
                + " | "
                + " | ".join(f"{r:.2f}" for r in ratios)
                + " |"
            )
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
