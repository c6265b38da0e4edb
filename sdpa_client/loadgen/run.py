"""The run of a load test: closed loop (N workers) or open loop (Poisson arrivals), measured.

Closed loop (`LoadPlan(concurrency=N)`): N workers, each sends its next request when the
previous one answered; the server sets the pace. Open loop (`LoadPlan(rate=R)`): requests arrive
as a Poisson process of R per second whatever the server does, with at most `max_in_flight`
outstanding; an arrival that finds that bound full is counted as dropped (never sent). A run
always stops: after `duration_s` and/or `requests` arrivals; requests in flight then finish,
each bounded by `timeout_s`. The report gives the generator's own CPU use (process CPU time /
wall time): near 100% of one core, the generator, not the server, is the limit.

Several tenants at once (`run_tenants`): each `TenantLoad` has its own sender (its API key, its
payload) and its own plan, all started together; the report measures each tenant apart (its
latency percentiles, its errors by status, its 429s) and all of them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import httpx
import numpy as np

# Above this share of one core, the report warns that the generator may be the bottleneck.
GENERATOR_BUSY_PERCENT = 85.0
# Failures that mean nothing listens at the URL (refused, no route, DNS, connect timeout), as
# opposed to a server that answered or a connection lost mid-request.
CONNECT_FAILURES: tuple[type[BaseException], ...] = (
    httpx.ConnectError, httpx.ConnectTimeout, ConnectionRefusedError,
)  # fmt: skip

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
    # A run (or tenant) whose every request failed to connect for this long, with no answer
    # at all, gives up: a closed port would otherwise be hammered for the whole duration and
    # reported as 100% errors with no latencies. One answer of any status keeps it going.
    connect_give_up_s: float = 2.0

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
    no answer), the error kind ("503", "ReadTimeout", ...) or None when 2xx, and the tenant that
    sent it (None outside a multi-tenant run)."""

    start_s: float
    latency_s: float
    status: int
    error: str | None
    tenant: str | None = None


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
    # Set when the run stopped early because nothing could be connected to (LoadPlan's
    # connect_give_up_s): the kinds of failure it met, e.g. "ConnectError".
    gave_up: str | None = None

    @property
    def generator_busy(self) -> bool:
        return self.client_cpu_percent >= GENERATOR_BUSY_PERCENT

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (every field but the per-request records)."""
        data = _fields_but(self, "records")
        data["errors"] = dict(self.errors)
        data["latency"] = _latency_json(self.latency)
        data["generator_busy"] = self.generator_busy
        return data


def _fields_but(report: LoadReport | TenantReport, *left_out: str) -> dict[str, Any]:
    # Not asdict(report): it would copy every per-request record first.
    return {f.name: getattr(report, f.name) for f in fields(report) if f.name not in left_out}


def _latency_json(latency: LatencySummary) -> dict[str, Any]:
    # JSON has no NaN: a run without successes has no latencies.
    return {
        k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(latency).items()
    }


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant of a multi-tenant run: its name (the report's label; unique within the run),
    the sender of its requests (which carries its API key and payload), and its plan."""

    name: str
    send: Sender
    plan: LoadPlan


@dataclass(frozen=True, slots=True)
class TenantReport:
    """One tenant's part of a multi-tenant run. sent = ok + sum(errors.values()); errors by
    kind as in `LoadReport` ("429", "503", "ConnectError", ...); latency over its successful
    requests; throughput_rps its successful answers per second of the whole run."""

    name: str
    mode: Literal["closed", "open"]
    concurrency: int
    rate: float | None
    sent: int
    ok: int
    errors: Mapping[str, int]
    dropped: int
    throughput_rps: float
    latency: LatencySummary
    records: tuple[RequestRecord, ...] = field(repr=False)

    @property
    def rate_limited(self) -> int:
        """Its requests answered 429: its share of the server's queue was full."""
        return self.errors.get("429", 0)

    @classmethod
    def of(
        cls,
        name: str,
        plan: LoadPlan,
        records: Sequence[RequestRecord],
        *,
        dropped: int = 0,
        elapsed_s: float,
    ) -> TenantReport:
        """The report of one tenant's requests (records) in a run that lasted elapsed_s."""
        errors, ok = _outcomes(records)
        return cls(
            name=name, mode=plan.mode, concurrency=_concurrency(plan), rate=plan.rate,
            sent=len(records), ok=len(ok), errors=errors, dropped=dropped,
            throughput_rps=len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
            latency=LatencySummary.of(ok), records=tuple(records),
        )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (every field but the per-request records, plus rate_limited)."""
        data = _fields_but(self, "records", "name")
        data["errors"] = dict(self.errors)
        data["rate_limited"] = self.rate_limited
        data["latency"] = _latency_json(self.latency)
        return data


@dataclass(frozen=True, slots=True)
class MultiTenantReport:
    """The outcome of a multi-tenant run: `overall` over every request (mode, concurrency and
    rate summed over the tenants; the generator's CPU is the whole process's), and each tenant
    apart, in the order of the run's loads."""

    overall: LoadReport
    tenants: tuple[TenantReport, ...]

    def summary(self) -> dict[str, Any]:
        """JSON-ready: {"overall": ..., "tenants": {name: ...}}."""
        return {
            "overall": self.overall.summary(),
            "tenants": {t.name: t.summary() for t in self.tenants},
        }


