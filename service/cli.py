"""`sdpa-service serve | healthcheck | analyze`.

- serve: settings from the environment (SDPA_*), command-line flags override them.
- healthcheck: exit 0 iff /readyz answers 200 (the container's HEALTHCHECK; no curl needed).
- analyze: sdpa_core.analyze_scaling on synthetic q/k, as a table or JSON.

Heavy imports (torch, the app, uvicorn) happen inside the subcommand that needs them, so the
healthcheck starts fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.settings import Settings

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdpa-service", description="Scaled dot-product attention as an HTTP service."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the HTTP server and the gRPC door (one uvicorn worker)",
        description="Run the HTTP server and, beside it, the gRPC door (Open Inference "
        "Protocol). Settings come from SDPA_* environment variables; the flags below override "
        "them.",
    )
    serve.add_argument("--host", help="bind address (SDPA_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="bind port (SDPA_PORT, default 8000)")
    grpc = serve.add_mutually_exclusive_group()
    grpc.add_argument(
        "--grpc-port",
        type=int,
        help="the gRPC door's port (SDPA_GRPC_PORT, default 8001; 0 = off)",
    )
    grpc.add_argument(
        "--no-grpc",
        action="store_true",
        help="serve HTTP alone, without the gRPC door (the same as SDPA_GRPC_PORT=0)",
    )
    serve.add_argument("--device", help="auto | cpu | cuda | cuda:N (SDPA_DEVICE, default auto)")
    serve.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        help="log level (SDPA_LOG_LEVEL, default info)",
    )

    health = sub.add_parser(
        "healthcheck",
        help="exit 0 iff the server is ready",
        description="GET /readyz; exit 0 iff it answers 200. No curl needed.",
    )
    health.add_argument(
        "--url", help="readiness URL (default http://127.0.0.1:$SDPA_PORT/readyz, port 8000)"
    )
    health.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")

    analyze = sub.add_parser(
        "analyze",
        help="compare score-scaling strategies on synthetic q/k",
        description="Draw q, k ~ N(0, std^2) (seeded) and compare how dividing the raw scores "
        "q.k by each strategy's divisor shapes the softmax.",
    )
    analyze.add_argument("--d-k", type=int, required=True, help="head dimension d_k (required)")
    analyze.add_argument("--n", type=int, default=64, help="queries and keys (default 64)")
    analyze.add_argument("--std", type=float, default=1.0, help="std of q and k (default 1)")
    analyze.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    analyze.add_argument(
        "--strategies",
        nargs="+",
        metavar="STRATEGY",
        help="names (none sqrt_dk dk dk_quarter two_sqrt_dk) and/or custom NAME=DIVISOR; "
        "default: the five standard ones",
    )
    analyze.add_argument(
        "--json", action="store_true", help="print the report as JSON (default: a table)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "healthcheck":
        return _healthcheck(args)
    return _analyze(args)


# --- serve -------------------------------------------------------------------------------------


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment with the given flags on top (init kwargs beat env)."""
    from service.settings import Settings

    overrides: dict[str, Any] = {
        name: getattr(args, name)
        for name in ("host", "port", "grpc_port", "device", "log_level")
        if getattr(args, name, None) is not None
    }
    if getattr(args, "no_grpc", False):
        overrides["grpc_port"] = 0
    return Settings(**overrides)


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from service.server import serve

    try:
        settings = settings_from(args)
    except ValidationError as exc:
        print(f"sdpa-service: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    return serve(settings)


# --- healthcheck -------------------------------------------------------------------------------


def _healthcheck(args: argparse.Namespace) -> int:
    from service.healthcheck import healthcheck

    url = args.url
    if url is None:
        url = _default_health_url()
        if url is None:
            return 1
    return healthcheck(url, args.timeout)


def _default_health_url() -> str | None:
    """http://127.0.0.1:<port>/readyz with the port the server would read from SDPA_PORT."""
    from pydantic import ValidationError

    from service.healthcheck import default_url
    from service.settings import Settings

    try:
        port = Settings().port
    except ValidationError as exc:
        print(f"sdpa-service healthcheck: invalid settings:\n{exc}", file=sys.stderr)
        return None
    return default_url(port)


# --- analyze -----------------------------------------------------------------------------------

_TABLE_WIDTH = 110
_COLUMNS = (
    ("strategy", "name"),
    ("divisor", "divisor"),
    ("score var", "score_variance"),
    ("entropy", "entropy"),
    ("norm. entropy", "normalized_entropy"),
    ("max weight", "max_weight"),
    ("saturated", "saturated_fraction"),
    ("grad health", "grad_health"),
)


def parse_strategies(specs: Sequence[str] | None) -> list[str | tuple[str, float]] | None:
    """["sqrt_dk", "mine=12.5"] -> ["sqrt_dk", ("mine", 12.5)]; None stays None (the default)."""
    if specs is None:
        return None
    parsed: list[str | tuple[str, float]] = []
    for spec in specs:
        name, sep, divisor = spec.partition("=")
        if not sep:
            parsed.append(spec)
            continue
        try:
            value = float(divisor)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"strategy {spec!r}: divisor must be a number"
            ) from None
        if not name or not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(
                f"strategy {spec!r}: expected NAME=DIVISOR with a positive, finite divisor"
            )
        parsed.append((name, value))
    return parsed


def _analyze(args: argparse.Namespace) -> int:
    if args.d_k < 1 or args.n < 1:
        print("sdpa-service analyze: --d-k and --n must be >= 1", file=sys.stderr)
        return 2
    try:
        strategies = parse_strategies(args.strategies)
    except argparse.ArgumentTypeError as exc:
        print(f"sdpa-service analyze: {exc}", file=sys.stderr)
        return 2

    from sdpa_core import SdpaError, analyze_scaling, make_synthetic_qk

    try:
        q, k = make_synthetic_qk(n_q=args.n, n_k=args.n, d_k=args.d_k, std=args.std, seed=args.seed)
        report = analyze_scaling(q, k, strategies=strategies)
    except SdpaError as exc:
        print(f"sdpa-service analyze: {exc}", file=sys.stderr)
        return 2

    data = dataclasses.asdict(report)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    _print_table(data, n=args.n, std=args.std, seed=args.seed)
    return 0


def _print_table(data: dict[str, Any], *, n: int, std: float, seed: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Scaling strategies: d_k={data['d_k']}, n={n}, std={std:g}, seed={seed}",
        caption=f"raw score variance {data['raw_score_variance']:.4g}; "
        f"recommended divisor (std of raw scores) {data['recommended_divisor']:.4g}",
    )
    for header, _ in _COLUMNS:
        table.add_column(header, justify="left" if header == "strategy" else "right", no_wrap=True)
    for row in data["strategies"]:
        table.add_row(*(_cell(row[field]) for _, field in _COLUMNS))
    # Piped output gets rich's 80 columns, too narrow for eight columns of numbers.
    console = Console()
    if console.width < _TABLE_WIDTH:
        console = Console(width=_TABLE_WIDTH)
    console.print(table)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
