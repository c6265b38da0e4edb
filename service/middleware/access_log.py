"""Structured access log and request metrics: a pure ASGI middleware, the outermost of ours.

For every HTTP request it
- takes the caller's X-Request-ID when it is sane (1-128 visible ASCII characters) or makes a
  uuid4 hex one, stores it in scope["state"]["request_id"] (routes read request.state.request_id)
  and echoes it in the response's X-Request-ID header;
- logs one record on logger "sdpa.access" whose `json_fields` attribute holds ts, request_id,
  method, route, status, latency_ms, batch_size, client (service.server's JSON formatter writes
  them as one JSON line). Never the body, the query string or any header value but the id:
  tensors and keys cannot reach the log;
- records sdpa_requests_total{route,status,tenant} (the tenant the auth middleware named)
  and sdpa_request_duration_seconds{route}, labelled
  by the route TEMPLATE (scope["route"].path, set by the router; a mounted app's mount path) so
  that label cardinality stays bounded. A request refused before routing (401, 413, 415, the
  in-flight 503) is labelled with the route it was refused at, found as the router would find
  it; only requests that match no route are labelled "unmatched".
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.metrics import Metrics
from service.protocol import DELIVERY_EXTENSION, Delivery
from service.tenants import ANONYMOUS

ACCESS_LOGGER = "sdpa.access"
REQUEST_ID_HEADER = b"x-request-id"
# Visible ASCII only: safe to echo in a header and to write in a log line unescaped.
_SANE_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")
# Status logged when the client went away before its answer reached it (nginx's convention).
CLIENT_CLOSED_STATUS = 499
UNMATCHED_ROUTE = "unmatched"

logger = logging.getLogger(ACCESS_LOGGER)


def request_id_from(scope: Scope) -> str:
    """The caller's X-Request-ID if it is sane, else a fresh uuid4 hex."""
    for name, value in scope.get("headers", ()):
        if name.lower() == REQUEST_ID_HEADER:
            if _SANE_REQUEST_ID.fullmatch(value):
                return str(value.decode("ascii"))
            break
    return uuid.uuid4().hex


def route_template(scope: Scope, included: Sequence[BaseRoute] = ()) -> str:
    """The matched route's path template ("/v1/attention"), the path of a mounted app
    ("/docs-assets"), or "unmatched".

    A request that never reached the router (a middleware refused it: 401, 413, 415, the
    in-flight 503) is matched against the app's own routes and `included`, the routes of the
    routers it included: FastAPI 0.165 wraps an included router in an object whose match names
    no route.
    """
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str) and path:
        return path
    # A Mount sets no route; it appends its own path to root_path (app_root_path keeps the
    # server's, e.g. behind a proxy) and names its app as the endpoint.
    root_path, app_root_path = scope.get("root_path", ""), scope.get("app_root_path")
    if "endpoint" in scope and isinstance(app_root_path, str) and isinstance(root_path, str):
        mount = root_path.removeprefix(app_root_path)
        if mount:
            return mount
    # A refused request never met the router: find the route that would have taken it as
    # Starlette's router does, the first whose path and method match (a path match under
    # another method is only partial: the router answers 405 itself).
    router = getattr(scope.get("app"), "router", None)
    own = [r for r in getattr(router, "routes", ()) if isinstance(r, Route | Mount)]
    for candidate in (*own, *included):
        if candidate.matches(scope)[0] is Match.FULL:
            path = getattr(candidate, "path", None)
            if isinstance(path, str) and path:
                return path
    return UNMATCHED_ROUTE


async def _delivered(scope: Scope) -> bool:
    """Whether the answer reached the client, where the server can tell (the guarded protocol
    of service.protocol); True elsewhere."""
    delivery: Delivery | None = scope.get("extensions", {}).get(DELIVERY_EXTENSION)
    return True if delivery is None else await delivery()


class AccessLogMiddleware:
    """One JSON access-log line and the request metrics per HTTP request."""

    def __init__(
        self, app: ASGIApp, *, metrics: Metrics, included: Sequence[BaseRoute] = ()
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.included = tuple(included)  # the routes of the included routers (route_template)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        start = time.perf_counter()
        request_id = request_id_from(scope)
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        status: int | None = None
        encoded_id = request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [
                    (name, value)
                    for name, value in message.get("headers", ())
                    if name.lower() != REQUEST_ID_HEADER
                ]
                headers.append((REQUEST_ID_HEADER, encoded_id))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
            if status is not None and not await _delivered(scope):
                status = CLIENT_CLOSED_STATUS  # it left while its answer was being sent
        except BaseException:
            # The server answers 500 if nothing was sent yet; log what the client will see.
            if status is None:
                status = 500
            raise
        finally:
            self._record(scope, state, request_id, status, time.perf_counter() - start)

    def _record(
        self,
        scope: Scope,
        state: dict[str, Any],
        request_id: str,
        status: int | None,
        elapsed_s: float,
    ) -> None:
        final_status = CLIENT_CLOSED_STATUS if status is None else status
        route = route_template(scope, self.included)
        tenant = state.get("tenant", ANONYMOUS)
        self.metrics.requests_total.labels(
            route=route, status=str(final_status), tenant=tenant
        ).inc()
        self.metrics.request_duration_seconds.labels(route=route).observe(elapsed_s)

        batch_size = state.get("batch_size")
        client = scope.get("client")
        fields: dict[str, Any] = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "request_id": request_id,
            "method": scope.get("method", ""),
            "route": route,
            "status": final_status,
            "tenant": tenant,
            "latency_ms": round(elapsed_s * 1000.0, 3),
            "batch_size": batch_size if isinstance(batch_size, int) else None,
            "client": client[0] if client else None,
        }
        logger.info(
            "%s %s %d %.1fms",
            fields["method"],
            route,
            final_status,
            fields["latency_ms"],
            extra={"json_fields": fields},
        )
