"""A real OTLP/HTTP trace receiver on a free loopback port, for end-to-end tests.

It does what a collector's otlp receiver does for traces over HTTP: accepts POST /v1/traces
with an application/x-protobuf body (gzip when Content-Encoding says so), decodes it as
opentelemetry.proto's ExportTraceServiceRequest, keeps every span with its resource, and
answers 200 with an empty ExportTraceServiceResponse. Anything else gets 404 or 415 and is
counted in `refused`.

    with OtlpReceiver() as receiver:
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 6, timeout_s=10)
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
MAX_BODY_BYTES = 64 << 20


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind)


def _attributes(pairs: Sequence[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver decoded it; ids in lower-case hex ("" for no parent)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 1 internal, 2 server
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # Status.StatusCode: 0 unset, 1 ok, 2 error
    status_message: str
    trace_state: str
    flags: int
    resource: dict[str, Any]
    scope: str


SPAN_KIND_INTERNAL, SPAN_KIND_SERVER = 1, 2
STATUS_UNSET, STATUS_ERROR = 0, 2


class OtlpReceiver:
    """POST /v1/traces on 127.0.0.1 (see the module). Start it with `with`, or start()/stop()."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.exports = 0  # requests accepted
        self.refused = 0  # requests answered 404 or 415
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )

    @property
    def url(self) -> str:
        """The base URL, for OTEL_EXPORTER_OTLP_ENDPOINT (the exporter appends /v1/traces)."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], *, timeout_s: float
    ) -> list[ReceivedSpan]:
        """The spans received, once `done(spans)` holds; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"after {timeout_s} s the receiver holds {len(self._spans)} spans: "
                        f"{[s.name for s in self._spans]}"
                    )
                self._changed.wait(left)
            return list(self._spans)

    def _receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes=_attributes(span.attributes),
                            status_code=span.status.code,
                            status_message=span.status.message,
                            trace_state=span.trace_state,
                            flags=span.flags,
                            resource=resource,
                            scope=scope_spans.scope.name,
                        )
                    )
        with self._changed:
            self._spans.extend(received)
            self.exports += 1
            self._changed.notify_all()

    def _refuse(self) -> None:
        with self._changed:
            self.refused += 1
            self._changed.notify_all()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if not 0 <= length <= MAX_BODY_BYTES:
                    self._answer(413, b"")
                    receiver._refuse()
                    return
                body = self.rfile.read(length)
                if self.path != TRACES_PATH:
                    self._answer(404, b"")
                    receiver._refuse()
                    return
                if self.headers.get("content-type", "").split(";")[0].strip() != PROTOBUF:
                    self._answer(415, b"")
                    receiver._refuse()
                    return
                if self.headers.get("content-encoding", "").strip() == "gzip":
                    body = gzip.decompress(body)
                receiver._receive(body)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", PROTOBUF)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the tests read what was received, not a log

        return Handler
