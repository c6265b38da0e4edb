"""Tracing (issue 27): what OpenTelemetry traces cost small-payload throughput. A benchmark, never
a test.

    .venv/bin/python bench/tracing.py                                  # ~5 minutes on 2 cores
    mkdir /tmp/before-tracing && git archive 690d9ca | tar -x -C /tmp/before-tracing  # 690d9ca:
    .venv/bin/python bench/tracing.py --before /tmp/before-tracing     # before tracing; ~7 minutes

Servers (`python -m service.cli serve`, CPU, every SDPA_* setting its default but
SDPA_COMPILE_KERNELS=false, the gRPC door off), all up at once and idle but for the one measured:
- off: OTEL_TRACES_EXPORTER unset (the default): no tracer, no middleware;
- on: OTEL_TRACES_EXPORTER=otlp, OTEL_EXPORTER_OTLP_ENDPOINT at a receiver in this process
  (POST /v1/traces, each body parsed as an ExportTraceServiceRequest to count its spans and
  answered 200, as a collector would), every other OTEL_* variable its default (batches of 512
  spans, or every 5 s): each request exports six spans, its server span and its five phases;
- old (with --before): the tree given, e.g. the commit before tracing (690d9ca), served with this
  .venv, its own cwd and PYTHONPATH: "off" against it shows what the code that is off costs.
The load is bench/ab_throughput's: `sdpa-loadtest --preset small --concurrency 16` (a closed loop
of 16, [1, 4, 64, 64] float32 base64, output only), 2 s of warm-up, then --seconds measured. The
sides alternate round by round (off, on, old; then on, old, off; ...) so that load drifting on
the shared machine falls on each alike. Besides throughput, each run records the server's CPU
time per request answered (/proc/<pid>/stat, over the requests /metrics counted meanwhile): the
cost itself, less sensitive than throughput to what else the machine runs.

On this shared 2-core machine the throughput of rounds a minute apart can differ by 2-5x (what
else runs), far more than the 5% to be resolved. So the benchmark also measures tracing's own
CPU per request, in this process, where nothing else's time counts: the tracing middleware
around an ASGI app that does what a compute route leaves behind (the request id, tenant, batch
size and the real Phases record in the request's state, then a 200), against the same app
alone, over --inprocess-requests requests, the best of 7 alternated repeats (process CPU time:
the batch processor's thread encoding the spans with the otlp exporter's encoder included; the
HTTP POST of each 512 spans left out). Its share of the off server's CPU per request bounds
what tracing can take from throughput when the server's CPU is the limit. And last, off and on
are loaded at the same time (--together-rounds pairs, each sdpa-loadtest c=16 as above): the
machine's other load then falls on both within the same seconds, and on/off of a pair is what
tracing costs when the two compete for the same cores. Finally each server, in turn, under an
open loop of --rate small requests per second (100: far below what the machine serves), for
--seconds, --rate-rounds times: the server's CPU per request without the contention of a
saturating load, on against off.

Targets (issue 27): tracing on costs <= 5% of small-payload throughput (on/off of the medians
>= 0.95); off costs nothing measurable (off/old within the spread of the rounds).

Writes bench/results/tracing.json and tracing.md (and prints the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.ab_throughput import load  # noqa: E402
from bench.support import BenchServer, live_server  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
LOADTEST = str(Path(sys.executable).with_name("sdpa-loadtest"))
ROUTE = 'route="/v1/attention"'
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TARGET_ON_OVER_OFF = 0.95
EXPORT_DELAY_S = 5.0  # OTEL_BSP_SCHEDULE_DELAY's default
# The statistics kernel is for diagnostics, which the small payload does not ask for; compiling
# it at warm-up took the servers past their 90 s of readiness on a busy machine.
SERVER_ENV = {"SDPA_COMPILE_KERNELS": "false"}


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: counts export requests, bytes and spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.exports = self.bytes = self.spans = 0
        self.lock = threading.Lock()
        receiver = self
        answer = ExportTraceServiceResponse().SerializeToString()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                request = ExportTraceServiceRequest.FromString(body)
                spans = sum(
                    len(scope.spans)
                    for resource in request.resource_spans
                    for scope in resource.scope_spans
                )
                with receiver.lock:
                    receiver.exports += 1
                    receiver.bytes += len(body)
                    receiver.spans += spans
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"exports": self.exports, "bytes": self.bytes, "spans": self.spans}

    @contextmanager
    def running(self) -> Iterator[Receiver]:
        self.thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()


def cpu_s(server: BenchServer) -> float:
    """The server process's user + system CPU time so far, in seconds."""
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)


