"""sdpa-loadtest: an async HTTP load generator for sdpa-service (and anything that takes a POST).

    sdpa-loadtest --preset small --concurrency 8 --duration 10
    sdpa-loadtest --preset large --rate 20 --duration 30 --json report.json --csv requests.csv
    sdpa-loadtest --request-file body.json --path /v1/analyze --requests 500
    sdpa-loadtest --tenant flood=KEY_A:24:large --tenant calm=KEY_B:1:small --duration 30

Closed loop with `--concurrency N`, open loop with `--rate R` (Poisson arrivals, at most
`--max-in-flight` outstanding); a run ends after `--duration` and/or `--requests` (10 s when
neither is given). With `--tenant NAME=KEY[:CONCURRENCY[:PRESET]]`, given once per tenant,
each tenant runs its own closed loop with its own API key at once, and the report gives each
tenant's latency percentiles, errors by status and 429s apart, then all together. The core it
drives (`sdpa_client.loadgen`: presets, payloads, the run,
the sender) serves benchmarks too, so that every system is measured with the same generator.
The progress bar needs `rich`, --histogram needs `matplotlib` (the `plot` extra:
pip install 'sdpa-client[plot]'), and uvloop is used when installed; none of them is required.
Its URL (--url, default http://127.0.0.1:8000) is printed first; when nothing can be connected
to there, the run gives up within seconds and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from sdpa_client.loadgen.payloads import PRESETS, Payload
from sdpa_client.loadgen.report import (
    format_report,
    format_tenants,
    require_matplotlib,
    write_csv,
    write_histogram,
)
from sdpa_client.loadgen.run import (
    LoadPlan,
    LoadReport,
    MultiTenantReport,
    Progress,
    TenantLoad,
    run_load,
    run_tenants,
)
from sdpa_client.loadgen.sender import HttpSender

__all__ = ["DEFAULT_DURATION_S", "TenantSpec", "build_parser", "main"]

DEFAULT_DURATION_S = 10.0
# Where `sdpa-service serve` listens by default (SDPA_HOST, SDPA_PORT).
DEFAULT_URL = "http://127.0.0.1:8000"


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


# A tenant's name as the server names its keys (SDPA_API_KEYS entries name=key).
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_TENANT_FORM = "--tenant takes NAME=KEY[:CONCURRENCY[:PRESET]]"


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One --tenant: the report's label, its API key ("" sends none: the server's "anonymous"
    tenant), and its concurrency and preset (None: --concurrency's and --preset's)."""

    name: str
    key: str = field(repr=False)  # never printed
    concurrency: int | None = None
    preset: str | None = None


def _tenant_arg(text: str) -> TenantSpec:
    """NAME=KEY[:CONCURRENCY[:PRESET]]. The messages never repeat the key."""
    name, sep, rest = text.partition("=")
    if not sep or not _TENANT_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"{_TENANT_FORM}, NAME 1-32 of A-Z a-z 0-9 _ . - (got a NAME of {len(name)} "
            f"characters{'' if sep else ' and no ='})"
        )
    parts = rest.split(":")
    if len(parts) > 3:
        raise argparse.ArgumentTypeError(
            f"{_TENANT_FORM}: tenant {name!r} has {len(parts) - 1} ':' (a KEY may not hold one)"
        )
    concurrency: int | None = None
    if len(parts) > 1 and parts[1]:
        try:
            concurrency = _positive(int)(parts[1])
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(
                f"{_TENANT_FORM}: tenant {name!r}: CONCURRENCY {exc}"
            ) from None
    preset = parts[2] if len(parts) > 2 and parts[2] else None
    if preset is not None and preset not in PRESETS:
        raise argparse.ArgumentTypeError(
            f"{_TENANT_FORM}: tenant {name!r}: PRESET must be one of {', '.join(sorted(PRESETS))},"
            f" got {preset!r}"
        )
    return TenantSpec(name, parts[0], concurrency, preset)


