"""The core of sdpa-loadtest, for benchmarks that drive it from Python.

payload = Payload.from_preset(PRESETS["small"])
async with HttpSender("http://127.0.0.1:8000", payload) as send:
    report = await run_load(send, LoadPlan(concurrency=8, duration_s=10))
"""

from __future__ import annotations

from sdpa_client.loadgen.payloads import PRESETS, Payload, Preset
from sdpa_client.loadgen.report import format_report, write_csv, write_histogram
from sdpa_client.loadgen.run import (
    GENERATOR_BUSY_PERCENT,
    LatencySummary,
    LoadPlan,
    LoadReport,
    Progress,
    RequestRecord,
    Sender,
    run_load,
)
from sdpa_client.loadgen.sender import HttpSender

__all__ = [
    "GENERATOR_BUSY_PERCENT",
    "PRESETS",
    "HttpSender",
    "LatencySummary",
    "LoadPlan",
    "LoadReport",
    "Payload",
    "Preset",
    "Progress",
    "RequestRecord",
    "Sender",
    "format_report",
    "run_load",
    "write_csv",
    "write_histogram",
]
