"""What diagnostics cost beside the output: time and torch calls per path (a benchmark, never
a test).

    .venv/bin/python bench/diagnostics_cost.py                      # [1,4,64,64] and [1,8,1024,64]
    git archive <commit> sdpa_core | tar -x -C /tmp/before
    .venv/bin/python bench/diagnostics_cost.py --before /tmp/before # the same, old vs new

Cases on q, k, v of one shape (fp32, no mask or causal, one torch thread): torch's SDPA
called directly ("sdpa"), attention() on the fused path ("fused"; "fused_nocheck" as the
service calls it, check_finite=False), with diagnostics "summary" on the path attention()
chooses ("summary": the flash path where the tree has a flash kernel, which compile_kernels()
builds first, as the service's warm-up does), on the flash path by name ("flash"), on the
chunked path with the compiled statistics kernel ("chunked") and with it disabled
("chunked_eager": the eager loop), with the weights ("dense_w"), and with both
("dense_w_summary"). Each side runs in its own subprocess (PYTHONPATH = its tree); sides
alternate round by round, and within a side each rep calls every case once in turn, so that
load drifting on the shared machine falls on all alike. A timing is the median CPU time
(process_time, which on one thread is what the call costs on an idle core) of --reps calls,
then the median over --rounds. "ops" counts the top-level torch calls of one call
(torch.profiler): on small shapes each costs microseconds of dispatch.

    .venv/bin/python bench/diagnostics_cost.py --live   # + a live server's summary / none

--live also starts a real server (`sdpa-service serve`, its default threads, kernels built
at warm-up) and sends [1,8,8192,16] requests with diagnostics "none" and "summary" in turn:
the ratio of the medians of their meta.compute_ms.

Targets (issue 37): summary / fused <= 1.5 at [1,8,1024,64] and [1,8,2048,64] causal, <= 2.0
at [1,4,64,64] and [1,8,8192,16]; fused / sdpa <= 1.10 as the service calls it
(check_finite=False) and <= 1.30 with the default checks at [1,4,64,64]; live summary / none
<= 1.5 at [1,8,8192,16].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CASES = (
    "sdpa",
    "fused",
    "fused_nocheck",
    "summary",
    "flash",
    "chunked",
    "chunked_eager",
    "dense_w",
    "dense_w_summary",
)

_CHILD = r"""
import json, statistics, sys, time
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
def this_trees(module):
    # An editable install's finder serves the working tree's modules to a tree without them.
    return os.path.dirname(module.__file__) == os.path.dirname(sdpa_core.__file__)
kernel_mode = None
kernel = flash = False
try:  # a tree with the compiled statistics kernel: compile it, as the service's warm-up does
    from sdpa_core import stats_kernel
    if not this_trees(stats_kernel):
        raise ImportError("not this tree's")
    from sdpa_core.stats_kernel import kernel_mode
    kernel = sdpa_core.compile_kernels().compiled  # with the flash kernels where the tree has them
    flash = any(s.available for s in getattr(sdpa_core, "flash_kernels", lambda: ())())
except ImportError:
    pass
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
def eager_summary():
    with kernel_mode("off"):
        return attention(q, k, v, causal=causal, diagnostics="summary", path="chunked")
cases = {
    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "fused": lambda: attention(q, k, v, causal=causal),
    "fused_nocheck": lambda: attention(q, k, v, causal=causal, check_finite=False),
    "summary": lambda: attention(q, k, v, causal=causal, diagnostics="summary"),
    "flash": (lambda: attention(q, k, v, causal=causal, diagnostics="summary", path="flash"))
    if flash else None,
    "chunked": lambda: attention(q, k, v, causal=causal, diagnostics="summary", path="chunked"),
    "chunked_eager": eager_summary if kernel else None,
    "dense_w": lambda: attention(q, k, v, causal=causal, return_weights=True),
    "dense_w_summary": lambda: attention(
        q, k, v, causal=causal, return_weights=True, diagnostics="summary"
    ),
}
if b * h * n * n * 4 > 256 << 20:  # the weights alone above 256 MiB: not a dense case
    cases["dense_w"] = cases["dense_w_summary"] = None
live = {name: fn for name, fn in cases.items() if fn is not None}
paths = {}
for name, fn in live.items():
    fn()
    res = fn()
    paths[name] = getattr(res, "path", "torch")
# Alternated: one call of each case per rep, so drifting load falls on all alike, starting
# one case later at each rep (the case after the largest one pays its cache misses).
times = {name: [] for name in live}
order = list(live)
for rep in range(reps):
    for name in order[rep % len(order):] + order[:rep % len(order)]:
        fn = live[name]
        start = time.process_time(); fn(); times[name].append(time.process_time() - start)
