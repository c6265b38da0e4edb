"""A soak: minutes of mixed traffic against one real server, its memory and descriptors sampled.

Traffic, all at once on one server (each stream a closed loop of its own):
- small v1 (base64) at concurrency 4, small v2 binary at 2, large v1 at 1, medium v2 JSON
  (weights and summary diagnostics) at 1;
- a long request (q = k = v [1, 8, 8192, 16], summary diagnostics: the chunked path, run in
  slices) and an analysis of synthetic 8192 x 8192 scores, one at a time each;
- abandoned requests: a large v1 request whose client gives up after 50 ms (the server sees the
  disconnect while the job waits or runs and drops it), and a body cut off half way.

Every SAMPLE_S seconds the server's RSS (VmRSS) and open descriptors (/proc/PID/fd) are
sampled; after the warm-up, a least-squares line through the samples gives the slope per
minute (a leak is a slope well above the noise). At the end /metrics gives the broken
admissions (504 after admission: sdpa_broken_admissions_total) and the long requests refused
at admission for their deadline. Results: bench/results/soak.{md,json}.

    .venv/bin/python bench/soak.py                   # 10 minutes (the issue's soak)
    .venv/bin/python bench/soak.py --seconds 120     # a quick look

Never run as a test: minutes long, and its figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.support import LONG_ANALYZE, live_server, long_attention_body  # noqa: E402
from sdpa_client.loadgen import PRESETS, Payload  # noqa: E402

SAMPLE_S = 10.0
WARM_UP_S = 120.0  # samples before this are shown but not fitted: allocators and caches fill


@dataclass
class Tally:
    """What each stream got back: status counts, transport errors."""

    statuses: Counter[str] = field(default_factory=Counter)

    def add(self, stream: str, outcome: str) -> None:
        self.statuses[f"{stream} {outcome}"] += 1


def _sample(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open descriptors) of process `pid`."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_minute(times_s: list[float], values: list[float]) -> float:
    """The least-squares slope of values over times, per minute (0 with fewer than 2 points)."""
    n = len(times_s)
    if n < 2:
        return 0.0
    mean_t, mean_v = sum(times_s) / n, sum(values) / n
    var_t = sum((t - mean_t) ** 2 for t in times_s)
    if var_t == 0:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in zip(times_s, values, strict=True))
    return cov / var_t * 60.0


async def _loop(
    until: float, send: Callable[[], Awaitable[str]], stream: str, tally: Tally
) -> None:
    while time.monotonic() < until:
        try:
            outcome = await send()
        except httpx.TransportError as exc:
            outcome = type(exc).__name__
        tally.add(stream, outcome)


def _poster(
    client: httpx.AsyncClient, payload: Payload, *, read_timeout: float | None = None
) -> Callable[[], Awaitable[str]]:
    headers = {"content-type": "application/json", **dict(payload.headers)}
    timeout = (
        httpx.Timeout(60.0) if read_timeout is None else httpx.Timeout(60.0, read=read_timeout)
    )

    async def send() -> str:
        try:
            response = await client.post(
                payload.path, content=payload.body, headers=headers, timeout=timeout
            )
        except httpx.ReadTimeout:
            return "abandoned" if read_timeout is not None else "ReadTimeout"
        return str(response.status_code)

    return send


def _json_poster(
    client: httpx.AsyncClient, path: str, body: bytes, refusals: Counter[str]
) -> Callable[[], Awaitable[str]]:
    async def send() -> str:
        response = await client.post(
            path, content=body, headers={"content-type": "application/json"}, timeout=120
        )
        if response.status_code >= 400:
            refusals[f"{path} {response.status_code}: {response.text[:300]}"] += 1
        return str(response.status_code)

    return send


def _cut_off(url: str, body: bytes) -> Callable[[], Awaitable[str]]:
    """A body that stops half way, its connection closed: the server reads, then sees it go."""
    host, port = url.removeprefix("http://").split(":")

    async def send() -> str:
        _, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /v1/attention HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        writer.write(head + body[: len(body) // 2])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.2)
        return "cut"

    return send


async def _soak(url: str, pid: int, seconds: float) -> dict[str, object]:
    small_v1 = Payload.from_preset(PRESETS["small"])
    small_v2 = Payload.from_preset(PRESETS["small"], protocol="v2")
    medium_v2 = Payload.from_preset(PRESETS["medium"], protocol="v2", encoding="json")
    large_v1 = Payload.from_preset(PRESETS["large"])
    long_body = long_attention_body()
    analyze_body = json.dumps(LONG_ANALYZE).encode()
    tally = Tally()
    refusals: Counter[str] = Counter()
    samples: list[tuple[float, float, int]] = []
    started = time.monotonic()
    until = started + seconds
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        streams: list[tuple[str, Callable[[], Awaitable[str]], int]] = [
            ("small v1", _poster(client, small_v1), 4),
            ("small v2", _poster(client, small_v2), 2),
            ("medium v2 json", _poster(client, medium_v2), 1),
            ("large v1", _poster(client, large_v1), 1),
            ("long", _json_poster(client, "/v1/attention", long_body, refusals), 1),
            ("analyze", _json_poster(client, "/v1/analyze", analyze_body, refusals), 1),
            # Sent whole, then given up on 50 ms into the wait for its answer.
            ("abandoned", _poster(client, large_v1, read_timeout=0.05), 1),
            ("cut off", _cut_off(url, large_v1.body), 1),
        ]
        tasks = [
            asyncio.create_task(_loop(until, send, name, tally))
            for name, send, concurrency in streams
            for _ in range(concurrency)
        ]
        while time.monotonic() < until:
            rss, fds = await asyncio.to_thread(_sample, pid)
            samples.append((time.monotonic() - started, rss, fds))
            print(f"{samples[-1][0]:6.0f} s  RSS {rss:8.1f} MiB  fds {fds:4d}", flush=True)
            await asyncio.sleep(min(SAMPLE_S, max(0.0, until - time.monotonic())))
        await asyncio.gather(*tasks)
        promises = _promises((await client.get("/metrics")).text)
    rss, fds = await asyncio.to_thread(_sample, pid)
    samples.append((time.monotonic() - started, rss, fds))
    fitted = [s for s in samples if s[0] >= min(WARM_UP_S, seconds / 3)]
    times = [s[0] for s in fitted]
    return {
        "seconds": seconds,
        "samples": [{"t_s": round(t, 1), "rss_mib": round(r, 1), "fds": f} for t, r, f in samples],
        "fitted_from_s": round(times[0], 1) if times else None,
        "rss_slope_mib_per_min": round(slope_per_minute(times, [s[1] for s in fitted]), 3),
        "fd_slope_per_min": round(slope_per_minute(times, [float(s[2]) for s in fitted]), 3),
        "rss_range_mib": [round(min(s[1] for s in fitted), 1), round(max(s[1] for s in fitted), 1)]
        if fitted
        else None,
        "fd_range": [min(s[2] for s in fitted), max(s[2] for s in fitted)] if fitted else None,
        "outcomes": dict(sorted(tally.statuses.items())),
        "refusals": dict(refusals),
        **promises,
    }


def _promises(text: str) -> dict[str, float]:
    """From /metrics: 504s after admission (sdpa_broken_admissions_total, every tenant) and
    long requests refused at admission for their deadline."""
    broken = refused = 0.0
    for line in text.splitlines():
        if line.startswith("sdpa_broken_admissions_total{"):
            broken += float(line.rsplit(" ", 1)[1])
        elif line.startswith('sdpa_rejected_total{reason="deadline_unreachable"}'):
            refused += float(line.rsplit(" ", 1)[1])
    return {"broken_admissions": broken, "refused_deadline_unreachable": refused}


def _markdown(result: dict[str, object], command: str) -> str:
    lines = [
        "# Soak: mixed traffic against one server",
        "",
        f"Command: `{command}`",
        "",
        f"- RSS slope after {result['fitted_from_s']} s: {result['rss_slope_mib_per_min']} MiB/min"
        f" (range {result['rss_range_mib']} MiB)",
        f"- descriptor slope: {result['fd_slope_per_min']} per minute (range {result['fd_range']})",
        f"- broken admissions (504 after admission, sdpa_broken_admissions_total): "
        f"{result['broken_admissions']:g}; long requests refused at admission for their "
        f"deadline: {result['refused_deadline_unreachable']:g}",
        "",
        "| stream and outcome | count |",
        "|---|---:|",
    ]
    outcomes = result["outcomes"]
    assert isinstance(outcomes, dict)
    lines += [f"| {name} | {count} |" for name, count in outcomes.items()]
    lines += ["", "| t (s) | RSS (MiB) | fds |", "|---:|---:|---:|"]
    samples = result["samples"]
    assert isinstance(samples, list)
    lines += [f"| {s['t_s']} | {s['rss_mib']} | {s['fds']} |" for s in samples]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "soak")
    args = parser.parse_args()
    # A queue deep enough for the mix, a long request's slices short enough to share the CPU.
    env = {"SDPA_MAX_BATCH_DELAY_MS": "2", "SDPA_REQUEST_TIMEOUT_MS": "60000"}
    with tempfile.TemporaryDirectory() as tmp, live_server(env, tmp_path=Path(tmp)) as server:
        result = asyncio.run(_soak(server.url, server.process.pid, args.seconds))
        log_tail = server.log()[-4000:]
    result["server_log_errors"] = [line for line in log_tail.splitlines() if '"ERROR"' in line]
    command = "python bench/soak.py" + (
        "" if args.seconds == 600 else f" --seconds {args.seconds:g}"
    )
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(result, command))
    print(_markdown(result, command))


if __name__ == "__main__":
    main()
