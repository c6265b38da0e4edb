"""The GPU figures of issue 15, in one run: engine batching on vs off, and the fused path's
attention TFLOP/s against torch's SDPA called directly.

1. Engine throughput on the small payload (q, k, v [4, 64, 64] per request, fused path) with
   32 requests at a time (c = 32): Engine.run_batch on the 32 as the batcher groups them (on)
   vs 32 calls of one (off), the two alternated twice. Goal: on / off >= 3.
2. Attention TFLOP/s (4 * B * H * N_q * N_kv * D, halved for causal) of sdpa_core's fused path
   (attention(), what the engine calls) ÷ torch.nn.functional.scaled_dot_product_attention on
   the same tensors, alternated, timed with CUDA events. Goal: >= 0.95.
3. Summary diagnostics ÷ the fused path and ÷ SDPA at N >= 1024 (issues 26, 37), on the path
   attention() chooses (the flash path: the Triton kernel on CUDA; the CPU kernel, built
   first by compile_kernels(), on the CPU) and on the chunked path by name, fp16 and bf16 on
   CUDA. Goal: summary ÷ SDPA <= 1.3.

Runs on CUDA; `--device cpu` runs the same measurements on the CPU (the issue's goals are
for a GPU). Writes bench/results/gpu.json and gpu.md (gpu-cpu.* with --device cpu).

    .venv/bin/python bench/gpu.py                 # on a machine with CUDA
    .venv/bin/python bench/gpu.py --device cpu --seconds 2
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
from torch.nn.functional import scaled_dot_product_attention

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench`, `service` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.batching import PAYLOADS, _rate, _run_groups, engine_jobs  # noqa: E402
from sdpa_core import attention  # noqa: E402
from service.runtime.engine import Engine  # noqa: E402
from service.runtime.jobs import PreparedJob  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
CONCURRENCY = 32
# (B, H, N, D, causal): the shapes of FlashAttention's own benchmarks, and a decoding-sized one.
SHAPES = [
    (8, 16, 1024, 64, False),
    (4, 16, 2048, 64, False),
    (2, 16, 4096, 64, False),
    (2, 16, 4096, 128, False),
    (2, 16, 4096, 64, True),
    (1, 32, 8192, 128, True),
]
# Issue 26's summary-diagnostics shapes (N >= 1024).
SUMMARY_SHAPES = [(1, 8, 1024, 64, False), (1, 8, 2048, 64, True), (4, 16, 4096, 64, False)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_batching(device: torch.device, seconds: float) -> dict[str, Any]:
    engine = Engine(device)
    engine.warmup()
    small = next(spec for spec in PAYLOADS if spec.name == "small")
    jobs = engine_jobs(small, "same", CONCURRENCY)
    groups: dict[Any, list[PreparedJob]] = {}
    for job in jobs:
        groups.setdefault(engine.policy.group_key(job), []).append(job)
    batched = functools.partial(_run_groups, engine, list(groups.values()))
    single = functools.partial(_run_groups, engine, [[job] for job in jobs])
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for mode, fn in (("on", batched), ("off", single), ("off", single), ("on", batched)):
        rates[mode].append(_rate(fn, items=CONCURRENCY, seconds=seconds / 2))
    on, off = statistics.mean(rates["on"]), statistics.mean(rates["off"])
    return {
        "payload": "small",
        "concurrency": CONCURRENCY,
        "groups": len(groups),
        "on_requests_per_s": on,
        "off_requests_per_s": off,
        "speedup": on / off,
        "goal": 3.0,
    }


def timed(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls after two warm ones (CUDA events on a GPU)."""
    for _ in range(2):
        call()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def fused_against_sdpa(
    device: torch.device, dtype: torch.dtype, repeats: int
) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES if device.type == "cuda" else [(1, 8, 1024, 64, False), (1, 8, 2048, 64, True)]
    for b, h, n, d, causal in shapes:
        q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device, dtype) for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        ours = functools.partial(attention, q, k, v, causal=causal)
        theirs = functools.partial(scaled_dot_product_attention, q, k, v, is_causal=causal)
        seconds: dict[str, list[float]] = {"fused": [], "sdpa": []}
        for name, call in (("fused", ours), ("sdpa", theirs), ("sdpa", theirs), ("fused", ours)):
            seconds[name].append(timed(call, device, repeats))
        fused_s, sdpa_s = min(seconds["fused"]), min(seconds["sdpa"])
        rows.append(
            {
                "shape": [b, h, n, d],
                "causal": causal,
                "dtype": str(dtype).removeprefix("torch."),
                "backend": attention(q, k, v, causal=causal).backend,
                "fused_tflops": flops / fused_s / 1e12,
                "sdpa_tflops": flops / sdpa_s / 1e12,
                "ratio": sdpa_s / fused_s,
                "goal": 0.95,
            }
        )
        del q, k, v
    return rows


