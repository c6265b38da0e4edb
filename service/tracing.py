"""OpenTelemetry traces: one server span per request, with a child span for each of its phases.

Off unless OTEL_TRACES_EXPORTER asks for it (Settings.otel_traces_exporter: "otlp", "console",
or a comma list of them; unset or "none" is off). Off, `Tracing.from_settings` returns None
before importing anything of OpenTelemetry: create_app installs no tracing middleware and the
gRPC door starts no span, so a request pays nothing, not even a test of a flag.

On, a `Tracing` owns its own TracerProvider (never the process's global one: two apps in one
process, as in the tests, keep their spans apart), one BatchSpanProcessor per exporter ("otlp":
OTLP/HTTP protobuf, the SDK's OTLPSpanExporter; "console": JSON lines on stdout),
`force_flush()`, which the lifespan calls on its way out to export what is left, and
`shutdown()`, both in bounded time.

Configuration: the standard variables only. Settings reads OTEL_TRACES_EXPORTER when
create_app() runs; the other OTEL_* variables are read by the OpenTelemetry SDK itself, at the
same moment (when from_settings builds the provider and exporter): OTEL_SERVICE_NAME (default
here "sdpa-service"), OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG
(default parentbased_always_on: a caller's sampled flag is obeyed), OTEL_EXPORTER_OTLP_ENDPOINT
(".../v1/traces" is appended) or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (used as is),
OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT, _COMPRESSION, _CERTIFICATE..., OTEL_BSP_SCHEDULE_DELAY,
OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_MAX_EXPORT_BATCH_SIZE, OTEL_SDK_DISABLED. The one exception
is the OTLP protocol: the HTTP exporter never looks at it, so this module reads
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL itself, at that same moment,
and refuses anything but "http/protobuf" (TracingConfigError: start-up fails and says so) rather
than send protobuf over HTTP to a collector that was told to expect gRPC.

The doors' API (the recorder, service.access_log, for both doors):

    tracing = Tracing.from_settings(settings)          # None when off: skip all of this
    span = tracing.start_http(method="POST", path="/v1/attention", carrier={"traceparent": ...})
    span = tracing.start_grpc("ModelInfer", carrier=context.invocation_metadata())
    ...                                                # serve the request
    span.end(status=200, route="/v1/attention", tenant="a", request_id="...", batch_size=3,
             phases=phases, error=None)                # once, whatever happened

- `carrier`: where the caller's W3C trace context is: HTTP headers or gRPC metadata, as a
  Mapping[str, str] or an iterable of (key, value) pairs (values str or bytes; keys compared
  lower-cased). A `traceparent` there continues the caller's trace (same trace id, the caller's
  span the parent), with its `tracestate`; none starts a new trace. Only W3C Trace Context is
  read (not the process's global propagators, which OTEL_PROPAGATORS would choose at import).
- The span is SpanKind.SERVER, named "POST /v1/attention" (HTTP: method and route template,
  known at end(); the method alone when no route matched) or
  "inference.GRPCInferenceService/ModelInfer" (gRPC: OpenTelemetry's RPC convention). Its
  attributes: http.request.method, url.path, url.scheme, network.protocol.version,
  client.address, http.route and http.response.status_code (HTTP); rpc.system, rpc.service,
  rpc.method and rpc.grpc.status_code (gRPC); and sdpa.tenant, sdpa.request_id,
  sdpa.batch_size.
- `status` in end(): the HTTP status code, or the gRPC status code's number
  (grpc.StatusCode.X.value[0]). Status ERROR, with error.type, for HTTP 5xx and for the gRPC
  codes OpenTelemetry counts as a server's errors (UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED,
  INTERNAL, UNAVAILABLE, DATA_LOSS); a 4xx (INVALID_ARGUMENT, ...) is the caller's error and
  leaves the server span's status unset, as the semantic conventions say. error.type is the
  exception's class when one escaped (never its message: it could quote a request), else the
  status.
- `phases` (service.serving.pipeline.Phases, time.monotonic() instants) become five children,
  read, decode, queue, compute (sdpa.path, sdpa.backend, sdpa.batch_size: the batch it ran in)
  and encode, placed in time after the fact: queue from `decoded` for queue_ms, compute ending
  at `computed` after compute_ms. Monotonic instants become epoch nanoseconds by one offset per
  request, taken when its span starts; a phase is never drawn outside its request.
- Nothing is made current (no context is attached): the service calls nothing downstream that
  would read it, and the event loop's tasks stay free of it.

Cost, when on (measured on this project's shared 2-core machine, bench/tracing.py): the
SDK's way, a Tracer's span per span and its OTLP encoder, cost some 320 µs of CPU per request
(about 50 µs to start and end each span, 35-110 µs to encode each), a third of a small request's
whole server time. So, keeping the SDK's sampler, ids, resource, BatchSpanProcessor and OTLP/HTTP
client:
- a request's six spans are built once it is over, as the finished spans (ReadableSpan) the
  processors take, after one sampling decision by the provider's sampler at its start (so
  OTEL_TRACES_SAMPLER and a caller's sampled flag still decide); an unsampled request builds
  nothing. OTEL_SDK_DISABLED=true is off, as if OTEL_TRACES_EXPORTER were none.
- the "otlp" exporter is the SDK's OTLPSpanExporter (its endpoint, headers, TLS, compression,
  timeout and retries from the OTEL_EXPORTER_OTLP_* variables) encoding each batch with
  `encode_otlp`, which fills opentelemetry.proto's ExportTraceServiceRequest in place instead of
  building and copying a message per field: the same message (a test compares it with the SDK's
  encoder), about 4x faster. A batch it does not cover (span events or links, which this
  service never makes) takes the SDK's own export.
The span limits (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT...) do not apply: a request's attributes are
the dozen above, of bounded size.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # the SDK is imported when tracing starts, never by importing this module
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import SpanContext

    from service.serving.pipeline import Phases
    from service.settings import Settings

Carrier = Mapping[str, str] | Iterable[tuple[str, str | bytes]]
AttributeValue = str | bool | int | float

DEFAULT_SERVICE_NAME: Final = "sdpa-service"
GRPC_SERVICE: Final = "inference.GRPCInferenceService"
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
# The children of a request's span, in order: Server-Timing's phases but dispatch (the device
# thread's hop, the rest of the wait: a gap between queue and compute in the trace).
PHASE_NAMES: Final = ("read", "decode", "queue", "compute", "encode")
DEFAULT_FLUSH_S: Final = 5.0
# OTLP over HTTP is all this service exports (opentelemetry-exporter-otlp-proto-http).
SUPPORTED_OTLP_PROTOCOL: Final = "http/protobuf"
_PROTOCOL_VARIABLES: Final = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# The SDK names a service it was not told the name of "unknown_service:<executable>".
_UNKNOWN_SERVICE: Final = "unknown_service"
_SCOPE: Final = "service.tracing"

# The gRPC status codes by number, and those a server span reports as its errors
# (OpenTelemetry's semantic conventions for gRPC).
GRPC_CODE_NAMES: Final = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip
GRPC_SERVER_ERRORS: Final = frozenset({2, 4, 12, 13, 14, 15})


class TracingConfigError(ValueError):
    """The OTEL_* variables ask for something this service cannot do: start-up fails."""


def _exporter_names(setting: str) -> list[str]:
    """The exporters named in "otlp,console"; "none" entries and repeats left out."""
    names: list[str] = []
    for name in setting.split(","):
        name = name.strip().lower()
        if name and name != "none" and name not in names:
            names.append(name)
    return names


def check_otlp_protocol(environ: Mapping[str, str]) -> None:
    """Refuse an OTLP protocol other than http/protobuf (TracingConfigError)."""
    for variable in _PROTOCOL_VARIABLES:
        value = environ.get(variable, "").strip()
        if not value:
            continue  # the traces' own variable wins when set, else the general one
        if value != SUPPORTED_OTLP_PROTOCOL:
            raise TracingConfigError(
                f"{variable}={value!r}: sdpa-service exports traces over OTLP/HTTP only; set it "
                f"to {SUPPORTED_OTLP_PROTOCOL!r} (or leave it unset) and point "
                "OTEL_EXPORTER_OTLP_ENDPOINT at the collector's OTLP/HTTP port (4318 by default)"
            )
        return


def _bounded(work: Callable[[], object], timeout_s: float) -> bool:
    """Run `work` on a daemon thread; True if it finished within timeout_s. The SDK's flush
    ignores its own timeout (an export blocks for as long as the exporter retries)."""
    thread = threading.Thread(target=work, name="sdpa-tracing-flush", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


class Tracing:
    """The service's tracer: its own provider, processors and exporters (see the module)."""

    def __init__(
        self,
        *,
        exporters: Sequence[SpanExporter],
        sampler: Sampler | None = None,
        resource: Resource | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        """Args:
        exporters: opentelemetry.sdk.trace.export.SpanExporter instances, each behind a
            BatchSpanProcessor of its own (tests: an InMemorySpanExporter).
        sampler: an opentelemetry.sdk.trace.sampling.Sampler; None: the SDK's choice from
            OTEL_TRACES_SAMPLER (default parentbased_always_on).
        resource: an opentelemetry.sdk.resources.Resource; None: the SDK's from
            OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, named "sdpa-service" unless they
            name it, with service.version.
        clock: monotonic seconds, the clock of the phases' instants (time.monotonic).
        wall_clock_ns: epoch nanoseconds, what spans are stamped in (time.time_ns).
        """
        from opentelemetry.context import Context
        from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import Decision
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import (
            NoOpTracer,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            get_current_span,
        )
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from service.version import VERSION

        self._provider = TracerProvider(
            sampler=sampler,
            resource=resource if resource is not None else _service_resource(VERSION),
            # The lifespan flushes it (bounded); an atexit hook would keep every provider, and
            # its app's spans, alive until the process ends.
            shutdown_on_exit=False,
        )
        self._processors = [BatchSpanProcessor(exporter) for exporter in exporters]
        for processor in self._processors:
            self._provider.add_span_processor(processor)
        # OTEL_SDK_DISABLED=true: the provider hands out no-op tracers.
        self.enabled = not isinstance(self._provider.get_tracer(_SCOPE, VERSION), NoOpTracer)
        self._sampler = self._provider.sampler
        self._ids = self._provider.id_generator
        self._resource = self._provider.resource
        self._scope = InstrumentationScope(_SCOPE, VERSION)
        self._propagator = TraceContextTextMapPropagator()
        self._no_context = Context()
        self._clock = clock
        self._wall_clock_ns = wall_clock_ns
        # The SDK's names, bound once here so that importing this module imports none of them.
        self._readable_span = ReadableSpan
        self._span_context = SpanContext
        self._parent_of = get_current_span
        self._server_kind = SpanKind.SERVER
        self._status = Status
        self._unset = Status(StatusCode.UNSET)
        self._error_code = StatusCode.ERROR
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        # W3C Trace Context level 2's random-trace-id flag, where the API has it (1.3x: not).
        self._random_flag = int(getattr(TraceFlags, "RANDOM_TRACE_ID", 0))
        self._trace_flags = TraceFlags
        self._record_and_sample = Decision.RECORD_AND_SAMPLE

    @classmethod
    def from_settings(
        cls, settings: Settings, *, environ: Mapping[str, str] | None = None
    ) -> Tracing | None:
        """The service's tracing, or None when OTEL_TRACES_EXPORTER leaves it off (or
        OTEL_SDK_DISABLED=true).

        Args:
            settings: the service's (settings.otel_traces_exporter).
            environ: where the OTLP protocol variables are read (os.environ; see the
                module): the one check the HTTP exporter does not make.

        Raises:
            TracingConfigError: an OTLP protocol other than http/protobuf.
        """
        names = _exporter_names(settings.otel_traces_exporter)
        if not names:
            return None  # before any import of OpenTelemetry: off costs nothing
        exporters: list[SpanExporter] = []
        for name in names:
            if name == "otlp":
                check_otlp_protocol(os.environ if environ is None else environ)
                exporters.append(otlp_span_exporter())
            elif name == "console":
                from opentelemetry.sdk.trace.export import ConsoleSpanExporter

                exporters.append(ConsoleSpanExporter())
            else:  # Settings' pattern admits no other name
                raise TracingConfigError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}")
        tracing = cls(exporters=exporters)
        if not tracing.enabled:
            tracing.shutdown(timeout_s=1.0)
            return None
        return tracing

    # ---- a request's span -------------------------------------------------------------------

    def start_http(
        self,
        *,
        method: str,
        path: str,
        carrier: Carrier = (),
        scheme: str = "http",
        http_version: str | None = None,
        client: str | None = None,
        started: float | None = None,
    ) -> ServerSpan:
        """The server span of one HTTP request, started now, or at `started` (a
        time.monotonic() instant: the recorder builds a finished request's span after the fact)
        (see the module)."""
        attributes: dict[str, AttributeValue] = {
            "http.request.method": method,
            "url.path": path,
            "url.scheme": scheme,
        }
        if http_version is not None:
            attributes["network.protocol.version"] = http_version
        if client is not None:
            attributes["client.address"] = client
        return self._start(method, carrier, attributes, grpc=False, started=started)

    def start_grpc(
        self,
        method: str,
        *,
        carrier: Carrier = (),
        service: str = GRPC_SERVICE,
        client: str | None = None,
        started: float | None = None,
    ) -> ServerSpan:
        """The server span of one gRPC call of `service`'s `method` ("ModelInfer"), started
        now; `carrier`: the call's invocation metadata (see the module)."""
        attributes: dict[str, AttributeValue] = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": method,
        }
        if client is not None:
            attributes["client.address"] = client
        return self._start(f"{service}/{method}", carrier, attributes, grpc=True, started=started)

    def _start(
        self,
        name: str,
        carrier: Carrier,
        attributes: dict[str, AttributeValue],
        *,
        grpc: bool,
        started: float | None = None,
    ) -> ServerSpan:
        now = self._clock()
        wall_ns = self._wall_clock_ns()
        offset_ns = wall_ns - round(now * 1e9)
        if started is not None and started < now:
            wall_ns = offset_ns + round(started * 1e9)
        headers = _trace_context(carrier)
        # No trace context (most requests): a root span, without the propagator's work.
        caller = self._propagator.extract(headers) if headers else self._no_context
        parent: SpanContext | None = self._parent_of(caller).get_span_context()
        if parent is not None and not parent.is_valid:
            parent = None
        # What the SDK's tracer decides for a span it starts (its trace id, sampler, flags).
        if parent is None:
            trace_id = self._ids.generate_trace_id()
            random_id = bool(getattr(self._ids, "is_trace_id_random", bool)())
        else:
            trace_id = parent.trace_id
            random_id = bool(parent.trace_flags & self._random_flag)
        decision = self._sampler.should_sample(
            caller, trace_id, name, self._server_kind, attributes
        )
        context = None
        if decision.decision is self._record_and_sample:
            flags = self._sampled
            if random_id and self._random_flag:
                flags = self._trace_flags(flags | self._random_flag)
            context = self._span_context(
                trace_id, self._ids.generate_span_id(), False, flags, decision.trace_state
            )
            if decision.attributes:
                attributes.update(decision.attributes)
        return ServerSpan(
            self,
            name=name,
            trace_id=trace_id,
            context=context,
            parent=parent,
            attributes=attributes,
            offset_ns=offset_ns,
            start_ns=wall_ns,
            grpc=grpc,
        )

    # ---- after the fact -----------------------------------------------------------------------

    def _finish(
        self,
        span: ServerSpan,
        context: SpanContext,
        *,
        name: str,
        error_type: str | None,
        phases: Phases | None,
    ) -> None:
        """The request's span and its phases' children, finished, to every processor."""
        start_ns = span._start_ns
        end_ns = max(span._offset_ns + round(self._clock() * 1e9), start_ns)
        status = self._unset if error_type is None else self._status(self._error_code, error_type)
        finished = [
            self._readable_span(
                name,
                context=context,
                parent=span._parent,
                resource=self._resource,
                attributes=span._attributes,
                kind=self._server_kind,
                status=status,
                start_time=start_ns,
                end_time=end_ns,
                instrumentation_scope=self._scope,
            )
        ]
        if phases is not None:
            finished += self._children(context, phases, span._offset_ns, start_ns, end_ns)
        for processor in self._processors:
            for one in finished:
                processor.on_end(one)

    def _children(
        self, parent: SpanContext, phases: Phases, offset_ns: int, start_ns: int, end_ns: int
    ) -> list[ReadableSpan]:
        """The five phases of a request, as children of its span `parent`."""

        def epoch(instant: float) -> int:  # a monotonic instant, inside the parent's time
            return min(max(offset_ns + round(instant * 1e9), start_ns), end_ns)

        decoded, computed = epoch(phases.decoded), epoch(phases.computed)
        queue_end = min(decoded + round(phases.queue_ms * 1e6), computed)
        compute_start = max(computed - round(phases.compute_ms * 1e6), decoded)
        compute_attributes: dict[str, AttributeValue] = {"sdpa.batch_size": phases.batch_size}
        if phases.path is not None:
            compute_attributes["sdpa.path"] = phases.path
        if phases.backend is not None:
            compute_attributes["sdpa.backend"] = phases.backend
        times = (
            ("read", epoch(phases.started), epoch(phases.received), None),
            ("decode", epoch(phases.received), decoded, None),
            ("queue", decoded, queue_end, None),
            ("compute", compute_start, computed, compute_attributes),
            ("encode", computed, epoch(phases.encoded), None),
        )
        trace_id, flags, state = parent.trace_id, parent.trace_flags, parent.trace_state
        return [
            self._readable_span(
                name,
                context=self._span_context(
                    trace_id, self._ids.generate_span_id(), False, flags, state
                ),
                parent=parent,
                resource=self._resource,
                attributes=attributes,
                status=self._unset,
                start_time=start,
                end_time=end,
                instrumentation_scope=self._scope,
            )
            for name, start, end, attributes in times
        ]

    # ---- the lifespan's end ------------------------------------------------------------------

    def force_flush(self, *, timeout_s: float = DEFAULT_FLUSH_S) -> bool:
        """Export every finished span now; True if that ended within timeout_s."""
        return _bounded(self._provider.force_flush, timeout_s)

    def shutdown(self, *, timeout_s: float = DEFAULT_FLUSH_S) -> bool:
        """Export what is left and stop the exporters' threads, waiting at most timeout_s
        (an unreachable collector is given up on, the rest of its spans dropped); True if it
        all ended in time. Spans ended later are dropped. Idempotent."""
        return _bounded(self._provider.shutdown, timeout_s)


