"""The spans of the real service (create_app, its middlewares and routes, in this process),
read back from the real SDK through an InMemorySpanExporter.

The edge (service.middleware.access_log) makes each request's Exchange and the one recorder
(service.access_log) turns it into the span: what the inner middlewares and the routes put in
the Exchange (the request id, the tenant, the batch and the phases) reaches the span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import Receive, Scope, Send

from service.app import create_app
from service.middleware.access_log import AccessLogMiddleware
from service.tracing import PHASE_NAMES, Tracing
from tests.support.app import ready_engine, small_settings

CALLER_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CALLER_SPAN = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"
KEY = "tracing-test-key-1"
SMALL = {"q": [[1.0, 0.0]], "k": [[1.0, 0.0], [0.0, 1.0]], "v": [[1.0, 2.0], [3.0, 4.0]]}


@pytest.fixture(scope="module")
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def tracing(exported: InMemorySpanExporter) -> Iterator[Tracing]:
    tracing = Tracing(exporters=[exported])
    yield tracing
    tracing.shutdown(timeout_s=5.0)


@pytest.fixture(scope="module")
def client(tracing: Tracing) -> Iterator[TestClient]:
    """The service with one API key (tenant "team-a"), traced from outside."""
    settings = small_settings(api_keys=f"team-a={KEY}")
    app = create_app(settings, engine=ready_engine(settings), tracing=tracing)
    with TestClient(app, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60.0
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the app was not ready within 60 s"
            time.sleep(0.02)
        yield client


@pytest.fixture(autouse=True)
def no_spans_yet(tracing: Tracing, exported: InMemorySpanExporter) -> None:
    """A test reads the spans of its own requests only."""
    assert tracing.force_flush(timeout_s=5.0)
    exported.clear()


def flushed(tracing: Tracing, exported: InMemorySpanExporter) -> list[ReadableSpan]:
    assert tracing.force_flush(timeout_s=5.0)
    return list(exported.get_finished_spans())


def test_a_compute_request_is_one_server_span_with_its_phases(
    client: TestClient, tracing: Tracing, exported: InMemorySpanExporter
) -> None:
    response = client.post(
        "/v1/attention",
        json=SMALL,
        headers={"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE", "x-api-key": KEY},
    )
    assert response.status_code == 200, response.text
    server, *children = flushed(tracing, exported)
    assert server.name == "POST /v1/attention"
    assert server.kind is SpanKind.SERVER
    assert server.context is not None
    assert server.parent is not None
    assert server.context.trace_id == CALLER_TRACE
    assert server.parent.span_id == CALLER_SPAN
    assert dict(server.context.trace_state) == {"congo": "t61rcWkgMzE"}
    attributes = dict(server.attributes or {})
    assert attributes["http.route"] == "/v1/attention"
    assert attributes["http.response.status_code"] == 200
    assert attributes["sdpa.tenant"] == "team-a"
    assert attributes["sdpa.request_id"] == response.headers["x-request-id"]
    assert attributes["sdpa.batch_size"] == response.json()["meta"]["batch_size"]
    assert server.status.status_code is StatusCode.UNSET

    assert [child.name for child in children] == list(PHASE_NAMES)
    assert server.start_time is not None
    assert server.end_time is not None
    for child in children:
        assert child.parent is not None
        assert child.parent.span_id == server.context.span_id
        assert child.start_time is not None
        assert child.end_time is not None
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
    compute = children[PHASE_NAMES.index("compute")]
    assert compute.attributes is not None
    assert compute.attributes["sdpa.batch_size"] == attributes["sdpa.batch_size"]
    assert compute.attributes["sdpa.path"] == response.json()["meta"]["path"]
    # The children tile the request in order: read, decode, then the wait, then encode.
    starts = [child.start_time or 0 for child in children]
    assert starts == sorted(starts)


def test_a_refused_request_has_its_status_and_no_children(
    client: TestClient, tracing: Tracing, exported: InMemorySpanExporter
) -> None:
    assert client.post("/v1/attention", json=SMALL).status_code == 401  # no key
    assert (
        client.post("/v1/attention", json={"q": 1}, headers={"x-api-key": KEY}).status_code == 422
    )
    assert client.get("/nowhere", headers={"x-api-key": KEY}).status_code == 404
    unauthorized, invalid, unmatched = flushed(tracing, exported)
    # Refused before routing: still named by the route it was meant for.
    assert unauthorized.name == "POST /v1/attention"
    assert unauthorized.attributes is not None
    assert unauthorized.attributes["http.response.status_code"] == 401
    assert unauthorized.attributes["sdpa.tenant"] == "anonymous"
    assert invalid.attributes is not None
    assert invalid.attributes["http.response.status_code"] == 422
    assert invalid.attributes["sdpa.tenant"] == "team-a"
    assert unmatched.name == "GET"
    for span in (unauthorized, invalid, unmatched):
        assert span.status.status_code is StatusCode.UNSET  # the caller's error
        assert span.parent is None  # no traceparent: a trace of its own


def test_probes_and_the_metrics_scrape_are_not_traced(
    client: TestClient, tracing: Tracing, exported: InMemorySpanExporter
) -> None:
    headers = {"traceparent": TRACEPARENT, "x-api-key": KEY}  # /metrics is behind the key
    for path in ("/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"):
        assert client.get(path, headers=headers).status_code == 200, path
    assert flushed(tracing, exported) == []
    assert client.get("/v1/info", headers={"x-api-key": KEY}).status_code == 200
    (info,) = flushed(tracing, exported)
    assert info.name == "GET /v1/info"


def test_an_exception_that_escapes_is_a_500_error_with_its_class(
    tracing: Tracing, exported: InMemorySpanExporter
) -> None:
    # An app that fails as a bug of ours would: the server answers 500 (the error middleware
    # outside the app's own middlewares); the span sees the exception go by.
    async def failing(scope: Scope, receive: Receive, send: Send) -> None:
        raise KeyError("a bug")

    # Without `with`: no lifespan, which this app would fail too.
    edge = AccessLogMiddleware(failing, tracing=tracing)
    client = TestClient(edge, raise_server_exceptions=False)
    assert client.get("/v1/info", headers={"traceparent": TRACEPARENT}).status_code == 500
    (failed,) = flushed(tracing, exported)
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == "KeyError"
    assert failed.attributes["http.response.status_code"] == 500
    assert failed.context is not None
    assert failed.context.trace_id == CALLER_TRACE


def test_a_malformed_tracestate_is_left_out_and_never_reaches_the_log(
    client: TestClient,
    tracing: Tracing,
    exported: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """OpenTelemetry's propagator logs a warning quoting each tracestate member it refuses (a
    duplicate key, a malformed member): a caller's bytes in the log, per request. The service
    leaves such a tracestate out, whole, before the propagator sees it; the caller's trace
    (its valid traceparent) is still continued."""
    marker = "callerbytes"
    duplicates = ",".join(f"{marker}{i % 3}=v{i}" for i in range(30))  # duplicate keys
    malformed = f"{marker}=ok, {marker.upper()}=NOT A MEMBER"
    for tracestate in (duplicates, malformed):
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            headers = {"traceparent": TRACEPARENT, "tracestate": tracestate, "x-api-key": KEY}
            assert client.get("/v1/info", headers=headers).status_code == 200
            (span,) = flushed(tracing, exported)
            exported.clear()
        assert span.context is not None
        assert span.context.trace_id == CALLER_TRACE
        assert dict(span.context.trace_state) == {}
        assert not [r for r in caplog.records if marker in r.getMessage().lower()]


def test_the_trace_context_of_a_caller_the_key_check_refused_is_not_read(
    client: TestClient, tracing: Tracing, exported: InMemorySpanExporter
) -> None:
    """What the span records of a caller without a valid key comes after the key check: its
    refusal is traced, in a trace of its own, and nothing of its traceparent or tracestate."""
    headers = {"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"}
    assert client.get("/v1/info", headers={**headers, "x-api-key": "wrong"}).status_code == 401
    (refused,) = flushed(tracing, exported)
    assert refused.attributes is not None
    assert refused.attributes["http.response.status_code"] == 401
    assert refused.context is not None
    assert refused.context.trace_id != CALLER_TRACE
    assert refused.parent is None
    assert dict(refused.context.trace_state) == {}
