"""sdpa-loadtest with several tenants (--tenant) and --priority: the arguments, the per-tenant
arithmetic against hand-computed percentiles, the run core with fake senders, and the CLI against
the service's own app in process (its API keys tell the tenants apart)."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from sdpa_client.loadgen import (
    PRESETS,
    LatencySummary,
    LoadPlan,
    MultiTenantReport,
    Payload,
    RequestRecord,
    Sender,
    TenantLoad,
    TenantReport,
    run_tenants,
)
from sdpa_client.loadtest import TenantSpec, build_parser, main
from sdpa_client.v2 import HEADER_LENGTH
from tests.support.app import app_transport, in_process_client, small_settings

# ---- the arguments ----------------------------------------------------------------------------


def test_tenants_parse_as_name_key_concurrency_preset() -> None:
    args = build_parser().parse_args([
        "--tenant", "flood=key-a:24:large", "--tenant", "calm=key-b:1:small",
        "--tenant", "plain=key-c", "--tenant", "anon=", "--tenant", "heavy.2=k::large",
        "--priority", "1",
    ])  # fmt: skip
    assert args.tenants == [
        TenantSpec("flood", "key-a", 24, "large"),
        TenantSpec("calm", "key-b", 1, "small"),
        TenantSpec("plain", "key-c", None, None),
        TenantSpec("anon", "", None, None),  # no key: the server's "anonymous" tenant
        TenantSpec("heavy.2", "k", None, "large"),
    ]
    assert args.priority == 1
    assert "key-a" not in repr(args.tenants[0])  # a key is never printed
    # The flood: 24 concurrent [1, 8, 1024, 64] requests; the calm tenant's are small.
    assert PRESETS["large"].shape == (1, 8, 1024, 64)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("noequals", "NAME=KEY"),
        ("bad name=secret-key", "NAME 1-32"),
        ("=secret-key", "NAME 1-32"),
        ("a=secret:key:2:small", "may not hold"),
        ("a=secret-key:0", "CONCURRENCY must be > 0"),
        ("a=secret-key:many", "CONCURRENCY not a number"),
        ("a=secret-key:2:huge", "PRESET must be one of large, medium, small"),
    ],
)
def test_a_malformed_tenant_is_refused_without_echoing_its_key(
    spec: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["--tenant", spec])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert says in err
    assert "secret" not in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tenant", "a=k1", "--tenant", "a=k2"], "each NAME once"),
        (["--tenant", "a=k1", "--api-key", "k0"], "--api-key and --tenant"),
        (["--tenant", "a=k1", "--rate", "5"], "no --rate"),
        (["--tenant", "a=k1:2:large", "--request-file", "x.json"], "--request-file and a"),
        (["--priority", "1", "--request-file", "x.json"], "--priority and --request-file"),
        (["--priority", "-1"], "int >= 0"),
        (["--priority", "high"], "int >= 0"),
    ],
)
def test_combinations_that_cannot_run_are_refused_before_sending(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing may be sent")

    with pytest.raises(SystemExit) as ei:
        main([*argv, "--requests", "1"], transport=httpx.MockTransport(refuse))
    assert ei.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_priority_is_in_the_payload_the_way_the_client_sends_it(protocol: Any) -> None:
    with_priority = Payload.from_preset(PRESETS["small"], protocol=protocol, priority=2)
    without = Payload.from_preset(PRESETS["small"], protocol=protocol)
    if protocol == "v1":
        assert json.loads(with_priority.body)["priority"] == 2
        assert "priority" not in json.loads(without.body)
    else:
        length = int(dict(with_priority.headers)[HEADER_LENGTH])
        assert json.loads(with_priority.body[:length])["parameters"]["priority"] == 2
        length = int(dict(without.headers)[HEADER_LENGTH])
        assert "priority" not in json.loads(without.body[:length])["parameters"]
    assert "priority 2" in with_priority.description


def test_the_cli_sends_priority_on_either_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={})

    common = ["--requests", "2", "--concurrency", "1", "--priority", "3", "--no-progress"]
    assert main([*common, "--json", "-"], transport=httpx.MockTransport(record)) == 0
    assert json.loads(capsys.readouterr().out)["target"]["priority"] == 3
    assert main([*common, "--protocol", "v2"], transport=httpx.MockTransport(record)) == 0
    assert [r.url.path for r in sent] == ["/v1/attention"] * 2 + ["/v2/models/attention/infer"] * 2
    assert [json.loads(r.content)["priority"] for r in sent[:2]] == [3, 3]
    for request in sent[2:]:
        header = request.content[: int(request.headers[HEADER_LENGTH])]
        assert json.loads(header)["parameters"]["priority"] == 3


# ---- the per-tenant arithmetic ----------------------------------------------------------------


def record(latency_ms: float, status: int, error: str | None = "auto") -> RequestRecord:
    kind = (None if 200 <= status < 300 else str(status)) if error == "auto" else error
    return RequestRecord(0.0, latency_ms / 1000.0, status, kind, "a")


def test_a_tenant_report_counts_by_status_and_takes_percentiles_of_its_successes() -> None:
    records = [
        record(30, 200), record(10, 200), record(50, 200), record(20, 200), record(40, 200),
        record(1, 429), record(2, 429), record(3, 503), record(900, 0, "ConnectError"),
    ]  # fmt: skip
    report = TenantReport.of("a", LoadPlan(concurrency=24, requests=9), records, elapsed_s=2.0)
    assert (report.sent, report.ok, report.rate_limited, report.concurrency) == (9, 5, 2, 24)
    assert dict(report.errors) == {"429": 2, "503": 1, "ConnectError": 1}
    assert report.throughput_rps == 2.5  # 5 successes in 2 s
    lat = report.latency
    # Sorted successes 10 20 30 40 50 ms; the percentile at p of n = 5 lies at rank (n-1)p
    # between neighbours (linear): p50 rank 2 = 30; p90 rank 3.6 = 40 + 0.6*10; p99 rank 3.96.
    assert lat.count == 5
    assert (lat.min_ms, lat.max_ms, lat.mean_ms) == pytest.approx((10.0, 50.0, 30.0))
    assert (lat.p50_ms, lat.p90_ms, lat.p99_ms) == pytest.approx((30.0, 46.0, 49.6))
    summary = report.summary()
    assert summary["rate_limited"] == 2
    assert summary["errors"] == {"429": 2, "503": 1, "ConnectError": 1}
    assert summary["latency"]["p90_ms"] == pytest.approx(46.0)
    assert json.loads(json.dumps(summary, allow_nan=False)) == summary


def test_a_tenant_without_successes_has_no_latencies_in_json() -> None:
    report = TenantReport.of(
        "b", LoadPlan(requests=2), [record(5, 429), record(6, 429)], elapsed_s=1.0
    )
    assert (report.ok, report.rate_limited, report.latency.count) == (0, 2, 0)
    assert math.isnan(report.latency.p50_ms)
    assert report.summary()["latency"]["p99_ms"] is None


# ---- the run core, with fake senders ----------------------------------------------------------


class Counting:
    """A sender that answers `statuses` in turn after `delay_s`, and records how many of its
    requests were in flight at once."""

    def __init__(self, statuses: list[int], delay_s: float = 0.0) -> None:
        self._cycle = itertools.cycle(statuses)
        self._delay_s = delay_s
        self.in_flight = 0
        self.most_in_flight = 0

    async def __call__(self) -> int:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self._delay_s)
            return next(self._cycle)
        finally:
            self.in_flight -= 1


def test_each_tenant_is_measured_apart_and_all_together() -> None:
    flood = Counting([200, 429, 429], delay_s=0.002)
    calm = Counting([200], delay_s=0.001)
    loads = [
        TenantLoad("flood", flood, LoadPlan(concurrency=24, requests=96, duration_s=30.0)),
        TenantLoad("calm", calm, LoadPlan(concurrency=1, requests=10, duration_s=30.0)),
    ]
    report = asyncio.run(run_tenants(loads))
    by_name = {t.name: t for t in report.tenants}
    assert [t.name for t in report.tenants] == ["flood", "calm"]
    assert flood.most_in_flight == 24  # 24 concurrent beside a sequential tenant
    assert calm.most_in_flight == 1
    assert (by_name["flood"].sent, by_name["flood"].ok, by_name["flood"].rate_limited) == (
        96, 32, 64,
    )  # fmt: skip
    assert (by_name["calm"].sent, by_name["calm"].ok, by_name["calm"].rate_limited) == (10, 10, 0)
    overall = report.overall
    assert (overall.sent, overall.ok, overall.concurrency) == (106, 42, 25)
    assert dict(overall.errors) == {"429": 64}
    assert Counter(r.tenant for r in overall.records) == {"flood": 96, "calm": 10}
    for tenant in report.tenants:
        assert all(r.tenant == tenant.name for r in tenant.records)
        ok = [r.latency_s for r in tenant.records if r.error is None]
        assert tenant.latency == LatencySummary.of(ok)
    assert overall.latency == LatencySummary.of(
        [r.latency_s for r in overall.records if r.error is None]
    )
    assert [r.start_s for r in overall.records] == sorted(r.start_s for r in overall.records)
    summary = report.summary()
    assert summary["tenants"]["flood"]["rate_limited"] == 64
    assert summary["overall"]["sent"] == 106


def test_every_tenant_s_loop_ends_at_the_common_duration() -> None:
    async def slow() -> int:
        await asyncio.sleep(0.01)
        return 200

    loads = [
        TenantLoad("a", slow, LoadPlan(concurrency=2, duration_s=0.2)),
        TenantLoad("b", slow, LoadPlan(concurrency=1, duration_s=0.2)),
    ]
    report = asyncio.run(run_tenants(loads))
    assert 0.2 <= report.overall.elapsed_s < 2.0
    assert all(r.start_s < 0.2 for r in report.overall.records)
    assert all(t.sent > 0 for t in report.tenants)


def test_run_tenants_refuses_what_it_cannot_report() -> None:
    send: Sender = Counting([200])
    plan = LoadPlan(requests=1)
    with pytest.raises(ValueError, match="distinct"):
        asyncio.run(run_tenants([TenantLoad("a", send, plan), TenantLoad("a", send, plan)]))
    with pytest.raises(ValueError, match="distinct"):
        asyncio.run(run_tenants([]))
    open_plan = LoadPlan(rate=10.0, requests=1)
    with pytest.raises(ValueError, match="closed loop"):
        asyncio.run(run_tenants([TenantLoad("a", send, plan), TenantLoad("b", send, open_plan)]))


# ---- the CLI against the service's app, in process --------------------------------------------


@pytest.fixture(scope="module")
def app_with_keys() -> Iterator[TestClient]:
    # Two keys tell two tenants apart; compiling the statistics kernel (seconds at start) is
    # not what these tests are about.
    settings = small_settings(api_keys="key-a,key-b", compile_kernels=False)
    with in_process_client(settings) as client:
        yield client


def test_the_cli_reports_each_tenant_of_the_real_app(
    app_with_keys: TestClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two tenants with the app's keys and one with a wrong key: the 401s are the intruder's
    alone, in the text, the JSON and the CSV."""
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    status = main(
        ["--url", "http://testserver", "--tenant", "a=key-a:2:small",
         "--tenant", "b=key-b:1", "--tenant", "intruder=not-a-key:1:small", "--requests", "4",
         "--warmup", "1", "--no-progress", "--json", str(out_json), "--csv", str(out_csv)],
        transport=app_transport(app_with_keys),
    )  # fmt: skip
    assert status == 1  # one tenant had no success at all
    document = json.loads(out_json.read_text())
    tenants = document["tenants"]
    assert list(tenants) == ["a", "b", "intruder"]
    for name in ("a", "b"):
        report = tenants[name]["report"]
        assert (report["sent"], report["ok"], report["errors"], report["rate_limited"]) == (
            4, 4, {}, 0,
        )  # fmt: skip
        assert report["latency"]["count"] == 4
        assert tenants[name]["payload"] == "small"
    assert tenants["a"]["plan"]["concurrency"] == 2
    intruder = tenants["intruder"]["report"]
    assert (intruder["sent"], intruder["ok"], intruder["errors"]) == (4, 0, {"401": 4})
    assert intruder["latency"]["p50_ms"] is None
    overall = document["report"]
    assert (overall["sent"], overall["ok"], overall["errors"]) == (12, 8, {"401": 4})
    assert document["plan"]["concurrency"] == 4
    assert document["plan"]["requests"] == 12
    assert "key-a" not in out_json.read_text()
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert Counter((row["tenant"], row["status"]) for row in rows) == {
        ("a", "200"): 4, ("b", "200"): 4, ("intruder", "401"): 4,
    }  # fmt: skip
    text = capsys.readouterr().out
    assert "per tenant" in text
    assert "intruder" in text
    assert "401: 4" in text


def test_a_multi_tenant_report_is_json_ready_without_successes() -> None:
    send: Sender = Counting([503])
    report = asyncio.run(run_tenants([TenantLoad("only", send, LoadPlan(requests=2))]))
    assert isinstance(report, MultiTenantReport)
    text = json.dumps(report.summary(), allow_nan=False)
    assert json.loads(text)["tenants"]["only"]["errors"] == {"503": 2}
