"""Summary diagnostics with the compiled statistics kernel, with the eager loop, and the fused
path, interleaved call by call in one process (a benchmark, never a test).

    .venv/bin/python bench/kernel_ab.py             # the three shapes of issue 26
    .venv/bin/python bench/kernel_ab.py --rounds 20

One torch thread, fp32, seeded inputs. Each round runs every case once, in an order that
alternates between rounds, so that load drifting on the shared machine falls on all alike; a
case's figure is the median CPU time (process_time) over the rounds, and a ratio is the median
of the per-round ratios. "kernel" is attention(..., diagnostics="summary") after
compile_kernels() (the service's warm-up), "eager" the same inside kernel_mode("off"), "fused"
attention() without diagnostics, "sdpa" torch's SDPA called directly.

Targets (issue 26): summary / fused <= 2.0 at [1,4,64,64]; <= 1.5 at [1,8,1024,64] and
[1,8,2048,64] causal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

from sdpa_core import attention, compile_kernels, kernel_mode

SHAPES = ((1, 4, 64, 64, False), (1, 8, 1024, 64, False), (1, 8, 2048, 64, True))


def cases(shape: tuple[int, int, int, int, bool]) -> dict[str, Callable[[], object]]:
    b, h, n, d, causal = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))

    def eager() -> object:
        with kernel_mode("off"):
            return attention(q, k, v, causal=causal, diagnostics="summary")

    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "fused": lambda: attention(q, k, v, causal=causal),
        "kernel": lambda: attention(q, k, v, causal=causal, diagnostics="summary"),
        "eager": eager,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=0, help="0: 400 for small shapes, else 12")
    args = ap.parse_args()
    torch.set_num_threads(1)
    stats = compile_kernels()
    print(f"kernel compiled: {stats.compiled} in {stats.compile_s:.1f} s ({stats.reason or 'ok'})")
    print(f"load average before: {os.getloadavg()}")
    header = ("shape", "sdpa", "fused", "summary, kernel", "summary, eager", "kernel/fused")
    print("| " + " | ".join(header) + " | eager/fused |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    results = []
    for shape in SHAPES:
        fns = cases(shape)
        for fn in fns.values():
            fn()
        rounds = args.rounds or (400 if shape[2] <= 128 else 12)
        times: dict[str, list[float]] = {name: [] for name in fns}
        order = list(fns.items())
        for r in range(rounds):
            for name, fn in order if r % 2 == 0 else order[::-1]:
                started = time.process_time()
                fn()
                times[name].append(time.process_time() - started)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        ratio = {
            name: statistics.median(a / f for a, f in zip(times[name], times["fused"], strict=True))
            for name in ("kernel", "eager")
        }
        b, h, n, d, causal = shape
        label = f"[{b},{h},{n},{d}]" + (" causal" if causal else "")
        print(
            f"| {label} | {med['sdpa']:.3f} | {med['fused']:.3f} | {med['kernel']:.3f} | "
            f"{med['eager']:.3f} | {ratio['kernel']:.2f} | {ratio['eager']:.2f} |"
        )
        results.append({"shape": label, "ms": med, "ratio_to_fused": ratio, "rounds": rounds})
    print(f"load average after: {os.getloadavg()}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
