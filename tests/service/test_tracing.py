"""service.tracing against the real OpenTelemetry SDK: its spans read back from an
InMemorySpanExporter handed to Tracing (no patch), the times from a clock stepped by hand.

What the trace must say: a caller's traceparent continued (same trace id, the caller's span the
parent, its tracestate kept), one SERVER span per request with its attributes, a child for each
phase inside it at the instants the Phases record says, ERROR only for the server's failures;
and off, no Tracing at all.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode, get_tracer_provider

from service.serving.pipeline import Phases
from service.settings import Settings
from service.tracing import (
    PHASE_NAMES,
    Tracing,
    TracingConfigError,
    check_otlp_protocol,
    encode_otlp,
)
from tests.support.fake_clock import FakeClock

CALLER_TRACE = 0x0AF7651916CD43DD8448EB211C80319C
CALLER_SPAN = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"
# Epoch nanoseconds when the fake monotonic clock reads START.
START, WALL_AT_START = 1000.0, 1_700_000_000_000_000_000


class Clocks:
    """A monotonic clock stepped by hand and the wall clock that moves with it."""

    def __init__(self) -> None:
        self.monotonic = FakeClock(START)

    def wall_ns(self) -> int:
        return WALL_AT_START + round((self.monotonic() - START) * 1e9)

    def epoch_ns(self, instant: float) -> int:
        return WALL_AT_START + round((instant - START) * 1e9)


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(clocks: Clocks, exported: InMemorySpanExporter) -> Iterator[Tracing]:
    tracing = Tracing(exporters=[exported], clock=clocks.monotonic, wall_clock_ns=clocks.wall_ns)
    yield tracing
    tracing.shutdown(timeout_s=5.0)


def finished(tracing: Tracing, exported: InMemorySpanExporter) -> list[ReadableSpan]:
    assert tracing.force_flush(timeout_s=5.0)
    return list(exported.get_finished_spans())


def phases_from(start: float) -> Phases:
    """A request of 50 ms: read 2, decode 3, queue 10, (dispatch 5), compute 20, encode 10."""
    return Phases(
        started=start + 0.001,  # the route began 1 ms after the middleware
        received=start + 0.003,
        decoded=start + 0.006,
        computed=start + 0.041,
        encoded=start + 0.051,
        queue_ms=10.0,
        compute_ms=20.0,
        batch_size=3,
        path="fused",
        backend="math",
    )


def serve_one(tracing: Tracing, clocks: Clocks, **carrier: str) -> Phases:
    span = tracing.start_http(
        method="POST",
        path="/v1/attention",
        carrier=carrier,
        http_version="1.1",
        client="127.0.0.1",
    )
    phases = phases_from(clocks.monotonic())
    clocks.monotonic.advance(0.052)
    span.end(
        status=200,
        route="/v1/attention",
        tenant="team-a",
        request_id="req-1",
        batch_size=3,
        phases=phases,
    )
    return phases


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]
    return named


def test_the_server_span_continues_the_callers_traceparent(
    tracing: Tracing, clocks: Clocks, exported: InMemorySpanExporter
) -> None:
    serve_one(tracing, clocks, traceparent=TRACEPARENT, tracestate="vendor=abc,other=1")
    spans = by_name(finished(tracing, exported))
    server = spans["POST /v1/attention"]
    assert server.kind is SpanKind.SERVER
    assert server.context is not None
    assert server.parent is not None
    assert server.context.trace_id == CALLER_TRACE
    assert server.parent.span_id == CALLER_SPAN
    assert server.parent.is_remote
    assert server.context.span_id != CALLER_SPAN
    assert server.context.trace_flags.sampled
    assert dict(server.context.trace_state) == {"vendor": "abc", "other": "1"}
    assert server.status.status_code is StatusCode.UNSET
    assert dict(server.attributes or {}) == {
        "http.request.method": "POST",
        "url.path": "/v1/attention",
        "url.scheme": "http",
        "network.protocol.version": "1.1",
        "client.address": "127.0.0.1",
        "http.route": "/v1/attention",
        "http.response.status_code": 200,
        "sdpa.tenant": "team-a",
        "sdpa.request_id": "req-1",
        "sdpa.batch_size": 3,
    }
    # The resource names the service unless OTEL_SERVICE_NAME does.
    assert server.resource.attributes["service.name"] == "sdpa-service"


def test_each_phase_is_a_child_at_the_instants_its_phases_say(
    tracing: Tracing, clocks: Clocks, exported: InMemorySpanExporter
) -> None:
    request_start = clocks.monotonic()
    phases = serve_one(tracing, clocks, traceparent=TRACEPARENT)
    spans = finished(tracing, exported)
    assert [span.name for span in spans] == ["POST /v1/attention", *PHASE_NAMES]
    server, children = spans[0], by_name(spans[1:])
    assert server.context is not None
    assert server.start_time == clocks.epoch_ns(request_start)
    assert server.end_time == clocks.epoch_ns(request_start + 0.052)

    epoch = clocks.epoch_ns
    expected = {
        "read": (epoch(phases.started), epoch(phases.received)),
        "decode": (epoch(phases.received), epoch(phases.decoded)),
        "queue": (epoch(phases.decoded), epoch(phases.decoded) + 10_000_000),
        "compute": (epoch(phases.computed) - 20_000_000, epoch(phases.computed)),
        "encode": (epoch(phases.computed), epoch(phases.encoded)),
    }
    for name, (start, end) in expected.items():
        child = children[name]
        assert (child.start_time, child.end_time) == (start, end), name
        assert child.parent is not None
        assert child.context is not None
        assert child.parent.span_id == server.context.span_id, name
        assert not child.parent.is_remote
        assert child.context.trace_id == CALLER_TRACE, name
        assert child.kind is SpanKind.INTERNAL
        assert server.start_time is not None
        assert server.end_time is not None
        assert server.start_time <= start <= end <= server.end_time, name
    assert dict(children["compute"].attributes or {}) == {
        "sdpa.batch_size": 3,
        "sdpa.path": "fused",
        "sdpa.backend": "math",
    }
    assert not children["read"].attributes
    span_ids = {span.context.span_id for span in spans if span.context is not None}
    assert len(span_ids) == len(spans)


def test_a_phase_recorded_outside_the_request_is_drawn_inside_it(
    tracing: Tracing, clocks: Clocks, exported: InMemorySpanExporter
) -> None:
    start = clocks.monotonic()
    span = tracing.start_http(method="POST", path="/v1/attention")
    clocks.monotonic.advance(0.010)
    # Instants before the span began and after it ended (another clock's): clamped to it.
    late = Phases(
        started=start - 1.0, received=start - 0.5, decoded=start + 0.002, computed=start + 0.004,
        encoded=start + 5.0, queue_ms=50.0, compute_ms=50.0, batch_size=1, path=None,
        backend=None,
    )  # fmt: skip
    span.end(status=200, route="/v1/attention", phases=late)
    server, *children = finished(tracing, exported)
    assert server.start_time is not None
    assert server.end_time is not None
    for child in children:
        assert child.start_time is not None
        assert child.end_time is not None
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
    compute = by_name(children)["compute"]
    assert dict(compute.attributes or {}) == {"sdpa.batch_size": 1}


def test_without_a_traceparent_a_new_trace_begins(
    tracing: Tracing, clocks: Clocks, exported: InMemorySpanExporter
) -> None:
    serve_one(tracing, clocks)
    serve_one(tracing, clocks, traceparent="00-not-a-valid-traceparent-01")
    first, second = (s for s in finished(tracing, exported) if s.kind is SpanKind.SERVER)
    assert first.parent is None
    assert second.parent is None
    assert first.context is not None
    assert second.context is not None
    assert first.context.trace_id != second.context.trace_id


def test_a_caller_that_did_not_sample_its_trace_gets_no_span(
    tracing: Tracing, clocks: Clocks, exported: InMemorySpanExporter
) -> None:
    span = tracing.start_http(
        method="POST", path="/v1/attention", carrier={"traceparent": TRACEPARENT[:-2] + "00"}
    )
    assert not span.recording
    assert span.trace_id == f"{CALLER_TRACE:032x}"  # the context still travels
    span.end(status=200, route="/v1/attention", phases=phases_from(clocks.monotonic()))
    assert finished(tracing, exported) == []


def test_a_5xx_is_an_error_of_the_server_a_4xx_is_not(
    tracing: Tracing, exported: InMemorySpanExporter
) -> None:
    tracing.start_http(method="POST", path="/v1/attention").end(
        status=500, route="/v1/attention", error=ZeroDivisionError("no: a bug of ours")
    )
    tracing.start_http(method="GET", path="/readyz").end(status=503, route="/readyz")
    tracing.start_http(method="POST", path="/v1/attention").end(status=422, route="/v1/attention")
    tracing.start_http(method="POST", path="/nowhere").end(status=404, route=None)
    bug, not_ready, invalid, unmatched = finished(tracing, exported)

    assert bug.status.status_code is StatusCode.ERROR
    assert bug.status.description == "ZeroDivisionError"  # the class, never the message
    assert bug.attributes is not None
    assert bug.attributes["error.type"] == "ZeroDivisionError"
    assert not bug.events
    assert not_ready.status.status_code is StatusCode.ERROR
    assert not_ready.attributes is not None
    assert not_ready.attributes["error.type"] == "503"

    assert invalid.status.status_code is StatusCode.UNSET
    assert invalid.attributes is not None
    assert invalid.attributes["http.response.status_code"] == 422
    assert "error.type" not in invalid.attributes
    # No route matched: the span is named by the method alone, with no http.route.
    assert unmatched.name == "POST"
    assert unmatched.attributes is not None
    assert "http.route" not in unmatched.attributes


def test_a_grpc_call_continues_the_trace_in_its_metadata(
    tracing: Tracing, clocks: Clocks, exported: InMemorySpanExporter
) -> None:
    # gRPC's invocation metadata: (key, value) pairs, "-bin" keys with bytes values.
    metadata = (("x-api-key", "k"), ("traceparent", TRACEPARENT), ("trace-bin", b"\x00\x01"))
    span = tracing.start_grpc("ModelInfer", carrier=metadata, client="ipv4:127.0.0.1:5000")
    phases = phases_from(clocks.monotonic())
    clocks.monotonic.advance(0.06)
    span.end(status=0, tenant="team-b", request_id="grpc-1", batch_size=2, phases=phases)
    tracing.start_grpc("ModelInfer").end(status=3)  # INVALID_ARGUMENT: the caller's
    tracing.start_grpc("ModelInfer").end(status=13, error=RuntimeError("bug"))  # INTERNAL
    tracing.start_grpc("ModelInfer").end(status=4)  # DEADLINE_EXCEEDED
    spans = finished(tracing, exported)
    server = spans[0]
    assert server.name == "inference.GRPCInferenceService/ModelInfer"
    assert server.kind is SpanKind.SERVER
    assert server.context is not None
    assert server.parent is not None
    assert server.context.trace_id == CALLER_TRACE
    assert server.parent.span_id == CALLER_SPAN
    assert dict(server.attributes or {}) == {
        "rpc.system": "grpc",
        "rpc.service": "inference.GRPCInferenceService",
        "rpc.method": "ModelInfer",
        "client.address": "ipv4:127.0.0.1:5000",
        "rpc.grpc.status_code": 0,
        "sdpa.tenant": "team-b",
        "sdpa.request_id": "grpc-1",
        "sdpa.batch_size": 2,
    }
    assert [span.name for span in spans[1:6]] == list(PHASE_NAMES)
    invalid, internal, deadline = spans[6:]
    assert invalid.status.status_code is StatusCode.UNSET
    assert internal.status.status_code is StatusCode.ERROR
    assert internal.attributes is not None
    assert internal.attributes["error.type"] == "RuntimeError"
    assert deadline.status.status_code is StatusCode.ERROR
    assert deadline.attributes is not None
    assert deadline.attributes["error.type"] == "DEADLINE_EXCEEDED"


def test_a_span_ends_once(tracing: Tracing, exported: InMemorySpanExporter) -> None:
    span = tracing.start_http(method="GET", path="/v1/info")
    span.end(status=200, route="/v1/info")
    span.end(status=500, route="/v1/info", error=RuntimeError())
    (only,) = finished(tracing, exported)
    assert only.status.status_code is StatusCode.UNSET


def test_two_tracings_keep_their_spans_apart_and_leave_the_global_provider(
    tracing: Tracing, exported: InMemorySpanExporter
) -> None:
    global_provider = get_tracer_provider()
    other_exported = InMemorySpanExporter()
    other = Tracing(exporters=[other_exported], sampler=ALWAYS_ON)
    try:
        other.start_http(method="GET", path="/v1/info").end(status=200, route="/v1/info")
        assert finished(tracing, exported) == []
        assert [span.name for span in finished(other, other_exported)] == ["GET /v1/info"]
    finally:
        assert other.shutdown(timeout_s=5.0)
    assert get_tracer_provider() is global_provider


def test_after_shutdown_spans_are_dropped(exported: InMemorySpanExporter) -> None:
    tracing = Tracing(exporters=[exported])
    tracing.start_http(method="GET", path="/v1/info").end(status=200, route="/v1/info")
    assert tracing.shutdown(timeout_s=5.0)  # flushes what was ended before
    assert [span.name for span in exported.get_finished_spans()] == ["GET /v1/info"]
    tracing.start_http(method="GET", path="/v1/info").end(status=200, route="/v1/info")
    assert len(exported.get_finished_spans()) == 1
    assert tracing.shutdown(timeout_s=5.0)  # twice: harmless


def test_the_sampler_decides_at_the_start(clocks: Clocks, exported: InMemorySpanExporter) -> None:
    """OTEL_TRACES_SAMPLER's choice (here given): a dropped request builds and exports nothing;
    a ratio sampler keeps a trace by its id, the caller's included."""
    dropping = Tracing(exporters=[exported], sampler=ALWAYS_OFF)
    try:
        span = dropping.start_http(method="POST", path="/v1/attention")
        assert not span.recording
        span.end(status=200, route="/v1/attention", phases=phases_from(clocks.monotonic()))
        assert finished(dropping, exported) == []
    finally:
        dropping.shutdown(timeout_s=5.0)
    # A ratio of 1e-30 keeps only trace ids below 2^64 * 1e-30, i.e. 0: never the caller's.
    rare = Tracing(exporters=[exported], sampler=TraceIdRatioBased(1e-30))
    try:
        span = rare.start_http(method="GET", path="/v1/info", carrier={"traceparent": TRACEPARENT})
        assert not span.recording
        assert span.trace_id == f"{CALLER_TRACE:032x}"
    finally:
        rare.shutdown(timeout_s=5.0)


