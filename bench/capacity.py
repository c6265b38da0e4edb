"""The capacity plan's figures: what one replica serves here (measured) and on an H100
(derived), and the replicas that 1k, 10k and 100k requests per second of each payload need.

Measured, here: for each payload (bench/service.py's small, medium and large, sent as v2
binary, the cheapest door for tensors), a closed loop at concurrency 8 against one real server
for `--seconds`: its throughput, the server process's CPU time per request (user + system over
the requests answered), the device's compute time per request (sdpa_compute_seconds), and the
event loop's CPU time per request (the main thread's, /proc/PID/task/PID/stat): the host's
serial work, HTTP, framing, batching and what is decoded and encoded on the loop. (The server's
CPU less the device's wall time times its threads said 0 for medium and large: the device's
kernels do not keep both cores busy, so that difference is no measure of the host.)

Derived, for an H100: the host's work per request is the same code on a similar core, so it is
taken as measured here; the device's work per request is the cost model's FLOPs (the one owner:
service.runtime.policy) at FlashAttention-3's published forward throughput, 740 TFLOP/s in FP16
(Shah et al. 2024, H100 SXM5, head dim 64-128, about 75% of the 989 TFLOP/s dense peak), plus
the per-call floor the fused path showed on an H200 (bench/results/gpu.md: 0.2 ms at
[1, 8, 1024, 64] with the NaN/Inf checks, whatever the size below it), shared by a batch of
--gpu-batch requests. A replica is one event loop, its serial host work, so its throughput is
min(1 / the loop's CPU per request, batch / device time per batch). That host time leaves out
what runs beside the loop (large bodies decoded on worker threads) and the loop's waits for the
GIL: with cores to spare, an upper bound of the host's rate, not a promise.

Replicas for a rate: ceil(rate / (replica throughput x --headroom)), headroom 0.7 by default
(a replica run at 70% of its closed-loop maximum keeps its queue, and so its latency, short).
KEDA's threshold (deploy/k8s/base/hpa.yaml: sdpa_backlog_seconds per pod) follows from the
latency a client accepts: a backlog of T seconds per pod is a wait of about T seconds.

    .venv/bin/python bench/capacity.py               # about 1.5 minutes
Results: bench/results/capacity.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.support import live_server  # noqa: E402
from sdpa_client.loadgen import PRESETS, HttpSender, LoadPlan, Payload, run_load  # noqa: E402
from service.runtime.policy import WorkShape, path_flops  # noqa: E402

FA3_TFLOPS = 740.0  # FP16 forward, H100 SXM5 (FlashAttention-3 paper, Table/Fig. "fwd")
H200_CALL_FLOOR_MS = 0.2  # the fused path's call at [1, 8, 1024, 64] fp16 (bench/results/gpu.md)
RATES = (1_000, 10_000, 100_000)


def _cpu_s(pid: int, thread: int | None = None) -> float:
    """CPU seconds of process `pid`, or of its thread `thread` only."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / 100.0  # CLK_TCK is 100 on Linux