out = {}
for name in cases:
    if name not in live:
        out[name] = {"us": float("nan"), "ops": float("nan")}
        continue
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        live[name]()
    ops = sum(1 for e in prof.events() if e.cpu_parent is None)
    out[name] = {"us": statistics.median(times[name]) * 1e6, "ops": ops}
out["kernel"] = {"us": float(kernel), "ops": 0}
out["paths"] = paths
print(json.dumps(out))
"""


def run_side(tree: Path, shape: str, reps: int) -> dict[str, Any]:
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
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def live_ratio(rounds: int, tree: Path | None) -> None:
    """A real server's meta.compute_ms for diagnostics "summary" over "none" at [1,8,8192,16]
    (its own thread count, kernels built at warm-up), requests alternating."""
    import tempfile

    import numpy as np

    if str(ROOT) not in sys.path:  # run as a script: make `bench` importable
        sys.path.insert(0, str(ROOT))
    from bench.support import live_server
    from sdpa_client import SDPAClient

    env = {"SDPA_COMPILE_KERNELS": "true"}
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 8192, 16)).astype(np.float32) for _ in range(3))
    with (
        tempfile.TemporaryDirectory() as tmp,
        # Building the kernels at warm-up takes minutes on a loaded 2-core machine.
        live_server(env, tmp_path=Path(tmp), tree=tree, ready_timeout=600.0) as server,
        SDPAClient(server.url, timeout=300.0) as client,
    ):
        kernels = client.info().get("kernels", {})
        ms: dict[str, list[float]] = {"none": [], "summary": []}
        path = "?"
        for i in range(rounds + 1):
            for level in ms:
                result = client.attention(q, k, v, diagnostics=level, return_output=False)
                assert result.meta is not None
                if i > 0:  # the first round warms up
                    ms[level].append(float(result.meta.compute_ms or 0.0))
                if level == "summary":
                    path = f"{result.meta.path} ({result.meta.backend})"
    none_ms, summary_ms = statistics.median(ms["none"]), statistics.median(ms["summary"])
    print(f"\nlive server ({tree or ROOT}), [1,8,8192,16], {rounds} rounds, kernels {kernels}")
    print("| none compute_ms | summary compute_ms | summary path | summary / none |")
    print("|---|---|---|---|")
    spread = f"{min(ms['summary']):.0f}-{max(ms['summary']):.0f}"
    print(
        f"| {none_ms:.0f} ({min(ms['none']):.0f}-{max(ms['none']):.0f}) | {summary_ms:.0f} "
        f"({spread}) | {path} | {summary_ms / none_ms:.2f} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", type=Path, help="a tree holding another sdpa_core to compare")
    ap.add_argument(
        "--shapes",
        default="1,4,64,64;1,8,1024,64;1,8,2048,64,causal;1,8,8192,16",
        help="B,H,N,D[,causal] shapes, ';'-separated",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--live", action="store_true", help="also a live server's summary / none")
    ap.add_argument("--live-only", action="store_true", help="only the live server's ratio")
    args = ap.parse_args()
    if args.live or args.live_only:
        live_ratio(args.rounds, None)  # this tree's (--before's has no service of its own)
        if args.live_only:
            return 0
    sides = {"after": ROOT} if args.before is None else {"before": args.before, "after": ROOT}
    print(f"load average before: {os.getloadavg()}")
    for shape in args.shapes.split(";"):
        n = int(shape.split(",")[2])
        reps = 300 if n <= 128 else 5 if n <= 1024 else 3
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, tree in sides.items():
                runs[side].append(run_side(tree, shape, reps))
        print(f"\n[{shape}] median of {args.rounds} rounds x {reps} calls (CPU time, one thread)")
        cases = [c for c in CASES if any(c in r for rs in runs.values() for r in rs)]
        ratios = ("fused/sdpa", "nocheck/sdpa", "summary/fused", "chunked/fused")
        print(f"| side | kernels | {' | '.join(cases)} | {' | '.join(ratios)} |")
        print("|---" * (len(cases) + len(ratios) + 2) + "|")
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
            summary_path = results[0].get("paths", {}).get("summary", "chunked")
            nocheck = med.get("fused_nocheck", float("nan"))
            chunked = med.get("chunked", med.get("summary_eager", float("nan")))
            values = (
                med["fused"] / med["sdpa"],
                nocheck / med["sdpa"],
                med["summary"] / med["fused"],
                chunked / med["fused"],
            )
            print(
                f"| {side} | {kernel}, summary on {summary_path} | "
                + " | ".join(cells)
                + " | "
                + " | ".join(f"{r:.2f}" for r in values)
                + " |"
            )
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