def _outcomes(records: Sequence[RequestRecord]) -> tuple[dict[str, int], list[float]]:
    """(the count of each error kind, sorted by kind; the latencies of the successes)."""
    errors = Counter(r.error for r in records if r.error is not None)
    return dict(sorted(errors.items())), [r.latency_s for r in records if r.error is None]


def _concurrency(plan: LoadPlan) -> int:
    return plan.concurrency if plan.rate is None else plan.max_in_flight


@dataclass(slots=True)
class _Tally:
    started: float
    tenant: str | None = None
    records: list[RequestRecord] = field(default_factory=list)
    ok: int = 0
    failed: int = 0
    dropped: int = 0
    in_flight: int = 0
    answered: int = 0  # requests that got an HTTP answer, of any status
    gave_up: str | None = None  # the connect failures' kinds, once it gave up


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


async def _one(send: Sender, tally: _Tally, plan: LoadPlan) -> None:
    tally.in_flight += 1
    start = time.perf_counter()
    status = 0
    error: str | None
    try:
        async with asyncio.timeout(plan.timeout_s):
            status = await send()
        error = None if 200 <= status < 300 else str(status)
        tally.answered += 1
    except Exception as exc:  # the generator must outlive any failure of one request
        error = _error_kind(exc)
        unreachable = isinstance(exc, CONNECT_FAILURES)
        if unreachable and not tally.answered and start - tally.started >= plan.connect_give_up_s:
            kinds = {r.error for r in tally.records if r.error is not None} | {error}
            tally.gave_up = ", ".join(sorted(kinds))
    end = time.perf_counter()
    tally.in_flight -= 1
    tally.records.append(
        RequestRecord(start - tally.started, end - start, status, error, tally.tenant)
    )
    if error is None:
        tally.ok += 1
    else:
        tally.failed += 1


async def _closed_loop(send: Sender, plan: LoadPlan, tally: _Tally, stop_at: float) -> None:
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while time.perf_counter() < stop_at and tally.gave_up is None:
            if plan.requests is not None and issued >= plan.requests:
                return
            issued += 1
            await _one(send, tally, plan)

    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))


async def _open_loop(send: Sender, plan: LoadPlan, tally: _Tally, stop_at: float) -> None:
    assert plan.rate is not None
    rng = random.Random(plan.seed)
    tasks: set[asyncio.Task[None]] = set()
    arrivals = 0
    next_at = time.perf_counter()
    while plan.requests is None or arrivals < plan.requests:
        next_at += rng.expovariate(plan.rate)
        if next_at >= stop_at or tally.gave_up is not None:
            break
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        arrivals += 1
        if tally.in_flight >= plan.max_in_flight:
            tally.dropped += 1
            continue
        task = asyncio.create_task(_one(send, tally, plan))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        # _one counts itself in flight only once it runs; yield so the bound above sees it.
        await asyncio.sleep(0)
    if tasks:
        await asyncio.gather(*tasks)


async def _drive(send: Sender, plan: LoadPlan, tally: _Tally) -> None:
    stop_at = tally.started + plan.duration_s if plan.duration_s is not None else math.inf
    if plan.mode == "closed":
        await _closed_loop(send, plan, tally, stop_at)
    else:
        await _open_loop(send, plan, tally, stop_at)