def summary_against_fused(
    device: torch.device, dtype: torch.dtype, repeats: int
) -> list[dict[str, Any]]:
    """Issue 26's GPU target: attention(..., diagnostics="summary") ÷ the fused path and ÷
    torch's SDPA (flash or cuDNN) on the same tensors, alternated, at N >= 1024."""
    from sdpa_core import compile_kernels

    compile_kernels()  # the CPU flash kernel, as the service's warm-up builds it
    rows = []
    gen = torch.Generator().manual_seed(1)
    shapes = SUMMARY_SHAPES if device.type == "cuda" else [(1, 8, 1024, 64, False)]
    dtypes = [dtype] if device.type != "cuda" else [dtype, torch.bfloat16]
    for (b, h, n, d, causal), dt in ((s, t) for s in shapes for t in dict.fromkeys(dtypes)):
        q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device, dt) for _ in range(3))
        stats = functools.partial(attention, q, k, v, causal=causal, diagnostics="summary")
        calls = {
            "summary": stats,
            "chunked": functools.partial(stats, path="chunked"),
            "fused": functools.partial(attention, q, k, v, causal=causal),
            "sdpa": functools.partial(scaled_dot_product_attention, q, k, v, is_causal=causal),
        }
        ran = stats()
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        for order in (tuple(calls), tuple(reversed(calls))):
            for name in order:
                seconds[name].append(timed(calls[name], device, repeats))
        best = {name: min(values) for name, values in seconds.items()}
        rows.append(
            {
                "shape": [b, h, n, d],
                "causal": causal,
                "dtype": str(dt).removeprefix("torch."),
                "summary_path": f"{ran.path} ({ran.backend})",
                "summary_ms": best["summary"] * 1e3,
                "chunked_ms": best["chunked"] * 1e3,
                "fused_ms": best["fused"] * 1e3,
                "sdpa_ms": best["sdpa"] * 1e3,
                "summary_over_fused": best["summary"] / best["fused"],
                "summary_over_sdpa": best["summary"] / best["sdpa"],
                "chunked_over_sdpa": best["chunked"] / best["sdpa"],
                "goal": 1.3,
            }
        )
        del q, k, v
    return rows


def markdown(report: dict[str, Any]) -> str:
    e = report["engine_batching"]
    lines = [
        f"# GPU figures (bench/gpu.py) on {report['device_name']}",
        "",
        f"{report['date']}, torch {report['torch']}.",
        "",
        f"Engine, small payload, c = {e['concurrency']}: batching on {e['on_requests_per_s']:.0f} "
        f"requests/s, off {e['off_requests_per_s']:.0f}/s: {e['speedup']:.2f}x (goal >= 3x: "
        f"{'met' if e['speedup'] >= 3 else 'missed'}).",
        "",
        "| shape [B, H, N, D] | causal | dtype | backend | fused TFLOP/s | SDPA TFLOP/s | ratio |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in report["fused_vs_sdpa"]:
        met = "met" if r["ratio"] >= r["goal"] else "missed"
        lines.append(
            f"| {r['shape']} | {r['causal']} | {r['dtype']} | {r['backend']} | "
            f"{r['fused_tflops']:.2f} | {r['sdpa_tflops']:.2f} | {r['ratio']:.3f} ({met}) |"
        )
    lines += [
        "",
        'Summary diagnostics (attention(..., diagnostics="summary")) against the fused path and',
        "torch's SDPA, best of alternated medians (issue 37's goal: summary ÷ SDPA <= 1.3):",
        "",
        "| shape [B, H, N, D] | causal | dtype | summary path | summary ms | chunked ms | fused ms "
        "| SDPA ms | summary ÷ fused | summary ÷ SDPA | chunked ÷ SDPA |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["summary_vs_fused"]:
        met = "met" if r["summary_over_sdpa"] <= r["goal"] else "missed"
        lines.append(
            f"| {r['shape']} | {r['causal']} | {r['dtype']} | {r['summary_path']} | "
            f"{r['summary_ms']:.3f} | {r['chunked_ms']:.3f} | {r['fused_ms']:.3f} | "
            f"{r['sdpa_ms']:.3f} | {r['summary_over_fused']:.2f} | "
            f"{r['summary_over_sdpa']:.2f} ({met}) | {r['chunked_over_sdpa']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--seconds", type=float, default=6.0, help="engine phase length")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per kernel")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here (use --device cpu for the CPU figures)")
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the same math on both sides
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "engine_batching": engine_batching(device, args.seconds),
        "fused_vs_sdpa": fused_against_sdpa(device, dtype, args.repeats),
        "summary_vs_fused": summary_against_fused(device, dtype, args.repeats),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "gpu" if device.type == "cuda" else "gpu-cpu"
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (RESULTS / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