class ServerSpan:
    """One request's server span: started by Tracing.start_http/start_grpc, ended once by
    end() with what the request came to. Nothing is built before end(), and nothing at all
    for a request the sampler dropped."""

    __slots__ = (
        "_attributes", "_context", "_ended", "_grpc", "_name", "_offset_ns", "_parent",
        "_start_ns", "_trace_id", "_tracing",
    )  # fmt: skip

    def __init__(
        self,
        tracing: Tracing,
        *,
        name: str,
        trace_id: int,
        context: SpanContext | None,
        parent: SpanContext | None,
        attributes: dict[str, AttributeValue],
        offset_ns: int,
        start_ns: int,
        grpc: bool,
    ) -> None:
        self._tracing = tracing
        self._name = name
        self._trace_id = trace_id
        self._context = context  # None: not sampled
        self._parent = parent
        self._attributes = attributes
        self._offset_ns = offset_ns
        self._start_ns = start_ns
        self._grpc = grpc
        self._ended = False

    @property
    def recording(self) -> bool:
        """Whether the span will be exported (False when the sampler dropped it)."""
        return self._context is not None

    @property
    def trace_id(self) -> str:
        """The trace's id, 32 hex digits (the caller's when it sent a traceparent)."""
        return f"{self._trace_id:032x}"

    def end(
        self,
        *,
        status: int,
        route: str | None = None,
        tenant: str | None = None,
        request_id: str | None = None,
        batch_size: int | None = None,
        phases: Phases | None = None,
        error: BaseException | None = None,
    ) -> None:
        """End the span now with what the request came to (see the module). A second call
        does nothing.

        Args:
            status: the HTTP status code, or the gRPC status code's number.
            route: HTTP only: the route template that served it ("/v1/attention"); names the
                span. None when no route matched.
            tenant, request_id, batch_size: as the access log has them.
            phases: where its time went; None (a request refused before compute) adds no
                children.
            error: the exception that escaped the request, if one did.
        """
        if self._ended:
            return
        self._ended = True
        context = self._context
        if context is None:
            return  # not sampled: nothing is exported, nothing to build
        attributes = self._attributes
        name = self._name
        if self._grpc:
            attributes["rpc.grpc.status_code"] = status
            failed = status in GRPC_SERVER_ERRORS
        else:
            attributes["http.response.status_code"] = status
            failed = status >= 500
            if route is not None:
                attributes["http.route"] = route
                name = f"{name} {route}"
        if tenant is not None:
            attributes["sdpa.tenant"] = tenant
        if request_id is not None:
            attributes["sdpa.request_id"] = request_id
        if batch_size is not None:
            attributes["sdpa.batch_size"] = batch_size
        error_type = None
        if failed:
            error_type = (
                type(error).__qualname__ if error is not None else self._status_name(status)
            )
            attributes["error.type"] = error_type
        self._tracing._finish(self, context, name=name, error_type=error_type, phases=phases)

    def _status_name(self, status: int) -> str:
        if self._grpc and 0 <= status < len(GRPC_CODE_NAMES):
            return GRPC_CODE_NAMES[status]
        return str(status)


