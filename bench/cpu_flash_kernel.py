"""The CPU flash kernel alone against torch's SDPA on the same inputs (a benchmark, never a test).

    .venv/bin/python bench/cpu_flash_kernel.py                 # one thread, the issue's shapes
    .venv/bin/python bench/cpu_flash_kernel.py --threads 2

One process: cpu_flash.build() first (compiled, or from torch's extension cache), then per
shape, round by round, SDPA (torch.nn.functional.scaled_dot_product_attention, its fused CPU
kernel) and the kernel's flash_tile over the whole sequence as one tile (the output and every
RowStats field), each called enough times for about 50 ms, alternated so that load drifting on
a shared machine falls on both alike. On one thread a timing is CPU time (process_time: what
the call costs on an idle core); on more, wall time. Printed: each side's median and the
median and range of the per-round ratios kernel / SDPA. bench/diagnostics_cost.py measures
the whole library call (summary / fused) that the issue's targets are about.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn.functional import scaled_dot_product_attention

from sdpa_core.kernels import cpu_flash

Clock = Callable[[], float]


def measure(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, rounds: int, clock: Clock
) -> dict[str, list[float]]:
    """Seconds per call of SDPA and of the kernel, one entry per round, alternated."""

    def sdpa() -> object:
        return scaled_dot_product_attention(q, k, v, is_causal=causal)

    def flash() -> object:
        return cpu_flash.flash_tile(
            q,
            k,
            v,
            scale=1 / math.sqrt(q.shape[-1]),
            q_start=0,
            causal_shift=0 if causal else None,
            key_lengths=None,
            visible=None,
            bias=None,
            sink_tokens=4,
        )

    with torch.no_grad():
        started = clock()
        sdpa()
        flash()  # warm both
        calls = max(1, int(0.05 / max(clock() - started, 1e-6)))
        times: dict[str, list[float]] = {"sdpa": [], "flash": []}
        for _ in range(rounds):
            for name, fn in (("sdpa", sdpa), ("flash", flash)):
                started = clock()
                for _ in range(calls):
                    fn()
                times[name].append((clock() - started) / calls)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--shapes",
        default="1,4,64,64;1,8,1024,64;1,8,2048,64,causal;1,8,8192,16",
        help="B,H,N,D[,causal] shapes, ';'-separated",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    ok, why = cpu_flash.build()
    if not ok:
        raise SystemExit(f"the CPU flash kernel is not available: {why}")
    torch.set_num_threads(args.threads)
    clock: Clock = time.process_time if args.threads == 1 else time.perf_counter
    print(f"torch threads {args.threads}, {'CPU' if args.threads == 1 else 'wall'} time")
    for spec in args.shapes.split(";"):
        parts = spec.split(",")
        b, h, n, d = (int(x) for x in parts[:4])
        causal = parts[4:] == ["causal"]
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
        times = measure(q, k, v, causal=causal, rounds=args.rounds, clock=clock)
        ratios = [f / s for f, s in zip(times["flash"], times["sdpa"], strict=True)]
        print(
            f"[{spec}] sdpa {statistics.median(times['sdpa']) * 1e3:.3f} ms, "
            f"kernel {statistics.median(times['flash']) * 1e3:.3f} ms, kernel / sdpa "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"over {args.rounds} rounds"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
