"""The recorder: one finished Exchange (service.serving.exchange) becomes the access-log line,
the request metrics and the server span, for every door alike.

- One record on logger "sdpa.access" whose `json_fields` attribute holds ts, request_id,
  method, route, status, tenant, latency_ms, batch_size, client (and grpc_status for a gRPC
  call); service.server's JSON formatter writes them as one JSON line. Never the body, the
  query string or any header value but the id: tensors and keys cannot reach the log.
- sdpa_requests_total{route,status,tenant} and sdpa_request_duration_seconds{route}, labelled
  by the route TEMPLATE ("/v1/attention", "grpc:ModelInfer"), so that label cardinality stays
  bounded. `status` is HTTP's, for a gRPC call the status the REST door would answer (499 for
  a call its client cancelled), so the rules and dashboards that read it count both doors
  alike.
- The server span (service.tracing), when tracing is on and the request is traced, built once
  the request is over (from its start): the caller's W3C trace context is read only when the
  key check did not refuse the caller (`Exchange.key_refused`), so nothing a caller without a
  key sent reaches the tracer; its phases become the span's children.

The edges (service.middleware.access_log for HTTP, the gRPC servicer) fill in the Exchange and
call `record` once the answer is sent; neither writes a log line, a metric or a span itself.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from service.metrics import Metrics
from service.serving.exchange import Exchange

if TYPE_CHECKING:
    from service.tracing import Tracing

ACCESS_LOGGER: Final = "sdpa.access"
# Status logged when the client went away before its answer reached it (nginx's convention).
CLIENT_CLOSED_STATUS: Final = 499
UNMATCHED_ROUTE: Final = "unmatched"

logger = logging.getLogger(ACCESS_LOGGER)
_tracing_logger = logging.getLogger("sdpa.tracing")


class Recorder:
    """Turns each finished Exchange into its log line, metrics and span."""

    def __init__(self, metrics: Metrics, tracing: Tracing | None = None) -> None:
        self.metrics = metrics
        self.tracing = tracing  # None: tracing off, no span

    def record(self, exchange: Exchange) -> None:
        """The log line, the metrics and the span of a request whose answer was sent (or that
        ended without one: 499 when its client left, 500 when an exception escaped)."""
        elapsed_s = time.monotonic() - exchange.started
        status = CLIENT_CLOSED_STATUS if exchange.status is None else exchange.status
        route = exchange.route or UNMATCHED_ROUTE
        metrics = self.metrics
        metrics.requests_total.labels(route=route, status=str(status), tenant=exchange.tenant).inc()
        metrics.request_duration_seconds.labels(route=route).observe(elapsed_s)
        fields: dict[str, Any] = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "request_id": exchange.request_id,
            "method": exchange.method if exchange.grpc_code is None else "POST",
            "route": route,
            "status": status,
        }
        if exchange.grpc_code is not None:
            fields["grpc_status"] = exchange.grpc_code[1]
        fields.update(
            tenant=exchange.tenant,
            latency_ms=round(elapsed_s * 1000.0, 3),
            batch_size=exchange.batch_size,
            client=exchange.client,
        )
        logger.info(
            "%s %s %s %.1fms",
            fields["method"],
            route,
            status if exchange.grpc_code is None else exchange.grpc_code[1],
            fields["latency_ms"],
            extra={"json_fields": fields},
        )
        if self.tracing is not None and exchange.traced:
            try:
                self._span(self.tracing, exchange, status, route)
            except Exception:  # a bug in tracing must not fail a request that was answered
                _tracing_logger.exception(
                    "tracing: the span of %s %s", exchange.method, exchange.route
                )

    def _span(self, tracing: Tracing, exchange: Exchange, status: int, route: str) -> None:
        # Only a caller the key check did not refuse has its trace context read.
        carrier = () if exchange.key_refused else exchange.trace_context
        if exchange.grpc_code is not None:
            span = tracing.start_grpc(
                exchange.method, carrier=carrier, client=exchange.client, started=exchange.started
            )
            status, route = exchange.grpc_code[0], UNMATCHED_ROUTE
        else:
            span = tracing.start_http(
                method=exchange.method,
                path=exchange.path,
                carrier=carrier,
                scheme=exchange.scheme,
                http_version=exchange.http_version,
                client=exchange.client,
                started=exchange.started,
            )
        span.end(
            status=status,
            route=None if route == UNMATCHED_ROUTE else route,
            tenant=exchange.tenant,
            request_id=exchange.request_id,
            batch_size=exchange.batch_size,
            phases=exchange.phases,
            error=exchange.error,
        )