def _trace_context(carrier: Carrier) -> dict[str, str]:
    """The W3C trace context headers of `carrier`, keys lower-cased; a tracestate that is not
    valid W3C Trace Context left out (see _valid_tracestate)."""
    found: dict[str, str] = {}
    pairs = carrier.items() if isinstance(carrier, Mapping) else carrier
    for key, value in pairs:
        key = key.lower()
        if key in (TRACEPARENT, TRACESTATE):
            found[key] = value.decode("latin-1") if isinstance(value, bytes) else value
    tracestate = found.get(TRACESTATE)
    if tracestate is not None and not _valid_tracestate(tracestate):
        del found[TRACESTATE]
    return found


# W3C Trace Context's tracestate (https://www.w3.org/TR/trace-context/#tracestate-header):
# at most 32 list members of key=value, 512 characters in all, keys unique.
_TRACESTATE_MAX_CHARS: Final = 512
_TRACESTATE_MAX_MEMBERS: Final = 32
_TRACESTATE_MEMBER: Final = re.compile(
    r"([a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)


def _valid_tracestate(value: str) -> bool:
    """Whether a tracestate is valid W3C Trace Context. OpenTelemetry's propagator (1.45) logs
    a warning quoting each member it refuses (a malformed member, a duplicate key): 8 KB of a
    caller's bytes in the log per request. An invalid one is left out here, whole, as the
    propagator would leave it out, before the propagator sees it."""
    if len(value) > _TRACESTATE_MAX_CHARS:
        return False
    keys: set[str] = set()
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        match = _TRACESTATE_MEMBER.fullmatch(member)
        if match is None or match[1] in keys:
            return False
        keys.add(match[1])
    return len(keys) <= _TRACESTATE_MAX_MEMBERS


def _service_resource(version: str) -> Resource:
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), named sdpa-service
    unless those name it, with our version unless they give one."""
    from opentelemetry.sdk.resources import Resource

    detected = Resource.create()
    attributes = dict(detected.attributes)
    if str(attributes.get("service.name", "")).startswith(_UNKNOWN_SERVICE):
        attributes["service.name"] = DEFAULT_SERVICE_NAME
    attributes.setdefault("service.version", version)
    return Resource(attributes, detected.schema_url)


# ---- OTLP ---------------------------------------------------------------------------------------


def encode_otlp(spans: Sequence[ReadableSpan]) -> bytes | None:
    """`spans` as the body of an OTLP/HTTP export: a serialized ExportTraceServiceRequest, the
    same message the SDK's encoder builds (spans grouped by resource, then scope, in order of
    appearance), filled in place. None when a span has events or links (left to the SDK's)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    by_resource: dict[int, Any] = {}
    by_scope: dict[tuple[int, int], Any] = {}
    for span in spans:
        if span.events or span.links:
            return None
        resource, scope = span.resource, span.instrumentation_scope
        # By identity: every span of a Tracing shares its resource and scope objects (the
        # SDK's encoder groups by equality, hashing each span's resource to JSON on the way).
        key = (id(resource), id(scope))
        scope_spans = by_scope.get(key)
        if scope_spans is None:
            resource_spans = by_resource.get(id(resource))
            if resource_spans is None:
                resource_spans = by_resource[id(resource)] = request.resource_spans.add()
                _put_attributes(resource_spans.resource.attributes, resource.attributes)
                if resource.schema_url:
                    resource_spans.schema_url = resource.schema_url
            scope_spans = by_scope[key] = resource_spans.scope_spans.add()
            _put_scope(scope_spans, scope)
        _put_span(scope_spans.spans.add(), span)
    return bytes(request.SerializePartialToString())


# opentelemetry.trace.SpanKind's values (0 internal ... 4 consumer) + 1: the proto's enum.
_KIND_OFFSET: Final = 1
# Span.flags: the parent's remoteness is known (0x100), and it was remote (0x200).
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200


def _put_span(out: Any, span: ReadableSpan) -> None:
    context, parent = span.context, span.parent
    if context is not None:
        out.trace_id = context.trace_id.to_bytes(16, "big")
        out.span_id = context.span_id.to_bytes(8, "big")
        if context.trace_state:
            out.trace_state = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
    if parent is not None:
        out.parent_span_id = parent.span_id.to_bytes(8, "big")
    out.name = span.name
    out.kind = span.kind.value + _KIND_OFFSET
    if span.start_time is not None:
        out.start_time_unix_nano = span.start_time
    if span.end_time is not None:
        out.end_time_unix_nano = span.end_time
    if span.attributes:
        _put_attributes(out.attributes, span.attributes)
    if span.dropped_attributes:
        out.dropped_attributes_count = span.dropped_attributes
    status = span.status
    out.status.code = status.status_code.value  # present even when unset, as the SDK's
    if status.description:
        out.status.message = status.description
    out.flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)


