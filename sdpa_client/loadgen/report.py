"""What a load test writes: the text report, per-request CSV and a latency histogram (PNG)."""

from __future__ import annotations

import csv
import importlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from sdpa_client.loadgen.run import LoadReport, MultiTenantReport, RequestRecord


def write_csv(records: Sequence[RequestRecord], out: TextIO) -> None:
    """One row per request; a "tenant" column too when the records come from a multi-tenant
    run."""
    tenants = any(r.tenant is not None for r in records)
    writer = csv.writer(out)
    writer.writerow(["index", "start_s", "latency_ms", "status", "error", *(["tenant"] * tenants)])
    for i, r in enumerate(records):
        row = [i, f"{r.start_s:.6f}", f"{r.latency_s * 1000:.3f}", r.status, r.error or ""]
        writer.writerow([*row, *([r.tenant or ""] * tenants)])


def require_matplotlib() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as exc:
        raise SystemExit(
            "sdpa-loadtest: --histogram needs matplotlib, which sdpa-client does not require: "
            "pip install 'sdpa-client[plot]' (or pip install matplotlib)"
        ) from exc
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def latency_bin_edges(latencies_ms: Sequence[float], bins: int) -> list[float]:
    """`bins` + 1 edges spaced evenly in log(latency), from the smallest latency to the largest.

    Latencies are skewed: most near the median, a long tail to the right. Linear bins spanning
    the tail squeeze the bulk into the first few; on a log axis each bin is the same factor
    wide, so the bulk and the tail both show.
    """
    positive = [x for x in latencies_ms if x > 0 and math.isfinite(x)]
    if not positive or bins < 1:
        return []
    low, high = min(positive), max(positive)
    if high <= low:  # one value (or all equal): a bin of +-5% around it
        low, high = low / 1.05, high * 1.05
    ratio = (high / low) ** (1.0 / bins)
    edges = [low * ratio**i for i in range(bins + 1)]
    edges[-1] = high  # exact, whatever the rounding of the powers
    return edges


def histogram_figure(report: LoadReport, *, title: str) -> Any:
    """The latency histogram of the successful requests as a matplotlib Figure: log-spaced
    bins on a log latency axis, and the p50/p90/p99 lines."""
    plt = require_matplotlib()
    latencies = [r.latency_s * 1000 for r in report.records if r.error is None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    edges = latency_bin_edges(latencies, min(100, max(10, len(latencies) // 20)))
    if edges:
        ax.hist(latencies, bins=edges, color="#4477aa")
        ax.set_xscale("log")
        lat = report.latency
        for label, value, style in (("p50", lat.p50_ms, "-"), ("p90", lat.p90_ms, "--"),
                                    ("p99", lat.p99_ms, ":")):  # fmt: skip
            ax.axvline(value, color="#cc3311", linestyle=style, label=f"{label} {value:.2f} ms")
        ax.legend()
    ax.set_xlabel("latency (ms, log scale), successful requests")
    ax.set_ylabel("requests")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def write_histogram(report: LoadReport, path: Path, *, title: str) -> None:
    """Write `histogram_figure` as a PNG at `path`."""
    plt = require_matplotlib()
    fig = histogram_figure(report, title=title)
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


def format_tenants(report: MultiTenantReport, *, payloads: Mapping[str, str]) -> str:
    """One line per tenant: its payload, concurrency, counts (429 apart), errors by kind and
    latency percentiles of its successful requests (ms; "-" when it had none)."""

    def ms(value: float) -> str:
        return "-" if math.isnan(value) else f"{value:.2f}"

    head = ("tenant", "payload", "conc", "sent", "ok", "429", "p50 ms", "p90 ms", "p99 ms",
            "ok/s", "errors")  # fmt: skip
    rows = [head]
    for t in report.tenants:
        lat = t.latency
        errors = ", ".join(f"{k}: {v}" for k, v in t.errors.items()) or "none"
        rows.append((
            t.name, payloads.get(t.name, ""), str(t.concurrency), str(t.sent), str(t.ok),
            str(t.rate_limited), ms(lat.p50_ms), ms(lat.p90_ms), ms(lat.p99_ms),
            f"{t.throughput_rps:.1f}", errors,
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for row in rows:
        # names left-aligned, numbers right-aligned, the errors (last) as they are
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs]
        lines.append("  ".join([*cells[:-1], row[-1]]))
    return "per tenant\n" + "\n".join("  " + line for line in lines)
