"""Dynamic batching: what does it cost on CPU, what does it buy, does it survive overload?

    .venv/bin/python bench/batching.py             # ~5 min on 2 cores
    .venv/bin/python bench/batching.py --quick     # ~2 min: 1 s per run, 10 s soak

Three parts, each bounded in time and count:

1. HTTP, closed loop. Two real servers (`sdpa-service serve` on loopback, one uvicorn worker
   each): batching on (the defaults: SDPA_MAX_BATCH_SIZE=32, no delay) and batching off
   (SDPA_MAX_BATCH_SIZE=1). For each payload (small: q/k/v [1, 4, 64, 64], no diagnostics;
   medium: [1, 8, 256, 64] with weights and the summary), each traffic shape (same-shape, or
   mixed lengths N = N_q = N_kv uniform in [N/2, 3N/2]) and each concurrency (1, 8, 32, 64),
   the runs go on, off, off, on, twice (ABBA, so that drift in the shared machine's load hits
   both alike); each run is a warm-up then `--duration` seconds of measured requests. Bodies are
   base64 tensors encoded once, sent by httpx.AsyncClient. The mean batch size comes from the
   server's sdpa_batch_size histogram.
2. Soak: open loop at 4x the sustainable throughput (the best closed-loop small/same-shape
   figure with batching on) for `--soak-seconds`, from two client processes, against a server
   with a small queue (SDPA_MAX_QUEUE=256, SDPA_REQUEST_TIMEOUT_MS=5000) so that overload is
   answered (503, 504) rather than absorbed by the client's own in-flight cap. Reports every
   status, transport errors, and the server's RSS (after a warm-up, then every second).
3. Engine only, in process: Engine.run_batch on 32 jobs at once (on) vs 32 calls of one job
   (off), small and medium, same-shape and mixed (grouped by Engine.group_key as the batcher
   would). No HTTP: this is the GPU target's measurement; on CPU it is reported anyway.

Writes bench/results/batching.json and bench/results/batching.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `service` and `tests` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.support import BenchServer, live_server  # noqa: E402
from service.runtime.engine import Engine  # noqa: E402
from service.runtime.jobs import AttentionJob, PreparedJob, prepare  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
CONCURRENCY = (1, 8, 32, 64)
MAX_REQUESTS_PER_RUN = 20_000
HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class PayloadSpec:
    name: str
    heads: int
    n: int
    d: int
    return_weights: bool
    diagnostics: str


PAYLOADS = (
    PayloadSpec("small", heads=4, n=64, d=64, return_weights=False, diagnostics="none"),
    PayloadSpec("medium", heads=8, n=256, d=64, return_weights=True, diagnostics="summary"),
)
TRAFFIC = ("same", "mixed")


def lengths(spec: PayloadSpec, traffic: str, count: int, rng: random.Random) -> list[int]:
    if traffic == "same":
        return [spec.n] * count
    return [rng.randint(spec.n // 2, 3 * spec.n // 2) for _ in range(count)]


def tensors(spec: PayloadSpec, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, spec.heads, n, spec.d, generator=gen) for _ in range(3))


def b64(t: torch.Tensor) -> dict[str, Any]:
    import base64

    raw = t.numpy().astype("<f4").tobytes()
    return {"dtype": "float32", "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}


def bodies(spec: PayloadSpec, traffic: str, *, count: int = 32, seed: int = 0) -> list[bytes]:
    """`count` distinct request bodies, encoded once."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    out = []
    for n in lengths(spec, traffic, count, rng):
        q, k, v = tensors(spec, n, gen)
        body = {
            "q": b64(q),
            "k": b64(k),
            "v": b64(v),
            "return_weights": spec.return_weights,
            "diagnostics": spec.diagnostics,
        }
        out.append(json.dumps(body).encode())
    return out


# ---- closed-loop HTTP runs ------------------------------------------------------------------


@dataclass
class RunResult:
    requests: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    batch_sum: float = 0.0
    batch_count: float = 0.0