# ---- the OTLP encoding ------------------------------------------------------------------------


def test_encode_otlp_builds_the_message_the_sdks_encoder_builds(
    tracing: Tracing, clocks: Clocks, exported: InMemorySpanExporter
) -> None:
    """Every kind of span this service exports (remote and local parents, a root, tracestate,
    ERROR with a description, int, str, float and bool attributes), and spans of the SDK's own
    tracer beside them (another resource and scope, events, dropped attributes): the SDK's
    encoder is the truth."""
    serve_one(tracing, clocks, traceparent=TRACEPARENT, tracestate="vendor=abc")
    serve_one(tracing, clocks)
    tracing.start_grpc("ModelInfer").end(status=13, error=RuntimeError("bug"))
    ours = finished(tracing, exported)
    encoded = encode_otlp(ours)
    assert encoded is not None
    assert ExportTraceServiceRequest.FromString(encoded) == encode_spans(ours)

    provider = TracerProvider(
        resource=Resource({"service.name": "other", "list": ("a", "b"), "ratio": 0.5}),
        shutdown_on_exit=False,
    )
    try:
        tracer = provider.get_tracer("tests", "1.2", schema_url="https://example.test/s")
        with tracer.start_as_current_span("sdk", attributes={"flag": True, "x": 1.5}) as span:
            span.set_attribute("many", [1, 2, 3])
        assert isinstance(span, ReadableSpan)
        mixed = [*ours, span]
        assert encode_otlp(mixed) is not None
        assert ExportTraceServiceRequest.FromString(encode_otlp(mixed) or b"") == encode_spans(
            mixed
        )
        span_with_event = tracer.start_span("with an event")
        span_with_event.add_event("e")
        span_with_event.end()
        assert isinstance(span_with_event, ReadableSpan)
        assert encode_otlp([*ours, span_with_event]) is None  # the SDK's encoder does those
    finally:
        provider.shutdown()


