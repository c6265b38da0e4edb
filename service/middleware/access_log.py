"""The HTTP edge: a pure ASGI middleware, the outermost of ours. It makes each request's
Exchange (service.serving.exchange) and, once the answer is sent, hands it to the one recorder
(service.access_log: the access-log line, the metrics and the span, as for every door).

For every HTTP request it
- takes the caller's X-Request-ID when it is sane (1-128 visible ASCII characters) or makes a
  uuid4 hex one, puts it in the Exchange and echoes it in the response's X-Request-ID header;
- puts the Exchange in the request's scope (service.serving.exchange.attach): the rooms inside
  fill it in (the API key check, the in-flight bytes, the route and serving);
- keeps the status of the response it sends: 500 when an exception escaped before one, 499
  when the client went away before its answer reached it (the protocol layer's delivery);
- names the route by its TEMPLATE (scope["route"].path, set by the router; a mounted app's
  mount path), so that label cardinality stays bounded. A request refused before routing (401,
  413, 415, the in-flight 503) is labelled with the route it was refused at, found as the
  router would find it; only requests that match no route are labelled "unmatched".
- leaves the probes and the metrics scrape (service.routes.UNMETERED_PATHS) untraced: machine
  traffic every few seconds, with no caller's trace to join, which would bury the requests
  worth following.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.access_log import CLIENT_CLOSED_STATUS, UNMATCHED_ROUTE, Recorder
from service.metrics import Metrics
from service.protocol import DELIVERY_EXTENSION, Delivery
from service.routes import UNMETERED_PATHS, route_path
from service.serving.exchange import Exchange, attach

if TYPE_CHECKING:
    from service.tracing import Tracing

REQUEST_ID_HEADER = b"x-request-id"
# Visible ASCII only: safe to echo in a header and to write in a log line unescaped.
_SANE_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")
_TRACE_HEADERS = (b"traceparent", b"tracestate")


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
    """The HTTP edge: one Exchange per HTTP request, recorded once its answer is sent.

    `recorder`: the application's (AppState.recorder), the gRPC door's too; None makes one of
    `metrics` and `tracing` (a middleware alone, in a test)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        recorder: Recorder | None = None,
        metrics: Metrics | None = None,
        tracing: Tracing | None = None,
        included: Sequence[BaseRoute] = (),
    ) -> None:
        self.app = app
        if recorder is None:
            recorder = Recorder(metrics if metrics is not None else Metrics(), tracing)
        self.recorder = recorder
        self.included = tuple(included)  # the routes of the included routers (route_template)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        client = scope.get("client")
        headers = scope["headers"]
        exchange = Exchange(
            door="http",
            method=scope["method"],
            path=scope["path"],
            request_id=request_id_from(scope),
            started=time.monotonic(),
            client=client[0] if client else None,
            scheme=scope.get("scheme", "http"),
            http_version=scope.get("http_version"),
            # ASGI: header names in lower case.
            trace_context=[(n.decode("latin-1"), v) for n, v in headers if n in _TRACE_HEADERS],
            traced=route_path(scope) not in UNMETERED_PATHS,
        )
        attach(scope, exchange)
        encoded_id = exchange.request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = int(message["status"])
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
            if exchange.status is not None and not await _delivered(scope):
                exchange.status = CLIENT_CLOSED_STATUS  # it left while its answer was sent
        except BaseException as exc:
            # The server answers 500 if nothing was sent yet; log what the client will see.
            exchange.error = exc
            if exchange.status is None:
                exchange.status = 500
            raise
        finally:
            exchange.route = route_template(scope, self.included)
            self.recorder.record(exchange)
