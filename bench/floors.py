"""What the small payload's fixed costs are on this machine, each measured alone.

    .venv/bin/python bench/floors.py     # ~1 min

The service issue asks for the small payload (B=1, H=4, N=64, D=64, base64, fused path) to cost
at most 1 ms over a no-op endpoint at concurrency 1. Three of its steps cannot be skipped: the
decode of the body (parse, validate, base64, the NaN/Inf scan), the hop to the device thread and
back (the issue wants compute off the event loop), and the compute. This script times each one
alone, in this process, with nothing else running:

- decode: service.serving.prepare.prepare_attention on the small body;
- hop: an empty call on a one-thread executor, answered to a uvloop event loop through
  call_soon_threadsafe (what the batcher does, without any work);
- compute: sdpa_core.attention on the small tensors, on a worker thread (as the engine runs it).

Each is timed back to back ("hot") and with a 2 ms pause between calls ("paced"), which is how
requests arrive at concurrency 1: a request costs about 3 ms end to end, and in between caches
cool and idle virtual CPUs are descheduled. Every loop is bounded in count.

Writes bench/results/floors.json and bench/results/floors.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `service` importable
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import uvloop  # noqa: E402

from sdpa_client.loadgen import PRESETS  # noqa: E402
from sdpa_core import attention  # noqa: E402
from service.runtime.policy import CostModel  # noqa: E402
from service.serving.prepare import prepare_attention  # noqa: E402
from service.settings import Settings  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
CALLS = 1500
PAUSE_S = 0.002


def small_body() -> tuple[bytes, list[torch.Tensor]]:
    """The small payload as sdpa-loadtest and bench/service.py send it, and its tensors."""
    preset = PRESETS["small"]
    body = json.dumps(preset.request(encoding="base64")).encode()
    return body, [torch.from_numpy(a) for a in preset.arrays()]


def p50_us(call: Callable[[], object], *, pause_s: float) -> float:
    """Median microseconds of call(), after a warm-up, with `pause_s` between calls."""
    for _ in range(50):
        call()
    times = []
    for _ in range(CALLS):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
        if pause_s:
            time.sleep(pause_s)
    return statistics.median(times) * 1e6


def hop_p50_us(pause_s: float) -> float:
    """Loop -> executor thread -> loop for an empty call (the batcher's path, no work)."""
    executor = ThreadPoolExecutor(max_workers=1)

    async def measure() -> float:
        loop = asyncio.get_running_loop()

        async def hop() -> None:
            done: asyncio.Future[None] = loop.create_future()
            executor.submit(loop.call_soon_threadsafe, done.set_result, None)
            await done

        for _ in range(50):
            await hop()
        times = []
        for _ in range(CALLS):
            started = time.perf_counter()
            await hop()
            times.append(time.perf_counter() - started)
            if pause_s:
                await asyncio.sleep(pause_s)  # the loop waits for the next request
        return statistics.median(times) * 1e6

    try:
        return uvloop.run(measure())
    finally:
        executor.shutdown()


def run() -> dict[str, Any]:
    body, (q, k, v) = small_body()
    settings = Settings(device="cpu")
    cost = CostModel.uncalibrated()  # the limits' arithmetic costs the same with any figures
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-device")
    figures: dict[str, dict[str, float]] = {}
    for label, pause in (("hot", 0.0), ("paced", PAUSE_S)):
        figures[label] = {
            "decode_us": p50_us(lambda: prepare_attention(body, settings, cost), pause_s=pause),
            "hop_us": hop_p50_us(pause),
            "compute_us": worker.submit(
                p50_us, lambda: attention(q, k, v, check_finite=False), pause_s=pause
            ).result(),
        }
        figures[label]["sum_us"] = sum(figures[label].values())
    worker.shutdown()
    return {
        "benchmark": "floors",
        "command": ".venv/bin/python bench/floors.py",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg()[0],
        },
        "shape": list(PRESETS["small"].shape),
        "calls": CALLS,
        "pause_ms": PAUSE_S * 1e3,
        "p50_us": {k: {n: round(x, 1) for n, x in v.items()} for k, v in figures.items()},
    }


def markdown(result: dict[str, Any]) -> str:
    machine = result["machine"]
    rows = result["p50_us"]
    lines = [
        "# Floors of the small payload (fixed costs, each alone)",
        "",
        f"`{result['command']}` — {result['when']}, {machine['cpus']} CPUs, torch "
        f"{machine['torch']} ({machine['torch_threads']} threads), load average "
        f"{machine['load_average']:.2f}. p50 of {result['calls']} calls, in µs; paced = "
        f"{result['pause_ms']:.0f} ms between calls, as requests arrive at concurrency 1.",
        "",
        "| timing | decode (prepare_attention) | thread hop (empty) | compute (attention) | sum |",
        "|---|---:|---:|---:|---:|",
    ]
    for label in ("hot", "paced"):
        r = rows[label]
        lines.append(
            f"| {label} | {r['decode_us']:.0f} | {r['hop_us']:.0f} | {r['compute_us']:.0f} "
            f"| {r['sum_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    result = run()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "floors.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = markdown(result)
    (RESULTS / "floors.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