@contextlib.asynccontextmanager
async def _ticking(
    progress: Callable[[Progress], None] | None, tallies: Sequence[_Tally], interval_s: float
) -> AsyncIterator[None]:
    """Reports progress every interval_s while the body runs, and once at its end."""

    async def ticker() -> None:
        assert progress is not None
        while True:
            await asyncio.sleep(interval_s)
            progress(_progress(tallies))

    ticker_task = asyncio.create_task(ticker()) if progress is not None else None
    try:
        yield
    finally:
        if ticker_task is not None:
            ticker_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker_task
    if progress is not None:
        progress(_progress(tallies))


def _load_report(
    *,
    mode: Literal["closed", "open"],
    concurrency: int,
    rate: float | None,
    records: Sequence[RequestRecord],
    dropped: int,
    elapsed_s: float,
    cpu_s: float,
    gave_up: str | None = None,
) -> LoadReport:
    errors, ok_latencies = _outcomes(records)
    return LoadReport(
        mode=mode,
        concurrency=concurrency,
        rate=rate,
        sent=len(records),
        ok=len(ok_latencies),
        errors=errors,
        dropped=dropped,
        elapsed_s=elapsed_s,
        throughput_rps=len(ok_latencies) / elapsed_s if elapsed_s > 0 else 0.0,
        latency=LatencySummary.of(ok_latencies),
        client_cpu_s=cpu_s,
        client_cpu_percent=100.0 * cpu_s / elapsed_s if elapsed_s > 0 else 0.0,
        records=tuple(records),
        gave_up=gave_up,
    )


async def run_load(
    send: Sender,
    plan: LoadPlan,
    *,
    progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 0.25,
) -> LoadReport:
    """Drive `send` according to `plan` and measure every request."""
    cpu0 = time.process_time()
    tally = _Tally(started=time.perf_counter())
    async with _ticking(progress, [tally], progress_interval_s):
        await _drive(send, plan, tally)
    elapsed = time.perf_counter() - tally.started
    return _load_report(
        mode=plan.mode, concurrency=_concurrency(plan), rate=plan.rate, records=tally.records,
        dropped=tally.dropped, elapsed_s=elapsed, cpu_s=time.process_time() - cpu0,
        gave_up=tally.gave_up,
    )  # fmt: skip


async def run_tenants(
    loads: Sequence[TenantLoad],
    *,
    progress: Callable[[Progress], None] | None = None,
    progress_interval_s: float = 0.25,
) -> MultiTenantReport:
    """Drive every tenant's sender by its own plan, all from one start, and measure each
    tenant apart and all of them together. Each plan bounds its own loop (duration_s from the
    common start, and/or its own request count).

    Raises:
        ValueError: no loads, a name empty or repeated, or closed and open plans mixed (the
            overall report has one mode).
    """
    names = [load.name for load in loads]
    if not loads or not all(names) or len(set(names)) != len(names):
        raise ValueError(f"run_tenants needs loads with distinct non-empty names, got {names}")
    modes = {load.plan.mode for load in loads}
    if len(modes) != 1:
        raise ValueError("run_tenants: every plan must be closed loop, or every plan open loop")
    cpu0 = time.process_time()
    started = time.perf_counter()
    tallies = [_Tally(started=started, tenant=load.name) for load in loads]
    async with _ticking(progress, tallies, progress_interval_s):
        drives = [_drive(load.send, load.plan, t) for load, t in zip(loads, tallies, strict=True)]
        await asyncio.gather(*drives)
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu0
    tenants = tuple(
        TenantReport.of(load.name, load.plan, tally.records, dropped=tally.dropped,
                        elapsed_s=elapsed)
        for load, tally in zip(loads, tallies, strict=True)
    )  # fmt: skip
    rates = [load.plan.rate for load in loads if load.plan.rate is not None]
    overall = _load_report(
        mode=modes.pop(),
        concurrency=sum(t.concurrency for t in tenants),
        rate=sum(rates) if rates else None,
        records=sorted((r for t in tallies for r in t.records), key=lambda r: r.start_s),
        dropped=sum(t.dropped for t in tallies),
        elapsed_s=elapsed,
        cpu_s=cpu,
        # Nothing could be reached only when no tenant reached anything.
        gave_up=tallies[0].gave_up if all(t.gave_up for t in tallies) else None,
    )
    return MultiTenantReport(overall=overall, tenants=tenants)


def _progress(tallies: Sequence[_Tally]) -> Progress:
    return Progress(
        elapsed_s=time.perf_counter() - tallies[0].started,
        done=sum(len(t.records) for t in tallies),
        ok=sum(t.ok for t in tallies),
        failed=sum(t.failed for t in tallies),
        in_flight=sum(t.in_flight for t in tallies),
    )