# ---- from the settings ------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["none", "none,none"])
def test_off_there_is_no_tracing(setting: str) -> None:
    assert Tracing.from_settings(Settings(otel_traces_exporter=setting)) is None


def test_the_default_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert Settings().otel_traces_exporter == "none"
    assert Tracing.from_settings(Settings()) is None


def test_otlp_and_console_build_their_exporters(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing is sent: no span ends before shutdown.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "attention-east")
    tracing = Tracing.from_settings(
        Settings(otel_traces_exporter="otlp,console"),
        environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
    )
    assert tracing is not None
    try:
        otlp, console = (p.span_exporter for p in tracing._processors)
        assert isinstance(otlp, OTLPSpanExporter)
        assert isinstance(console, ConsoleSpanExporter)
        assert tracing._provider.resource.attributes["service.name"] == "attention-east"
    finally:
        assert tracing.shutdown(timeout_s=5.0)


def test_otel_sdk_disabled_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Tracing.from_settings(Settings(otel_traces_exporter="console")) is None


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": ""},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ),
    ],
)
def test_an_otlp_protocol_other_than_http_protobuf_fails_start_up(
    environ: dict[str, str], variable: str
) -> None:
    with pytest.raises(TracingConfigError, match=f"^{variable}=.*http/protobuf"):
        Tracing.from_settings(Settings(otel_traces_exporter="otlp"), environ=environ)


def test_the_traces_protocol_variable_wins_over_the_general_one() -> None:
    check_otlp_protocol(
        {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        }
    )
    check_otlp_protocol({})
