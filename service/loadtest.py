"""sdpa-loadtest: an async HTTP load generator for sdpa-service (and anything that takes a POST).

    sdpa-loadtest --preset small --concurrency 8 --duration 10
    sdpa-loadtest --preset large --rate 20 --duration 30 --json report.json --csv requests.csv
    sdpa-loadtest --request-file body.json --path /v1/analyze --requests 500

Closed loop (`--concurrency N`): N workers, each sends its next request when the previous one
answered; the server sets the pace. Open loop (`--rate R`): requests arrive as a Poisson process
of R per second whatever the server does, with at most `--max-in-flight` outstanding; an arrival
that finds that bound full is counted as dropped (never sent). A run always stops: after
`--duration` seconds and/or `--requests` arrivals (10 s when neither is given); requests in
flight then finish, each bounded by `--timeout`.

The request body is encoded once before the run, so the generator's cost per request is the HTTP
exchange only. The report gives the generator's own CPU use (process CPU time / wall time): near
100% of one core, the generator, not the server, is the limit.

The core (`run_load`, `LoadPlan`, `LoadReport`, `HttpSender`, `Payload`, `PRESETS`) is shared by
bench/compare.py, so every system there is measured with the same generator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import importlib
import json
import math
import random
import ssl
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import httpx
import numpy as np
import numpy.typing as npt

from service.client import CLIENT_VERSION, Encoding, build_attention_body, encode_body

DEFAULT_DURATION_S = 10.0
# Above this share of one core, the report warns that the generator may be the bottleneck.
GENERATOR_BUSY_PERCENT = 85.0

# --------------------------------------------------------------------------------------------
# Payloads
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Preset:
    """A standard attention request: q, k, v of shape [batch, heads, n, d] (float32)."""

    name: str
    batch: int
    heads: int
    n: int
    d: int
    return_weights: bool
    diagnostics: Literal["none", "summary", "full"]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.n, self.d)

    def arrays(
        self, *, seed: int = 0
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """q, k, v drawn from N(0, 1), seeded: the same bytes for every system and run."""
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal(self.shape, dtype=np.float32) for _ in range(3))
        return q, k, v  # [B, H, N, D] each

    def request(self, *, encoding: Encoding, seed: int = 0) -> dict[str, Any]:
        q, k, v = self.arrays(seed=seed)
        return build_attention_body(
            q, k, v, return_weights=self.return_weights, diagnostics=self.diagnostics,
            encoding=encoding,
        )  # fmt: skip

    def describe(self) -> str:
        parts = [f"B={self.batch} H={self.heads} N={self.n} D={self.d}"]
        parts.append("weights" if self.return_weights else "no weights")
        parts.append(f"diagnostics={self.diagnostics}")
        return ", ".join(parts)


# The three payloads of bench/service.py (the service issue's definitions): only medium asks for
# weights and diagnostics; small and large take the fused kernel's path, output only.
PRESETS: dict[str, Preset] = {
    "small": Preset("small", 1, 4, 64, 64, return_weights=False, diagnostics="none"),
    "medium": Preset("medium", 1, 8, 256, 64, return_weights=True, diagnostics="summary"),
    "large": Preset("large", 1, 8, 1024, 64, return_weights=False, diagnostics="none"),
}


@dataclass(frozen=True, slots=True)
class Payload:
    """One pre-encoded request: sent as-is, as many times as the run needs."""

    name: str
    path: str
    body: bytes
    description: str = ""

    @classmethod
    def from_preset(
        cls, preset: Preset, *, encoding: Encoding = "base64", seed: int = 0,
        path: str = "/v1/attention",
    ) -> Payload:  # fmt: skip
        body = encode_body(preset.request(encoding=encoding, seed=seed))
        return cls(preset.name, path, body, f"{preset.describe()}, {encoding}")

    @classmethod
    def from_file(cls, file: Path, *, path: str = "/v1/attention") -> Payload:
        body = file.read_bytes()
        try:
            json.loads(body)
        except ValueError as exc:
            raise ValueError(f"{file}: not JSON ({exc})") from exc
        return cls(file.name, path, body, f"request file {file}")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

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


class HttpSender:
    """POSTs one payload; the response body is read in full, then discarded.

    One single-connection httpx.AsyncClient per concurrent request (created on first need, then
    reused with keep-alive), rather than one client with a pool of N: httpcore 1.0's pool does
    work linear in its connections and queued requests on every request (encode/httpx#3215,
    encode/httpcore#1035; measured here with httpcore 1.0.9 against a no-op endpoint: 1.4 ms of
    client CPU per request with one pool of 16 connections, 0.7 ms with 16 pools of one), which
    made the generator, not the server, the limit. A pool of one connection stays on the fast
    path.
    """

    def __init__(
        self, base_url: str, payload: Payload, *, api_key: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:  # fmt: skip
        self._base_url = base_url.rstrip("/")
        self._path = payload.path
        self._body = payload.body
        self._timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        self._headers = {
            "content-type": "application/json",
            "user-agent": f"sdpa-loadtest/{CLIENT_VERSION}",
        }
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []
        # httpx builds an SSL context per client unless given one (tens of ms of CPU each,
        # even for http:// URLs): share one.
        self._ssl = ssl.create_default_context()

    def _client(self) -> httpx.AsyncClient:
        if self._idle:
            return self._idle.pop()
        client = httpx.AsyncClient(
            base_url=self._base_url,
            timeout=self._timeout,
            headers=self._headers,
            verify=self._ssl,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )
        self._all.append(client)
        return client

    async def __call__(self) -> int:
        client = self._client()
        try:
            response = await client.post(self._path, content=self._body)
            return response.status_code
        finally:
            self._idle.append(client)

    @property
    def connections(self) -> int:
        return len(self._all)

    async def aclose(self) -> None:
        clients, self._all, self._idle = self._all, [], []
        for client in clients:
            await client.aclose()

    async def __aenter__(self) -> HttpSender:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def write_csv(records: Sequence[RequestRecord], out: TextIO) -> None:
    writer = csv.writer(out)
    writer.writerow(["index", "start_s", "latency_ms", "status", "error"])
    for i, r in enumerate(records):
        writer.writerow(
            [i, f"{r.start_s:.6f}", f"{r.latency_s * 1000:.3f}", r.status, r.error or ""]
        )


def _require_matplotlib() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as exc:
        raise SystemExit(
            "sdpa-loadtest: --histogram needs matplotlib: pip install 'sdpa-service[plot]'"
        ) from exc
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def write_histogram(report: LoadReport, path: Path, *, title: str) -> None:
    plt = _require_matplotlib()
    latencies = [r.latency_s * 1000 for r in report.records if r.error is None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if latencies:
        ax.hist(latencies, bins=min(100, max(10, len(latencies) // 20)), color="#4477aa")
        lat = report.latency
        for label, value, style in (("p50", lat.p50_ms, "-"), ("p90", lat.p90_ms, "--"),
                                    ("p99", lat.p99_ms, ":")):  # fmt: skip
            ax.axvline(value, color="#cc3311", linestyle=style, label=f"{label} {value:.2f} ms")
        ax.legend()
    ax.set_xlabel("latency (ms), successful requests")
    ax.set_ylabel("requests")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(report: LoadReport, *, target: str) -> str:
    lat = report.latency
    errors = ", ".join(f"{k}: {v}" for k, v in report.errors.items()) or "none"
    lines = [
        f"target      {target}",
        f"mode        {report.mode} loop, "
        + (
            f"concurrency {report.concurrency}"
            if report.mode == "closed"
            else f"rate {report.rate:g}/s, max in flight {report.concurrency}"
        ),
        f"sent        {report.sent}   ok {report.ok}   errors {report.sent - report.ok} "
        f"({errors})" + (f"   dropped {report.dropped}" if report.mode == "open" else ""),
        f"throughput  {report.throughput_rps:.1f} ok/s over {report.elapsed_s:.2f} s",
        f"latency ms  p50 {lat.p50_ms:.2f}   p90 {lat.p90_ms:.2f}   p99 {lat.p99_ms:.2f}   "
        f"max {lat.max_ms:.2f}   (mean {lat.mean_ms:.2f}, {lat.count} ok requests)",
        f"client CPU  {report.client_cpu_s:.2f} s = {report.client_cpu_percent:.0f}% of one core",
    ]
    if report.generator_busy:
        lines.append(
            "            the generator is near one full core: it may be the limit, not the server"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _warmup_arg(text: str) -> tuple[int, float]:
    """'20' = 20 requests; '2s' = 2 seconds. Returns (requests, seconds)."""
    text = text.strip().lower()
    try:
        if text.endswith("s"):
            seconds = float(text[:-1])
            if seconds < 0 or not math.isfinite(seconds):
                raise ValueError
            return 0, seconds
        count = int(text)
        if count < 0:
            raise ValueError
        return count, 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--warmup takes a request count (20) or seconds (2s), got {text!r}"
        ) from None


def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdpa-loadtest",
        description="Load-test an sdpa-service (closed loop with --concurrency, open loop with "
        "--rate). A run ends after --duration and/or --requests (10 s when neither is given).",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--path", default="/v1/attention", help="endpoint (default %(default)s)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="small",
        help="; ".join(f"{p.name}: {p.describe()}" for p in PRESETS.values()),
    )
    what.add_argument("--request-file", type=Path, help="a JSON request body to send as-is")
    parser.add_argument(
        "--encoding",
        choices=["base64", "json"],
        default="base64",
        help="tensor encoding of a preset (default %(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=_positive(int),
        default=8,
        help="closed loop: requests kept in flight (default %(default)s)",
    )
    parser.add_argument(
        "--rate",
        type=_positive(float),
        help="open loop: Poisson arrivals per second (instead of --concurrency)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=_positive(int),
        default=256,
        help="open loop: bound on outstanding requests (default %(default)s)",
    )
    parser.add_argument("--duration", type=_positive(float), help="seconds to send for")
    parser.add_argument("--requests", type=_positive(int), help="requests to send")
    parser.add_argument(
        "--warmup",
        type=_warmup_arg,
        default=(0, 0.0),
        help="unmeasured warm-up first: a count (20) or seconds (2s)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive(float),
        default=60.0,
        help="seconds one request may take (default %(default)s)",
    )
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer <key>'")
    parser.add_argument("--seed", type=int, default=0, help="seed of the preset data and arrivals")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    parser.add_argument("--json", dest="json_path", help="write the report as JSON (- = stdout)")
    parser.add_argument("--csv", dest="csv_path", type=Path, help="write per-request records")
    parser.add_argument("--histogram", type=Path, help="write a latency histogram PNG")
    return parser


@contextlib.contextmanager
def _progress_display(enabled: bool, plan: LoadPlan) -> Iterator[Callable[[Progress], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as RichProgress

    by_count = plan.duration_s is None
    total = float(plan.requests) if by_count and plan.requests else plan.duration_s
    bar = RichProgress(
        TextColumn("[bold]load"), BarColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"), transient=True, console=None,
    )  # fmt: skip
    with bar:
        task = bar.add_task("load", total=total, stats="")

        def update(p: Progress) -> None:
            rps = p.ok / p.elapsed_s if p.elapsed_s > 0 else 0.0
            stats = (
                f"sent {p.done}  ok {p.ok}  err {p.failed}  in flight {p.in_flight}  {rps:.0f}/s"
            )
            done = float(p.done) if by_count else min(p.elapsed_s, total or 0.0)
            bar.update(task, completed=done, stats=stats)

        yield update


async def _run_cli(args: argparse.Namespace, payload: Payload, plan: LoadPlan) -> LoadReport:
    async with HttpSender(args.url, payload, api_key=args.api_key, timeout_s=args.timeout) as send:
        warm_requests, warm_seconds = args.warmup
        if warm_requests or warm_seconds:
            warm = LoadPlan(
                concurrency=plan.concurrency if plan.rate is None else min(plan.max_in_flight, 8),
                requests=warm_requests or None, duration_s=warm_seconds or None,
                timeout_s=plan.timeout_s,
            )  # fmt: skip
            await run_load(send, warm)
        show = not args.no_progress and sys.stderr.isatty()
        with _progress_display(show, plan) as progress:
            return await run_load(send, plan, progress=progress)


def _event_loop_runner() -> asyncio.Runner:
    # uvloop (installed with uvicorn[standard]) roughly halves the generator's CPU per request.
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.histogram is not None:
        _require_matplotlib()  # fail before the run, not after it
    duration = args.duration
    if duration is None and args.requests is None:
        duration = DEFAULT_DURATION_S
    plan = LoadPlan(
        concurrency=args.concurrency, rate=args.rate, max_in_flight=args.max_in_flight,
        duration_s=duration, requests=args.requests, timeout_s=args.timeout, seed=args.seed,
    )  # fmt: skip
    try:
        if args.request_file is not None:
            payload = Payload.from_file(args.request_file, path=args.path)
        else:
            payload = Payload.from_preset(
                PRESETS[args.preset], encoding=args.encoding, seed=args.seed, path=args.path
            )
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    with _event_loop_runner() as runner:
        report = runner.run(_run_cli(args, payload, plan))

    target = f"{args.url.rstrip('/')}{payload.path}  {payload.name}: {payload.description}"
    text_out = sys.stderr if args.json_path == "-" else sys.stdout
    print(format_report(report, target=target), file=text_out)
    if args.json_path is not None:
        document = {
            "target": {"url": args.url, "path": payload.path, "payload": payload.name,
                       "description": payload.description, "body_bytes": len(payload.body)},
            "plan": asdict(plan),
            "report": report.summary(),
        }  # fmt: skip
        text = json.dumps(document, indent=2, allow_nan=False)
        if args.json_path == "-":
            print(text)
        else:
            Path(args.json_path).write_text(text + "\n", encoding="utf-8")
    if args.csv_path is not None:
        with args.csv_path.open("w", newline="", encoding="utf-8") as out:
            write_csv(report.records, out)
    if args.histogram is not None:
        write_histogram(report, args.histogram, title=f"{payload.name}: {report.mode} loop")
    return 1 if report.sent > 0 and report.ok == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