def _put_scope(out: Any, scope: Any) -> None:
    if scope is None:
        out.scope.SetInParent()
        return
    out.scope.name = scope.name
    if scope.version:
        out.scope.version = scope.version
    if scope.attributes:
        _put_attributes(out.scope.attributes, scope.attributes)
    if scope.schema_url:
        out.schema_url = scope.schema_url


def _put_attributes(out: Any, attributes: Mapping[str, Any]) -> None:
    for key, value in attributes.items():
        pair = out.add()
        pair.key = key
        _put_value(pair.value, value)


def _put_value(out: Any, value: Any) -> None:
    """One AnyValue, as the SDK's encoder writes each type (bool before int: a bool is one)."""
    kind = type(value)
    if kind is str:  # the common cases first, by type alone
        out.string_value = value
    elif kind is int:
        out.int_value = value
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    elif isinstance(value, bytes):
        out.bytes_value = value
    elif value is None:
        out.SetInParent()
    elif isinstance(value, Mapping):
        out.kvlist_value.SetInParent()
        _put_attributes(out.kvlist_value.values, value)
    elif isinstance(value, Sequence):
        out.array_value.SetInParent()
        for item in value:
            _put_value(out.array_value.values.add(), item)
    else:
        raise TypeError(f"an attribute of type {type(value).__name__} has no OTLP encoding")


def otlp_span_exporter() -> SpanExporter:
    """The SDK's OTLP/HTTP span exporter (configured by its OTEL_EXPORTER_OTLP_* variables),
    encoding with encode_otlp. Its HTTP client (retries, compression, TLS) sends the bytes;
    where this SDK version has none that takes them (before 1.45), or a batch is one
    encode_otlp leaves, the SDK's export runs as is."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    class FastOTLPSpanExporter(OTLPSpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            send: Callable[[bytes], Any] | None = getattr(
                getattr(self, "_client", None), "export", None
            )
            if send is None or self._shutdown:
                return super().export(spans)
            try:
                data = encode_otlp(spans)
            except Exception:  # an attribute of no OTLP type: the SDK's export says so
                data = None
            if data is None:
                return super().export(spans)
            result = send(data)
            if getattr(result, "success", False):
                return SpanExportResult.SUCCESS
            return SpanExportResult.FAILURE

    return FastOTLPSpanExporter()
