"""sdpa-loadtest: an async HTTP load generator for sdpa-service (and anything that takes a POST).

    sdpa-loadtest --preset small --concurrency 8 --duration 10
    sdpa-loadtest --preset large --rate 20 --duration 30 --json report.json --csv requests.csv
    sdpa-loadtest --request-file body.json --path /v1/analyze --requests 500

Closed loop with `--concurrency N`, open loop with `--rate R` (Poisson arrivals, at most
`--max-in-flight` outstanding); a run ends after `--duration` and/or `--requests` (10 s when
neither is given). The core it drives (`sdpa_client.loadgen`: presets, payloads, the run,
the sender) serves benchmarks too, so that every system is measured with the same generator.
The progress bar needs `rich`, --histogram needs `matplotlib`, and uvloop is used when
installed; none of them is required.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sdpa_client.loadgen.payloads import PRESETS, Payload
from sdpa_client.loadgen.report import format_report, require_matplotlib, write_csv, write_histogram
from sdpa_client.loadgen.run import LoadPlan, LoadReport, Progress, run_load
from sdpa_client.loadgen.sender import HttpSender

__all__ = ["DEFAULT_DURATION_S", "build_parser", "main"]

DEFAULT_DURATION_S = 10.0


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
    parser.add_argument(
        "--path",
        help="endpoint (default /v1/attention; with --protocol v2, /v2/models/attention/infer)",
    )
    parser.add_argument(
        "--protocol",
        choices=["v1", "v2"],
        default="v1",
        help="v1 JSON, or v2 (Open Inference Protocol; --encoding base64 sends binary tensor "
        "data) (default %(default)s)",
    )
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
    # Numbers that must be positive and finite: (flag, kind, default, help).
    positive: list[tuple[str, type[int] | type[float], float | None, str]] = [
        ("--concurrency", int, 8, "closed loop: requests kept in flight (default %(default)s)"),
        ("--rate", float, None,
         "open loop: Poisson arrivals per second (instead of --concurrency)"),
        ("--max-in-flight", int, 256,
         "open loop: bound on outstanding requests (default %(default)s)"),
        ("--duration", float, None, "seconds to send for"),
        ("--requests", int, None, "requests to send"),
    ]  # fmt: skip
    for flag, kind, default, text in positive:
        parser.add_argument(flag, type=_positive(kind), default=default, help=text)
    parser.add_argument(
        "--warmup",
        type=_warmup_arg,
        default=(0, 0.0),
        help="unmeasured warm-up first: a count (20) or seconds (2s)",
    )
    timeout_help = "seconds one request may take (default %(default)s)"
    parser.add_argument("--timeout", type=_positive(float), default=60.0, help=timeout_help)
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer <key>'")
    parser.add_argument("--seed", type=int, default=0, help="seed of the preset data and arrivals")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    parser.add_argument("--json", dest="json_path", help="write the report as JSON (- = stdout)")
    parser.add_argument("--csv", dest="csv_path", type=Path, help="write per-request records")
    parser.add_argument("--histogram", type=Path, help="write a latency histogram PNG")
    return parser


@contextlib.contextmanager
def _progress_display(enabled: bool, plan: LoadPlan) -> Iterator[Callable[[Progress], None] | None]:
    if not enabled or importlib.util.find_spec("rich") is None:  # rich is optional: no bar
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
        require_matplotlib()  # fail before the run, not after it
    duration = args.duration
    if duration is None and args.requests is None:
        duration = DEFAULT_DURATION_S
    plan = LoadPlan(
        concurrency=args.concurrency, rate=args.rate, max_in_flight=args.max_in_flight,
        duration_s=duration, requests=args.requests, timeout_s=args.timeout, seed=args.seed,
    )  # fmt: skip
    try:
        if args.request_file is not None:
            payload = Payload.from_file(args.request_file, path=args.path or "/v1/attention")
        else:
            payload = Payload.from_preset(
                PRESETS[args.preset], encoding=args.encoding, seed=args.seed, path=args.path,
                protocol=args.protocol,
            )  # fmt: skip
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