def scrape(url: str) -> tuple[float, float]:
    """(sum, count) of sdpa_batch_size."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("sdpa_batch_size_sum "):
            total = float(line.split()[1])
        elif line.startswith("sdpa_batch_size_count "):
            count = float(line.split()[1])
    return total, count


async def closed_loop(
    url: str,
    payloads: Sequence[bytes],
    *,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    min_per_connection: int = 10,
    max_s: float = 12.0,
) -> RunResult:
    """`concurrency` connections, each sending back to back.

    The window opens after the warm-up and closes once it lasted `duration_s` and saw at least
    `min_per_connection` completions per connection (a batch completes several requests at
    once, so short windows would count whole batches in or out by chance), or after `max_s`.
    Throughput counts completions inside the window; latencies are those of every request
    started inside it, waited for to the end (no censoring of slow ones).
    """
    result = RunResult()
    # keepalive_expiry below uvicorn's 5 s keep-alive timeout: no reuse of a closing connection.
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=1.0
    )
    window: dict[str, float] = {}  # "start", then "stop"
    completions = 0

    def stopped(now: float) -> bool:
        if "stop" in window:
            return True
        if "start" not in window:
            return False
        elapsed = now - window["start"]
        enough = elapsed >= duration_s and completions >= min_per_connection * concurrency
        if enough or elapsed >= max_s or completions >= MAX_REQUESTS_PER_RUN:
            window["stop"] = now
            return True
        return False

    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:

        async def worker(index: int) -> None:
            nonlocal completions
            i = index
            while not stopped(time.perf_counter()):
                body = payloads[i % len(payloads)]
                i += concurrency
                started = time.perf_counter()
                counted = "start" in window
                try:
                    response = await client.post("/v1/attention", content=body, headers=HEADERS)
                    status = str(response.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                done = time.perf_counter()
                if counted:
                    result.latencies_ms.append((done - started) * 1e3)
                    result.statuses[status] += 1
                if "start" in window and "stop" not in window:
                    completions += 1

        tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        await asyncio.sleep(warmup_s)
        before = await asyncio.to_thread(scrape, url)
        window["start"] = time.perf_counter()
        await asyncio.gather(*tasks)
        after = await asyncio.to_thread(scrape, url)
    result.requests = completions
    result.seconds = window["stop"] - window["start"]
    result.batch_sum, result.batch_count = after[0] - before[0], after[1] - before[1]
    return result


def summarize_runs(runs: Sequence[RunResult]) -> dict[str, Any]:
    latencies = np.array([x for r in runs for x in r.latencies_ms])
    requests = sum(r.requests for r in runs)
    seconds = sum(r.seconds for r in runs)
    statuses: Counter[str] = Counter()
    for r in runs:
        statuses.update(r.statuses)
    batch_count = sum(r.batch_count for r in runs)
    return {
        "requests": requests,
        "throughput_rps": requests / seconds if seconds else 0.0,
        "throughput_per_run": [r.requests / r.seconds if r.seconds else 0.0 for r in runs],
        "p50_ms": float(np.percentile(latencies, 50)) if latencies.size else None,
        "p99_ms": float(np.percentile(latencies, 99)) if latencies.size else None,
        "statuses": dict(statuses),
        "mean_batch_size": sum(r.batch_sum for r in runs) / batch_count if batch_count else None,
    }


@contextlib.contextmanager
def servers(tmp: Path) -> Iterator[dict[str, BenchServer]]:
    with (
        live_server({}, tmp_path=tmp) as on,
        live_server({"SDPA_MAX_BATCH_SIZE": "1"}, tmp_path=tmp) as off,
    ):
        yield {"on": on, "off": off}


def http_matrix(
    tmp: Path,
    *,
    duration_s: float,
    warmup_s: float,
    payload_names: Sequence[str],
    concurrencies: Sequence[int],
    rounds: int,
) -> list[dict[str, Any]]:
    cells: list[dict[str, Any]] = []
    with servers(tmp) as srv:
        for spec in PAYLOADS:
            if spec.name not in payload_names:
                continue
            for traffic in TRAFFIC:
                payloads = bodies(spec, traffic)
                for concurrency in concurrencies:
                    runs: dict[str, list[RunResult]] = {"on": [], "off": []}
                    for mode in ("on", "off", "off", "on") * rounds:  # ABBA
                        runs[mode].append(
                            asyncio.run(
                                closed_loop(
                                    srv[mode].url,
                                    payloads,
                                    concurrency=concurrency,
                                    warmup_s=warmup_s,
                                    duration_s=duration_s,
                                )
                            )
                        )
                    for mode in ("on", "off"):
                        cell = {
                            "payload": spec.name,
                            "traffic": traffic,
                            "concurrency": concurrency,
                            "batching": mode,
                            **summarize_runs(runs[mode]),
                        }
                        cells.append(cell)
                        print(
                            f"{spec.name:6} {traffic:5} c={concurrency:<3} {mode:3} "
                            f"{cell['throughput_rps']:8.1f} req/s  p50 {cell['p50_ms']:7.2f} ms  "
                            f"p99 {cell['p99_ms']:7.2f} ms  batch {cell['mean_batch_size']}",
                            flush=True,
                        )
    return cells


# ---- soak ----------------------------------------------------------------------------------


def _open_loop_client(
    url: str, payloads: list[bytes], rate: float, seconds: float, cap: int
) -> dict[str, int]:
    """One client process: `rate` requests/s for `seconds`, at most `cap` in flight."""

    async def main() -> dict[str, int]:
        counts: Counter[str] = Counter()
        limits = httpx.Limits(
            max_connections=cap, max_keepalive_connections=cap, keepalive_expiry=1.0
        )
        in_flight = 0
        async with httpx.AsyncClient(base_url=url, timeout=30.0, limits=limits) as client:

            async def one(body: bytes) -> None:
                nonlocal in_flight
                try:
                    response = await client.post("/v1/attention", content=body, headers=HEADERS)
                    counts[str(response.status_code)] += 1
                except httpx.HTTPError as exc:
                    counts[f"transport:{type(exc).__name__}"] += 1
                finally:
                    in_flight -= 1

            tasks: set[asyncio.Task[None]] = set()
            start = time.perf_counter()
            sent = 0
            while (now := time.perf_counter() - start) < seconds:
                due = int(now * rate)
                while sent < due:
                    sent += 1
                    if in_flight >= cap:
                        counts["not_sent_client_cap"] += 1
                        continue
                    in_flight += 1
                    task = asyncio.create_task(one(payloads[sent % len(payloads)]))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(0.002)
            counts["offered"] = sent
            if tasks:
                await asyncio.wait(tasks, timeout=60)
        return dict(counts)

    return asyncio.run(main())


def rss_bytes(pid: int) -> int:
    proc = psutil.Process(pid)
    return int(proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(True)))


def soak(tmp: Path, *, rate: float, seconds: float, warmup_s: float) -> dict[str, Any]:
    env = {"SDPA_MAX_QUEUE": "256", "SDPA_REQUEST_TIMEOUT_MS": "5000"}
    payloads = bodies(PAYLOADS[0], "same")
    procs, cap = 2, 400
    ctx = multiprocessing.get_context("spawn")
    with live_server(env, tmp_path=tmp) as server, ctx.Pool(procs) as pool:
        pid = server.process.pid
        # Warm-up at the same rate: first-touch allocations (allocator arenas, thread stacks,
        # connection buffers) are not growth.
        pool.starmap(
            _open_loop_client, [(server.url, payloads, rate / procs, warmup_s, cap)] * procs
        )
        rss_start = rss_bytes(pid)
        pending = pool.starmap_async(
            _open_loop_client, [(server.url, payloads, rate / procs, seconds, cap)] * procs
        )
        samples = []
        started = time.perf_counter()
        while not pending.ready():
            samples.append((round(time.perf_counter() - started, 1), rss_bytes(pid)))
            pending.wait(1.0)
        per_proc = pending.get()
        rss_end = rss_bytes(pid)
        alive = server.process.poll() is None
        healthy = httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        ready = httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
    counts: Counter[str] = Counter()
    for c in per_proc:
        counts.update(c)
    offered = counts.pop("offered", 0)
    responses = {k: v for k, v in counts.items() if k.isdigit()}
    peak = max([rss_end, *(s[1] for s in samples)])
    return {
        "target_rate_rps": rate,
        "seconds": seconds,
        "offered": offered,
        "achieved_offered_rps": offered / seconds,
        "counts": dict(counts),
        "only_200_503_504": set(responses) <= {"200", "503", "504"},
        "alive_after": alive and healthy,
        "ready_after": ready,
        "rss_start_mib": rss_start / 2**20,
        "rss_end_mib": rss_end / 2**20,
        "rss_peak_mib": peak / 2**20,
        "rss_growth_end": rss_end / rss_start - 1,
        "rss_growth_peak": peak / rss_start - 1,
        "rss_samples_mib": [(t, round(b / 2**20, 1)) for t, b in samples],
        "server_env": env,
    }


# ---- engine only ---------------------------------------------------------------------------


def engine_jobs(spec: PayloadSpec, traffic: str, count: int) -> list[PreparedJob]:
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    jobs = []
    for n in lengths(spec, traffic, count, rng):
        q, k, v = tensors(spec, n, gen)
        job = AttentionJob(
            q, k, v, return_weights=spec.return_weights, diagnostics=spec.diagnostics
        )
        jobs.append(prepare(job))
    return jobs


def _run_groups(engine: Engine, groups: list[list[PreparedJob]]) -> None:
    for group in groups:
        engine.run_batch(group)


def _rate(fn: Callable[[], None], *, items: int, seconds: float) -> float:
    """Items per second of fn() (which handles `items` jobs), bounded in time and count."""
    fn()  # warm
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds and done < 200 * items:
        fn()
        done += items
    return done / (time.perf_counter() - start)


def engine_bench(*, seconds: float, batch: int = 32) -> list[dict[str, Any]]:
    engine = Engine(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    engine.warmup()
    rows = []
    for spec in PAYLOADS:
        for traffic in TRAFFIC:
            jobs = engine_jobs(spec, traffic, batch)
            groups: dict[Any, list[PreparedJob]] = {}
            for job in jobs:
                groups.setdefault(engine.policy.group_key(job), []).append(job)

            batched = functools.partial(_run_groups, engine, list(groups.values()))
            single = functools.partial(_run_groups, engine, [[job] for job in jobs])

            rates: dict[str, list[float]] = {"on": [], "off": []}
            for mode, fn in (("on", batched), ("off", single), ("off", single), ("on", batched)):
                rates[mode].append(_rate(fn, items=batch, seconds=seconds / 2))
            on, off = statistics.mean(rates["on"]), statistics.mean(rates["off"])
            rows.append(
                {
                    "payload": spec.name,
                    "traffic": traffic,
                    "jobs_per_round": batch,
                    "groups": len(groups),
                    "device": str(engine.device),
                    "on_items_per_s": on,
                    "off_items_per_s": off,
                    "speedup": on / off,
                }
            )
            print(f"engine {spec.name} {traffic}: on {on:.0f}/s off {off:.0f}/s x{on / off:.2f}")
    return rows


# ---- report --------------------------------------------------------------------------------


def find(cells: list[dict[str, Any]], **key: Any) -> dict[str, Any]:
    return next(c for c in cells if all(c[k] == v for k, v in key.items()))


def complete(cells: list[dict[str, Any]]) -> bool:
    """True when every cell of the full matrix was measured (targets need all of them)."""
    have = {(c["payload"], c["traffic"], c["concurrency"], c["batching"]) for c in cells}
    return all(
        (p.name, t, c, m) in have
        for p in PAYLOADS
        for t in TRAFFIC
        for c in CONCURRENCY
        for m in ("on", "off")
    )


def targets(
    cells: list[dict[str, Any]], soak_result: dict[str, Any] | None
) -> list[dict[str, Any]]:
    out = []
    for p in ("small", "medium"):
        on1, off1 = (
            find(cells, payload=p, traffic="same", concurrency=1, batching="on"),
            find(cells, payload=p, traffic="same", concurrency=1, batching="off"),
        )
        ratio = on1["throughput_rps"] / off1["throughput_rps"]
        out.append({"target": f"{p}: c=1 on/off >= 0.95", "value": ratio, "pass": ratio >= 0.95})
        on32 = find(cells, payload=p, traffic="same", concurrency=32, batching="on")
        off32 = find(cells, payload=p, traffic="same", concurrency=32, batching="off")
        ratio = on32["throughput_rps"] / off32["throughput_rps"]
        out.append({"target": f"{p}: c=32 on/off >= 1.0", "value": ratio, "pass": ratio >= 1.0})
        out.append(
            {
                "target": f"{p}: c=32 p99 on <= off",
                "value": f"{on32['p99_ms']:.1f} vs {off32['p99_ms']:.1f} ms",
                "pass": on32["p99_ms"] <= off32["p99_ms"],
            }
        )
        mixed = find(cells, payload=p, traffic="mixed", concurrency=32, batching="on")
        ratio = mixed["throughput_rps"] / on32["throughput_rps"]
        out.append(
            {"target": f"{p}: c=32 mixed/same (on) >= 0.85", "value": ratio, "pass": ratio >= 0.85}
        )
    if soak_result is not None:
        out.append(
            {
                "target": "soak 4x: alive, only 200/503/504, RSS growth <= 20%",
                "value": f"alive={soak_result['alive_after']}, "
                f"statuses={sorted(soak_result['counts'])}, "
                f"RSS {soak_result['rss_growth_end']:+.1%} "
                f"(peak {soak_result['rss_growth_peak']:+.1%})",
                "pass": soak_result["alive_after"]
                and soak_result["only_200_503_504"]
                and soak_result["rss_growth_end"] <= 0.20
                and soak_result["rss_growth_peak"] <= 0.20,
            }
        )
    return out


def fmt(x: Any, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def spread(cell: dict[str, Any]) -> str:
    runs = cell.get("throughput_per_run") or []
    return f"{min(runs):.0f}-{max(runs):.0f}" if runs else "–"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Dynamic batching (bench/batching.py)",
        "",
        f"Command: `{report['command']}`  ",
        f"When: {report['when']}; machine: {report['machine']}; torch {report['torch']}.  ",
        "Noise: the machine is shared with other engineers' builds and tests while this runs; "
        "runs are interleaved on/off/off/on per cell, but absolute figures move by tens of "
        "percent between runs. Compare ratios within a cell, not across reports.",
        "",
    ]
    cells = report["http"]
    if cells:
        lines += [
            "## HTTP, closed loop (req/s, latency in ms)",
            "",
            "Each figure pools the cell's runs; the run-to-run range (min-max req/s) shows the "
            "noise. Where the mean batch is 1.0 both servers run the very same code path, so "
            "their difference is noise too.",
            "",
            "| payload | traffic | conc. | on req/s | off req/s | on/off | on runs | off runs "
            "| on p50 | off p50 | on p99 | off p99 | on mean batch |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        measured = sorted({(c["payload"], c["concurrency"]) for c in cells})
        for p in PAYLOADS:
            for traffic in TRAFFIC:
                for c in CONCURRENCY:
                    if (p.name, c) not in measured:
                        continue
                    on = find(cells, payload=p.name, traffic=traffic, concurrency=c, batching="on")
                    off = find(
                        cells, payload=p.name, traffic=traffic, concurrency=c, batching="off"
                    )
                    ratio = on["throughput_rps"] / off["throughput_rps"]
                    lines.append(
                        f"| {p.name} | {traffic} | {c} | {on['throughput_rps']:.0f} | "
                        f"{off['throughput_rps']:.0f} | {ratio:.2f} | {spread(on)} | "
                        f"{spread(off)} | {fmt(on['p50_ms'])} | "
                        f"{fmt(off['p50_ms'])} | {fmt(on['p99_ms'])} | {fmt(off['p99_ms'])} | "
                        f"{fmt(on['mean_batch_size'], '.1f')} |"
                    )
        lines.append("")
    if report["engine"]:
        lines += [
            "## Engine only, in process (items/s; 32 jobs per round)",
            "",
            "| payload | traffic | device | groups | on | off | on/off |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for r in report["engine"]:
            lines.append(
                f"| {r['payload']} | {r['traffic']} | {r['device']} | {r['groups']} | "
                f"{r['on_items_per_s']:.0f} | {r['off_items_per_s']:.0f} | {r['speedup']:.2f} |"
            )
        lines.append("")
    s = report["soak"]
    if s:
        lines += [
            "## Soak at 4x the sustainable load",
            "",
            f"Target {s['target_rate_rps']:.0f} req/s for {s['seconds']:.0f} s (two client "
            f"processes, <= 400 in flight each; server SDPA_MAX_QUEUE=256, "
            f"SDPA_REQUEST_TIMEOUT_MS=5000). Offered {s['offered']} "
            f"({s['achieved_offered_rps']:.0f} req/s achieved by the generator).  ",
            f"Outcomes: {s['counts']}.  ",
            f"Server alive and healthy after: {s['alive_after']}; ready: {s['ready_after']}.  ",
            f"RSS: {s['rss_start_mib']:.0f} MiB after warm-up -> {s['rss_end_mib']:.0f} MiB at "
            f"the end ({s['rss_growth_end']:+.1%}), peak {s['rss_peak_mib']:.0f} MiB "
            f"({s['rss_growth_peak']:+.1%}).",
            "",
        ]
    if report["targets"]:
        lines += ["## Targets", "", "| target | value | pass |", "|---|---|---|"]
        for t in report["targets"]:
            value = t["value"] if isinstance(t["value"], str) else f"{t['value']:.2f}"
            lines.append(f"| {t['target']} | {value} | {'yes' if t['pass'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 s runs, 10 s soak")
    parser.add_argument("--duration", type=float, default=1.5, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=0.3, help="warm-up seconds per run")
    parser.add_argument("--rounds", type=int, default=2, help="on/off/off/on rounds per cell")
    parser.add_argument("--soak-seconds", type=float, default=30.0)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--skip-soak", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--payloads", nargs="+", default=[p.name for p in PAYLOADS])
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite batching.md from batching.json"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        saved = json.loads((args.out / "batching.json").read_text())
        (args.out / "batching.md").write_text(markdown(saved) + "\n")
        return 0
    if args.quick:
        args.duration, args.soak_seconds, args.rounds = 1.0, 10.0, 1

    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    report: dict[str, Any] = {
        "command": " ".join(["python", "bench/batching.py", *(argv or sys.argv[1:])]),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at start",
        "torch": torch.__version__,
        "http": [],
        "soak": None,
        "engine": [],
        "targets": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp_dir:
        tmp = Path(tmp_dir)
        if not args.skip_http:
            report["http"] = http_matrix(
                tmp,
                duration_s=args.duration,
                warmup_s=args.warmup,
                payload_names=args.payloads,
                concurrencies=args.concurrency,
                rounds=args.rounds,
            )
        if not args.skip_soak:
            if report["http"]:
                sustainable = max(
                    c["throughput_rps"]
                    for c in report["http"]
                    if c["payload"] == "small" and c["traffic"] == "same" and c["batching"] == "on"
                )
            else:
                with live_server({}, tmp_path=tmp) as server:
                    run = asyncio.run(
                        closed_loop(
                            server.url,
                            bodies(PAYLOADS[0], "same"),
                            concurrency=32,
                            warmup_s=0.5,
                            duration_s=3.0,
                        )
                    )
                sustainable = run.requests / run.seconds
            report["sustainable_rps"] = sustainable
            report["soak"] = soak(tmp, rate=4 * sustainable, seconds=args.soak_seconds, warmup_s=3)
            print("soak:", {k: v for k, v in report["soak"].items() if k != "rss_samples_mib"})
    if not args.skip_engine:
        report["engine"] = engine_bench(seconds=2.0 if args.quick else 4.0)
    if report["http"] and complete(report["http"]):
        report["targets"] = targets(report["http"], report["soak"])
    report["load_average_end"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batching.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.out / "batching.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