def _compute_ms(url: str) -> tuple[float, float]:
    """(sum of compute seconds, count) from the server's sdpa_compute_seconds histograms."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("sdpa_compute_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("sdpa_compute_seconds_count"):
            count += float(line.split()[-1])
    return total, count


async def _measure(url: str, pid: int, name: str, seconds: float) -> dict[str, float]:
    preset = PRESETS[name]
    payload = Payload.from_preset(preset, protocol="v2")
    async with HttpSender(url, payload) as send:
        await run_load(send, LoadPlan(concurrency=8, duration_s=2.0))  # warm: pools, caches
        loop0 = _cpu_s(pid, thread=pid)  # the main thread runs the event loop
        cpu0, (compute0, _) = _cpu_s(pid), await asyncio.to_thread(_compute_ms, url)
        report = await run_load(send, LoadPlan(concurrency=8, duration_s=seconds))
        cpu1, (compute1, _) = _cpu_s(pid), await asyncio.to_thread(_compute_ms, url)
        loop1 = _cpu_s(pid, thread=pid)
    ok = max(report.ok, 1)
    cpu_ms = (cpu1 - cpu0) / ok * 1000.0
    # A batch's compute is observed once per batch: per request, divide by the requests.
    device_wall_ms = (compute1 - compute0) / ok * 1000.0
    return {
        "throughput_rps": report.throughput_rps,
        "server_cpu_ms_per_request": cpu_ms,
        "device_ms_per_request": device_wall_ms,
        "host_ms_per_request": (loop1 - loop0) / ok * 1000.0,
        "errors": float(sum(report.errors.values())),
        "p50_ms": report.latency.p50_ms,
    }


def _h100(preset_name: str, host_ms: float, gpu_batch: int) -> dict[str, float]:
    preset = PRESETS[preset_name]
    shape = WorkShape(preset.batch, preset.heads, preset.n, preset.n, preset.d, preset.d)
    flops = path_flops(shape, "fused", d_floor=0)
    # Weights (medium) cost the dense path's extra passes over n^2: counted as 2x, generously.
    if preset.return_weights:
        flops *= 2
    device_batch_ms = H200_CALL_FLOOR_MS + gpu_batch * flops / (FA3_TFLOPS * 1e12) * 1000.0
    device_rps = gpu_batch / device_batch_ms * 1000.0
    host_rps = 1000.0 / host_ms if host_ms > 0 else math.inf
    return {
        "flops_per_request": flops,
        "device_rps": device_rps,
        "host_rps": host_rps,
        "replica_rps": min(device_rps, host_rps),
        "bound": "device" if device_rps < host_rps else "host",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--headroom", type=float, default=0.7)
    parser.add_argument("--gpu-batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "capacity")
    args = parser.parse_args()
    measured: dict[str, dict[str, float]] = {}
    env = {"SDPA_COMPILE_KERNELS": "false"}
    with tempfile.TemporaryDirectory() as tmp, live_server(env, tmp_path=Path(tmp)) as server:
        for name in PRESETS:
            pid = server.process.pid
            measured[name] = asyncio.run(_measure(server.url, pid, name, args.seconds))
            print(name, {k: round(v, 2) for k, v in measured[name].items()}, flush=True)
    derived = {n: _h100(n, m["host_ms_per_request"], args.gpu_batch) for n, m in measured.items()}

    def replicas(rps: float) -> list[int]:
        return [math.ceil(rate / (rps * args.headroom)) for rate in RATES]

    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": args.seconds,
        "headroom": args.headroom,
        "gpu_batch": args.gpu_batch,
        "measured_here": measured,
        "derived_h100": derived,
        "replicas_here": {n: replicas(m["throughput_rps"]) for n, m in measured.items()},
        "replicas_h100": {n: replicas(d["replica_rps"]) for n, d in derived.items()},
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Capacity: one replica, measured here and derived for an H100",
        "",
        f"`.venv/bin/python bench/capacity.py` ({result['when']}; 2-core CPU, v2 binary, "
        f"closed loop c=8, {args.seconds:g} s per payload; headroom {args.headroom}, "
        f"GPU batch {args.gpu_batch}).",
        "",
        "| payload | req/s here (measured) | server CPU ms/req | device wall ms/req | "
        "event-loop CPU ms/req | H100 device req/s (derived) | H100 host req/s (derived) | "
        "H100 replica req/s | bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, m in measured.items():
        d = derived[name]
        lines.append(
            f"| {name} | {m['throughput_rps']:.1f} | {m['server_cpu_ms_per_request']:.2f} | "
            f"{m['device_ms_per_request']:.2f} | {m['host_ms_per_request']:.2f} | "
            f"{d['device_rps']:,.0f} | {d['host_rps']:,.0f} | {d['replica_rps']:,.0f} | "
            f"{d['bound']} |"
        )
    lines += [
        "",
        "Replicas needed (at the headroom above):",
        "",
        "| payload | here: 1k / 10k / 100k req/s | H100: 1k / 10k / 100k req/s |",
        "|---|---|---|",
    ]
    for name in measured:
        here = " / ".join(f"{r:,}" for r in result["replicas_here"][name])
        gpu = " / ".join(f"{r:,}" for r in result["replicas_h100"][name])
        lines.append(f"| {name} | {here} | {gpu} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