def answered(server: BenchServer) -> float:
    """POST /v1/attention requests the server has answered so far (any status)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("sdpa_requests_total{") and ROUTE in line
    )


def tracing_cpu_us(*, requests: int, repeats: int = 7) -> dict[str, float]:
    """Tracing's own CPU per request in this process (see the module): the best of `repeats`
    alternated runs of `requests` requests through the edge, with and without tracing."""
    import asyncio
    import types

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from service.middleware.access_log import AccessLogMiddleware
    from service.serving.exchange import exchange_of
    from service.serving.pipeline import Phases
    from service.tracing import Tracing, encode_otlp

    class Encoding(SpanExporter):
        """What the otlp exporter does with a batch, but its HTTP POST."""

        def export(self, spans: Any) -> SpanExportResult:
            encode_otlp(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    async def route(scope: Any, receive: Any, send: Any) -> None:
        now = time.monotonic()
        exchange_of(scope).phases = Phases(
            started=now - 0.004, received=now - 0.0035, decoded=now - 0.003,
            computed=now - 0.001, encoded=now, queue_ms=0.5, compute_ms=1.2, batch_size=3,
            path="fused", backend="math",
        )  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    tracing = Tracing(exporters=[Encoding()])
    traced = AccessLogMiddleware(route, tracing=tracing)
    untraced = AccessLogMiddleware(route)
    scope = {
        "type": "http", "method": "POST", "path": "/v1/attention", "scheme": "http",
        "http_version": "1.1", "client": ("127.0.0.1", 40000),
        "route": types.SimpleNamespace(path="/v1/attention"),
        "headers": [
            (b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
            (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ],
    }  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        pass

    async def run(app: Any) -> float:
        started = time.process_time()
        for done in range(1, requests + 1):
            await app({**scope}, receive, send)
            # The encoding of what was queued, counted too; often enough that the processor's
            # queue (2048 spans), which this loop would outrun, drops none.
            if done % 256 == 0 or done == requests:
                tracing.force_flush(timeout_s=60.0)
        return (time.process_time() - started) / requests * 1e6

    best = {"without": float("inf"), "with": float("inf")}
    try:
        for repeat in range(repeats):
            order = ("without", "with") if repeat % 2 == 0 else ("with", "without")
            for side in order:
                app = untraced if side == "without" else traced
                best[side] = min(best[side], asyncio.run(run(app)))
    finally:
        tracing.shutdown(timeout_s=10.0)
    return {**best, "tracing": best["with"] - best["without"]}


def measure(
    servers: dict[str, BenchServer], receiver: Receiver, *, seconds: float, rounds: int, tmp: Path
) -> dict[str, list[dict[str, float]]]:
    sides = list(servers)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for round_ in range(rounds):
        shift = round_ % len(sides)
        for side in sides[shift:] + sides[:shift]:
            server = servers[side]
            load_before = round(os.getloadavg()[0], 2)
            cpu0, done0, spans0 = cpu_s(server), answered(server), receiver.counts()["spans"]
            result = load(
                server.url, seconds=seconds, concurrency=16, protocol="v1",
                out=tmp / f"{side}-{round_}.json",
            )  # fmt: skip
            cpu1, done1 = cpu_s(server), answered(server)
            requests = max(done1 - done0, 1.0)
            run = {
                **result,
                "server_cpu_us_per_request": (cpu1 - cpu0) / requests * 1e6,
                "requests": requests,
                # Spans arrive in batches (512, or every 5 s): a run's count is approximate.
                "spans_received": float(receiver.counts()["spans"] - spans0),
                "load_before": load_before,
            }
            runs[side].append(run)
            print(
                f"round {round_} {side:>3}: {run['throughput']:6.0f} req/s, p50 "
                f"{run['p50_ms']:5.1f} ms, p99 {run['p99_ms']:6.1f} ms, server CPU "
                f"{run['server_cpu_us_per_request']:5.0f} µs/request, errors "
                f"{run['errors']:.0f}, load before {load_before}",
                flush=True,
            )
    return runs


def at_rate(
    servers: dict[str, BenchServer], *, rate: float, seconds: float, rounds: int, tmp: Path
) -> dict[str, list[float]]:
    """Each server in turn under an open loop of `rate` small requests per second, well below
    what the machine can serve: its CPU per request, without the contention of a saturating
    load (which inflates every figure of the closed loop)."""
    cpu_us: dict[str, list[float]] = {side: [] for side in servers}
    sides = list(servers)
    for round_ in range(rounds):
        shift = round_ % len(sides)
        for side in sides[shift:] + sides[:shift]:
            server = servers[side]
            out = tmp / f"rate-{side}-{round_}.json"
            command = [
                LOADTEST, "--url", server.url, "--preset", "small", "--rate", f"{rate:g}",
                "--duration", f"{seconds:g}", "--warmup", "1s", "--no-progress", "--json",
                str(out),
            ]  # fmt: skip
            cpu0, done0 = cpu_s(server), answered(server)
            subprocess.run(command, capture_output=True, check=True, timeout=seconds + 120)
            cpu1, done1 = cpu_s(server), answered(server)
            cpu_us[side].append((cpu1 - cpu0) / max(done1 - done0, 1.0) * 1e6)
            print(
                f"rate {rate:g}/s round {round_} {side:>3}: server CPU "
                f"{cpu_us[side][-1]:.0f} µs/request",
                flush=True,
            )
    return cpu_us


def side_by_side(
    off: BenchServer, on: BenchServer, *, seconds: float, rounds: int, tmp: Path
) -> list[dict[str, float]]:
    """Both loads at once, `rounds` times: whatever else the machine runs meanwhile falls on
    both alike, within the same seconds, and on/off of each pair is their share of it."""
    from concurrent.futures import ThreadPoolExecutor

    pairs: list[dict[str, float]] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for round_ in range(rounds):
            load_before = round(os.getloadavg()[0], 2)
            futures = {
                side: pool.submit(
                    load,
                    server.url,
                    seconds=seconds,
                    concurrency=16,
                    protocol="v1",
                    out=tmp / f"together-{side}-{round_}.json",
                )
                for side, server in (("off", off), ("on", on))
            }
            rps = {side: future.result()["throughput"] for side, future in futures.items()}
            pair = {**rps, "on_over_off": rps["on"] / rps["off"], "load_before": load_before}
            pairs.append(pair)
            print(
                f"together {round_}: off {rps['off']:.0f}, on {rps['on']:.0f} req/s, on/off "
                f"{pair['on_over_off']:.3f}, load before {load_before}",
                flush=True,
            )
    return pairs


def summary(
    runs: dict[str, list[dict[str, float]]],
    spans_per_request: float,
    in_process: dict[str, float],
    together: list[dict[str, float]],
    rated: dict[str, list[float]],
) -> dict[str, Any]:
    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    out: dict[str, Any] = {
        "median_rps": {side: median(side, "throughput") for side in runs},
        "median_cpu_us": {side: median(side, "server_cpu_us_per_request") for side in runs},
        "range_rps": {
            side: [min(r["throughput"] for r in rs), max(r["throughput"] for r in rs)]
            for side, rs in runs.items()
        },
    }
    rps, cpu = out["median_rps"], out["median_cpu_us"]
    out["on_over_off"] = rps["on"] / rps["off"]
    out["on_cpu_extra_us"] = cpu["on"] - cpu["off"]
    # Round by round: the two runs of a round are seconds apart, the rounds minutes.
    pairs = zip(runs["on"], runs["off"], strict=True)
    paired = [on["throughput"] / off["throughput"] for on, off in pairs]
    out["on_over_off_by_round"] = paired
    out["on_over_off_paired_median"] = statistics.median(paired)
    if rated and all(rated.values()):
        at_rate = {side: statistics.median(values) for side, values in rated.items()}
        out["at_rate_cpu_us"] = at_rate
        out["at_rate_tracing_us"] = at_rate["on"] - at_rate["off"]
        out["at_rate_tracing_share"] = out["at_rate_tracing_us"] / at_rate["off"]
    if together:
        out["on_over_off_together_median"] = statistics.median(
            pair["on_over_off"] for pair in together
        )
    out["target_met"] = out["on_over_off"] >= TARGET_ON_OVER_OFF
    out["tracing_cpu_us_in_process"] = in_process["tracing"]
    out["tracing_share_of_off_cpu"] = in_process["tracing"] / cpu["off"]
    # Every span received, against every request the on server answered.
    out["spans_per_traced_request"] = spans_per_request
    if "old" in runs:
        out["off_over_old"] = rps["off"] / rps["old"]
        out["off_cpu_extra_us"] = cpu["off"] - cpu["old"]
    return out


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        "# Tracing: small-payload throughput with OpenTelemetry off and on (bench/tracing.py)",
        "",
        f"{report['date']}, {report['machine']}; `{report['command']}`. sdpa-loadtest --preset "
        f"small --concurrency 16, {report['seconds']:g} s per run after 2 s of warm-up; sides "
        "alternated round by round. on: OTLP/HTTP to a receiver in the benchmark's process.",
        "",
        "| round | side | req/s | p50 ms | p99 ms | server CPU µs/request | spans received | "
        "errors | load before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    runs = report["runs"]
    for round_ in range(report["rounds"]):
        for side in runs:
            r = runs[side][round_]
            lines.append(
                f"| {round_} | {side} | {r['throughput']:.0f} | {r['p50_ms']:.1f} | "
                f"{r['p99_ms']:.1f} | {r['server_cpu_us_per_request']:.0f} | "
                f"{r['spans_received']:.0f} | {r['errors']:.0f} | {r['load_before']} |"
            )
    rps, cpu = s["median_rps"], s["median_cpu_us"]
    lines += [
        "",
        "Medians: "
        + ", ".join(f"{side} {rps[side]:.0f} req/s ({cpu[side]:.0f} µs)" for side in rps)
        + " (server CPU per request in brackets).",
        f"- on/off: {s['on_over_off']:.3f} (target >= {TARGET_ON_OVER_OFF}: "
        f"{'met' if s['target_met'] else 'NOT met'}); tracing adds {s['on_cpu_extra_us']:.0f} "
        f"µs of server CPU per request; {s['spans_per_traced_request']:.2f} spans exported per "
        "traced request (6 expected: the server span and five phases).",
        "- on/off round by round: "
        + ", ".join(f"{r:.2f}" for r in s["on_over_off_by_round"])
        + f" (median {s['on_over_off_paired_median']:.3f}).",
    ]
    if "at_rate_cpu_us" in s:
        at_rate = s["at_rate_cpu_us"]
        lines.append(
            f"- open loop at {report['rate']:g} req/s, server CPU per request (median): "
            + ", ".join(f"{side} {us:.0f} µs" for side, us in at_rate.items())
            + f"; tracing {s['at_rate_tracing_us']:.0f} µs, "
            f"{100 * s['at_rate_tracing_share']:.1f}% of off's (runs: "
            + "; ".join(
                f"{side} " + ", ".join(f"{us:.0f}" for us in values)
                for side, values in report["at_rate_cpu_us"].items()
            )
            + ")."
        )
    if report["together"]:
        lines.append(
            "- off and on loaded at the same time (each c=16), on/off: "
            + ", ".join(f"{pair['on_over_off']:.2f}" for pair in report["together"])
            + f" (median {s['on_over_off_together_median']:.3f}; req/s off "
            + ", ".join(f"{pair['off']:.0f}" for pair in report["together"])
            + ", on "
            + ", ".join(f"{pair['on']:.0f}" for pair in report["together"])
            + ")."
        )
    lines.append(
        f"- tracing's own CPU per request, in process: {s['tracing_cpu_us_in_process']:.0f} µs "
        f"({report['in_process_us']['without']:.0f} µs for the bare app, "
        f"{report['in_process_us']['with']:.0f} with the middleware, best of 7), "
        f"{100 * s['tracing_share_of_off_cpu']:.1f}% of the off server's CPU per request."
    )
    if "off_over_old" in s:
        lines.append(
            f"- off/old: {s['off_over_old']:.3f}; server CPU off - old: "
            f"{s['off_cpu_extra_us']:.0f} µs per request (old: {report['before']})."
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--before", type=Path, help="an older tree to serve as 'old'")
    parser.add_argument("--seconds", type=float, default=10.0, help="each measured run")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each side")
    parser.add_argument("--inprocess-requests", type=int, default=3000)
    parser.add_argument(
        "--together-rounds", type=int, default=4, help="runs of off and on at the same time"
    )
    parser.add_argument("--rate", type=float, default=100.0, help="the open loop's req/s")
    parser.add_argument("--rate-rounds", type=int, default=3, help="open-loop runs of each side")
    args = parser.parse_args()
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        del os.environ[name]  # the servers get only what is set below
    in_process = tracing_cpu_us(requests=args.inprocess_requests)
    print(
        f"in process: {in_process['without']:.1f} µs per request without tracing, "
        f"{in_process['with']:.1f} with: tracing {in_process['tracing']:.1f} µs",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp, Receiver().running() as receiver, ExitStack() as up:
        on_env = {
            **SERVER_ENV,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        }
        servers = {
            "off": up.enter_context(live_server(SERVER_ENV, tmp_path=Path(tmp))),
            "on": up.enter_context(live_server(on_env, tmp_path=Path(tmp))),
        }
        if args.before is not None:
            servers["old"] = up.enter_context(
                live_server(SERVER_ENV, tmp_path=Path(tmp), tree=args.before.resolve())
            )
        runs = measure(servers, receiver, seconds=args.seconds, rounds=args.rounds, tmp=Path(tmp))
        rated = at_rate(
            servers, rate=args.rate, seconds=args.seconds, rounds=args.rate_rounds, tmp=Path(tmp)
        )
        together = side_by_side(
            servers["off"], servers["on"], seconds=args.seconds, rounds=args.together_rounds,
            tmp=Path(tmp),
        )  # fmt: skip
        # The last spans leave on the batch processor's schedule (every 5 s by default).
        time.sleep(EXPORT_DELAY_S + 1.0)
        received = receiver.counts()
        traced_requests = answered(servers["on"])  # since it started, warm-ups included
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}",
        "command": " ".join(["bench/tracing.py", *sys.argv[1:]]),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "before": None if args.before is None else str(args.before),
        "receiver": received,
        "runs": runs,
        "in_process_us": in_process,
        "together": together,
        "rate": args.rate,
        "at_rate_cpu_us": rated,
        "traced_requests": traced_requests,
        "summary": summary(runs, received["spans"] / traced_requests, in_process, together, rated),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tracing.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (RESULTS / "tracing.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
