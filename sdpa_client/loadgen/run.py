"""The run of a load test: closed loop (N workers) or open loop (Poisson arrivals), measured.

Closed loop (`LoadPlan(concurrency=N)`): N workers, each sends its next request when the
previous one answered; the server sets the pace. Open loop (`LoadPlan(rate=R)`): requests arrive
as a Poisson process of R per second whatever the server does, with at most `max_in_flight`
outstanding; an arrival that finds that bound full is counted as dropped (never sent). A run
always stops: after `duration_s` and/or `requests` arrivals; requests in flight then finish,
each bounded by `timeout_s`. The report gives the generator's own CPU use (process CPU time /
wall time): near 100% of one core, the generator, not the server, is the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

# Above this share of one core, the report warns that the generator may be the bottleneck.
GENERATOR_BUSY_PERCENT = 85.0

Sender = Callable[[], Awaitable[int]]
"""Sends one request and returns its HTTP status; raises on transport failure."""


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to run. Closed loop when rate is None (concurrency workers); open loop otherwise
    (Poisson arrivals at `rate` per second, at most `max_in_flight` outstanding)."""

    concurrency: int = 1
    rate: float | None = None
    max_in_flight: int = 256
    duration_s: float | None = None
    requests: int | None = None
    timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s is None and self.requests is None:
            raise ValueError("a load plan needs duration_s and/or requests (it must end)")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.concurrency < 1 or self.max_in_flight < 1:
            raise ValueError("concurrency and max_in_flight must be >= 1")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError("rate must be a positive number")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")

    @property
    def mode(self) -> Literal["closed", "open"]:
        return "closed" if self.rate is None else "open"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request: start (s since the run began), latency (s), HTTP status (0 when there was
    no answer) and the error kind ("503", "ReadTimeout", ...) or None when 2xx."""

    start_s: float
    latency_s: float
    status: int
    error: str | None


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Latency of the successful requests, in milliseconds (NaN when there were none)."""

    count: int
    min_ms: float
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, latencies_s: Sequence[float]) -> LatencySummary:
        if not latencies_s:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan)
        ms = np.asarray(latencies_s, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(x) for x in np.percentile(ms, [50, 90, 99]))
        return cls(len(ms), float(ms.min()), float(ms.mean()), p50, p90, p99, float(ms.max()))


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The outcome of one run. sent = ok + sum(errors.values()); dropped arrivals were never
    sent (open loop only). throughput_rps counts successful answers per second of the run."""

    mode: Literal["closed", "open"]
    concurrency: int
    rate: float | None
    sent: int
    ok: int
    errors: Mapping[str, int]
    dropped: int
    elapsed_s: float
    throughput_rps: float
    latency: LatencySummary
    client_cpu_s: float
    client_cpu_percent: float
    records: tuple[RequestRecord, ...] = field(repr=False)

    @property
    def generator_busy(self) -> bool:
        return self.client_cpu_percent >= GENERATOR_BUSY_PERCENT

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (every field but the per-request records)."""
        data = {k: v for k, v in asdict(self).items() if k != "records"}
        data["errors"] = dict(self.errors)
        # JSON has no NaN: a run without successes has no latencies.
        data["latency"] = {
            k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in data["latency"].items()
        }
        data["generator_busy"] = self.generator_busy
        return data


@dataclass(slots=True)
class _Tally:
    started: float
    records: list[RequestRecord] = field(default_factory=list)
    ok: int = 0
    failed: int = 0
    dropped: int = 0
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class Progress:
    """What a progress display needs, reported a few times per second."""

    elapsed_s: float
    done: int
    ok: int
    failed: int
    in_flight: int


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    return type(exc).__name__


async def _one(send: Sender, tally: _Tally, timeout_s: float) -> None:
    tally.in_flight += 1
    start = time.perf_counter()
    status = 0
    error: str | None
    try:
        async with asyncio.timeout(timeout_s):
            status = await send()
        error = None if 200 <= status < 300 else str(status)
    except Exception as exc:  # the generator must outlive any failure of one request
        error = _error_kind(exc)
    end = time.perf_counter()
    tally.in_flight -= 1
    tally.records.append(RequestRecord(start - tally.started, end - start, status, error))
    if error is None:
        tally.ok += 1
    else:
        tally.failed += 1


async def _closed_loop(send: Sender, plan: LoadPlan, tally: _Tally, stop_at: float) -> None:
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while time.perf_counter() < stop_at:
            if plan.requests is not None and issued >= plan.requests:
                return
            issued += 1
            await _one(send, tally, plan.timeout_s)

    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))


async def _open_loop(send: Sender, plan: LoadPlan, tally: _Tally, stop_at: float) -> None:
    assert plan.rate is not None
    rng = random.Random(plan.seed)
    tasks: set[asyncio.Task[None]] = set()
    arrivals = 0
    next_at = time.perf_counter()
    while plan.requests is None or arrivals < plan.requests:
        next_at += rng.expovariate(plan.rate)
        if next_at >= stop_at:
            break
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        arrivals += 1
        if tally.in_flight >= plan.max_in_flight:
            tally.dropped += 1
            continue
        task = asyncio.create_task(_one(send, tally, plan.timeout_s))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        # _one counts itself in flight only once it runs; yield so the bound above sees it.
        await asyncio.sleep(0)
    if tasks:
        await asyncio.gather(*tasks)


async def run_load(
    send: Sender,
    plan: LoadPlan,
    *,
    progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 0.25,
) -> LoadReport:
    """Drive `send` according to `plan` and measure every request."""
    cpu0 = time.process_time()
    started = time.perf_counter()
    stop_at = started + plan.duration_s if plan.duration_s is not None else math.inf
    tally = _Tally(started=started)

    async def ticker() -> None:
        assert progress is not None
        while True:
            await asyncio.sleep(progress_interval_s)
            progress(_progress(tally))

    ticker_task = asyncio.create_task(ticker()) if progress is not None else None
    try:
        if plan.mode == "closed":
            await _closed_loop(send, plan, tally, stop_at)
        else:
            await _open_loop(send, plan, tally, stop_at)
    finally:
        if ticker_task is not None:
            ticker_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker_task
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu0
    if progress is not None:
        progress(_progress(tally))
    errors = Counter(r.error for r in tally.records if r.error is not None)
    ok_latencies = [r.latency_s for r in tally.records if r.error is None]
    return LoadReport(
        mode=plan.mode,
        concurrency=plan.concurrency if plan.rate is None else plan.max_in_flight,
        rate=plan.rate,
        sent=len(tally.records),
        ok=tally.ok,
        errors=dict(sorted(errors.items())),
        dropped=tally.dropped,
        elapsed_s=elapsed,
        throughput_rps=tally.ok / elapsed if elapsed > 0 else 0.0,
        latency=LatencySummary.of(ok_latencies),
        client_cpu_s=cpu,
        client_cpu_percent=100.0 * cpu / elapsed if elapsed > 0 else 0.0,
        records=tuple(tally.records),
    )


def _progress(tally: _Tally) -> Progress:
    return Progress(
        elapsed_s=time.perf_counter() - tally.started,
        done=len(tally.records),
        ok=tally.ok,
        failed=tally.failed,
        in_flight=tally.in_flight,
    )
