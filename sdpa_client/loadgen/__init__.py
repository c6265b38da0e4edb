"""The core of sdpa-loadtest, for benchmarks that drive it from Python.

payload = Payload.from_preset(PRESETS["small"])
async with HttpSender("http://127.0.0.1:8000", payload) as send:
    report = await run_load(send, LoadPlan(concurrency=8, duration_s=10))

Several tenants at once, each with its own key, payload and plan:
    loads = [TenantLoad("a", sender_a, LoadPlan(concurrency=24, duration_s=10)),
             TenantLoad("b", sender_b, LoadPlan(concurrency=1, duration_s=10))]
    report = await run_tenants(loads)       # report.overall, report.tenants[i].latency.p99_ms
"""

from __future__ import annotations

from sdpa_client.loadgen.payloads import PRESETS, Payload, Preset
from sdpa_client.loadgen.report import format_report, format_tenants, write_csv, write_histogram
from sdpa_client.loadgen.run import (
    GENERATOR_BUSY_PERCENT,
    LatencySummary,
    LoadPlan,
    LoadReport,
    MultiTenantReport,
    Progress,
    RequestRecord,
    Sender,
    TenantLoad,
    TenantReport,
    run_load,
    run_tenants,
)
from sdpa_client.loadgen.sender import HttpSender

__all__ = [
    "GENERATOR_BUSY_PERCENT",
    "PRESETS",
    "HttpSender",
    "LatencySummary",
    "LoadPlan",
    "LoadReport",
    "MultiTenantReport",
    "Payload",
    "Preset",
    "Progress",
    "RequestRecord",
    "Sender",
    "TenantLoad",
    "TenantReport",
    "format_report",
    "format_tenants",
    "run_load",
    "run_tenants",
    "write_csv",
    "write_histogram",
]