def _priority_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"--priority takes an int >= 0 (1 = highest, 0 = the server's default), got {text!r}"
        )
    return value


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
        epilog="Several tenants at once: one --tenant per API key, each a closed loop of its "
        "own, e.g. a flood of 24 concurrent large requests beside one tenant's sequential small "
        "ones: sdpa-loadtest --tenant flood=KEY_A:24:large --tenant calm=KEY_B:1:small "
        "--duration 30. The report (and --json's \"tenants\") gives each tenant's latency "
        "percentiles, errors by status and 429s apart, then all of them together.",
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help=f"server base URL (default {DEFAULT_URL}, where `sdpa-service serve` listens); "
        "when nothing answers there, the run gives up within seconds and exits 1",
    )
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
        help="the payload (default %(default)s): "
        + "; ".join(f"{p.name}: {p.describe()}" for p in PRESETS.values()),
    )
    what.add_argument(
        "--request-file",
        type=Path,
        help="a JSON request body to send as-is (default: none, a --preset's)",
    )
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
         "open loop: Poisson arrivals per second, instead of --concurrency (default: none, "
         "a closed loop)"),
        ("--max-in-flight", int, 256,
         "open loop: bound on outstanding requests (default %(default)s)"),
        ("--duration", float, None,
         "seconds to send for (default: none; 10 s when --requests is not given either)"),
        ("--requests", int, None, "requests to send (default: none, no count)"),
    ]  # fmt: skip
    for flag, kind, default, text in positive:
        parser.add_argument(flag, type=_positive(kind), default=default, help=text)
    parser.add_argument(
        "--warmup",
        type=_warmup_arg,
        default=(0, 0.0),
        help="unmeasured warm-up first: a count (20) or seconds (2s) (default: none)",
    )
    timeout_help = "seconds one request may take (default %(default)s)"
    parser.add_argument("--timeout", type=_positive(float), default=60.0, help=timeout_help)
    parser.add_argument(
        "--api-key", help="sent as 'Authorization: Bearer <key>' (default: none, no header)"
    )
    parser.add_argument(
        "--tenant",
        dest="tenants",
        action="append",
        type=_tenant_arg,
        metavar="NAME=KEY[:CONCURRENCY[:PRESET]]",
        help="a tenant of a multi-tenant run; give one per API key (instead of --api-key). "
        "NAME labels its report (1-32 of A-Z a-z 0-9 _ . -); KEY is its API key (empty: none; "
        "it may not hold ':'); CONCURRENCY its closed loop's requests in flight (default "
        "--concurrency); PRESET its payload (default --preset). --duration bounds the whole "
        "run, --requests each tenant's count; no --rate",
    )
    parser.add_argument(
        "--priority",
        type=_priority_arg,
        metavar="N",
        help='the requests\' priority level (v1 field, v2 parameter "priority"): 1 the '
        "highest, larger numbers lower, 0 the server's default; not sent when not given. It "
        "orders a tenant's own waiting requests, never one tenant before another",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the preset data and arrivals (default 0)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    parser.add_argument(
        "--json", dest="json_path", help="write the report as JSON (- = stdout; default: none)"
    )
    parser.add_argument(
        "--csv", dest="csv_path", type=Path, help="write per-request records (default: none)"
    )
    parser.add_argument(
        "--histogram",
        type=Path,
        help="write a latency histogram PNG (log latency axis); needs matplotlib: "
        "pip install 'sdpa-client[plot]' (default: none)",
    )
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


async def _run_cli(
    args: argparse.Namespace,
    payload: Payload,
    plan: LoadPlan,
    transport: httpx.AsyncBaseTransport | None,
) -> LoadReport:
    async with HttpSender(
        args.url, payload, api_key=args.api_key, timeout_s=args.timeout, transport=transport
    ) as send:
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


@dataclass(frozen=True, slots=True)
class _Tenant:
    spec: TenantSpec
    payload: Payload
    plan: LoadPlan


async def _run_tenants_cli(
    args: argparse.Namespace,
    tenants: Sequence[_Tenant],
    overall: LoadPlan,
    transport: httpx.AsyncBaseTransport | None,
) -> MultiTenantReport:
    async with contextlib.AsyncExitStack() as stack:
        senders: list[HttpSender] = []
        for t in tenants:
            sender = HttpSender(
                args.url, t.payload, api_key=t.spec.key or None, timeout_s=args.timeout,
                transport=transport,
            )  # fmt: skip
            senders.append(await stack.enter_async_context(sender))
        warm_requests, warm_seconds = args.warmup
        if warm_requests or warm_seconds:
            bounds = {"requests": warm_requests or None, "duration_s": warm_seconds or None}
            warm = [
                TenantLoad(t.spec.name, send, LoadPlan(**{**asdict(t.plan), **bounds}))
                for t, send in zip(tenants, senders, strict=True)
            ]
            await run_tenants(warm)
        loads = [
            TenantLoad(t.spec.name, send, t.plan) for t, send in zip(tenants, senders, strict=True)
        ]
        show = not args.no_progress and sys.stderr.isatty()
        with _progress_display(show, overall) as progress:
            return await run_tenants(loads, progress=progress)


def _event_loop_runner() -> asyncio.Runner:
    # uvloop (installed with uvicorn[standard]) roughly halves the generator's CPU per request.
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def _payload(args: argparse.Namespace, preset: str) -> Payload:
    if args.request_file is not None:
        return Payload.from_file(args.request_file, path=args.path or "/v1/attention")
    return Payload.from_preset(
        PRESETS[preset], encoding=args.encoding, seed=args.seed, path=args.path,
        protocol=args.protocol, priority=args.priority,
    )  # fmt: skip


def _check_tenants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What --tenant may not be given with (before anything is sent)."""
    specs: list[TenantSpec] = args.tenants
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        parser.error(f"--tenant: each NAME once, got {', '.join(names)}")
    if args.api_key is not None:
        parser.error("--api-key and --tenant: give each tenant its key in its --tenant")
    if args.rate is not None:
        parser.error("--tenant runs a closed loop per tenant (its CONCURRENCY); no --rate")
    if args.request_file is not None and any(spec.preset for spec in specs):
        parser.error("--request-file and a --tenant with a PRESET: every tenant sends the file")


def main(
    argv: Sequence[str] | None = None, *, transport: httpx.AsyncBaseTransport | None = None
) -> int:
    """Run sdpa-loadtest with these arguments (default: sys.argv's).

    Args:
        argv: the command line, without the program's name.
        transport: an httpx transport in place of the network (tests: the app in process).

    Returns:
        The exit status: 1 when requests were sent and none succeeded (in a multi-tenant run:
        for some tenant), or when nothing could be connected to at --url (the run gives up
        after LoadPlan.connect_give_up_s), else 0.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.histogram is not None:
        require_matplotlib()  # fail before the run, not after it
    if args.priority is not None and args.request_file is not None:
        parser.error('--priority and --request-file: the file is sent as-is; put "priority" in it')
    specs: list[TenantSpec] = args.tenants or []
    if specs:
        _check_tenants(parser, args)
    duration = args.duration
    if duration is None and args.requests is None:
        duration = DEFAULT_DURATION_S
    plan = LoadPlan(
        concurrency=args.concurrency, rate=args.rate, max_in_flight=args.max_in_flight,
        duration_s=duration, requests=args.requests, timeout_s=args.timeout, seed=args.seed,
    )  # fmt: skip
    presets = {args.preset, *(spec.preset or args.preset for spec in specs)}
    try:
        payloads = {preset: _payload(args, preset) for preset in presets}
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    payload = payloads[args.preset]
    tenants = [
        _Tenant(
            spec,
            payloads[spec.preset or args.preset],
            replace(plan, concurrency=spec.concurrency or args.concurrency),
        )
        for spec in specs
    ]
    multi: MultiTenantReport | None = None
    # Said first, on stderr (stdout may be --json -): which server this run loads.
    print(f"sdpa-loadtest: target {args.url.rstrip('/')}", file=sys.stderr)
    with _event_loop_runner() as runner:
        if tenants:
            requests = None if args.requests is None else args.requests * len(tenants)
            concurrency = sum(t.plan.concurrency for t in tenants)
            plan = replace(plan, concurrency=concurrency, requests=requests)
            multi = runner.run(_run_tenants_cli(args, tenants, plan, transport))
            report = multi.overall
        else:
            report = runner.run(_run_cli(args, payload, plan, transport))

    if report.gave_up is not None:
        print(
            f"sdpa-loadtest: cannot connect to {args.url}: every request of the first "
            f"{plan.connect_give_up_s:g} s failed to connect ({report.gave_up}); is the server "
            "running, and is --url right?",
            file=sys.stderr,
        )
        return 1
    used = {t.payload.name: t.payload for t in tenants} or {payload.name: payload}
    if len(used) == 1:
        [payload] = used.values()
        name, description, body_bytes = payload.name, payload.description, len(payload.body)
    else:
        name, description, body_bytes = "+".join(sorted(used)), "one per tenant", None
    target = f"{args.url.rstrip('/')}{payload.path}  {name}: {description}"
    text_out = sys.stderr if args.json_path == "-" else sys.stdout
    print(format_report(report, target=target), file=text_out)
    if multi is not None:
        labels = {t.spec.name: t.payload.name for t in tenants}
        print(format_tenants(multi, payloads=labels), file=text_out)
    if args.json_path is not None:
        document: dict[str, Any] = {
            "target": {"url": args.url, "path": payload.path, "payload": name,
                       "description": description, "body_bytes": body_bytes,
                       "priority": args.priority},
            "plan": asdict(plan),
            "report": report.summary(),
        }  # fmt: skip
        if multi is not None:
            document["tenants"] = {
                t.spec.name: {"payload": t.payload.name, "description": t.payload.description,
                              "body_bytes": len(t.payload.body), "plan": asdict(t.plan),
                              "report": part.summary()}
                for t, part in zip(tenants, multi.tenants, strict=True)
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
        write_histogram(report, args.histogram, title=f"{name}: {report.mode} loop")
    parts = multi.tenants if multi is not None else (report,)
    return 1 if any(part.sent > 0 and part.ok == 0 for part in parts) else 0


if __name__ == "__main__":
    raise SystemExit(main())
