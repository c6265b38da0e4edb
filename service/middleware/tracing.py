"""OpenTelemetry server spans for HTTP requests: a pure ASGI middleware, the outermost of ours.

create_app installs it only when tracing is on (service.tracing.Tracing.from_settings returned
one): off, no request meets it. For every HTTP request but the probes and the metrics scrape
(service.routes.UNMETERED_PATHS: machine traffic every few seconds, with no caller's trace to
join, which would bury the requests worth following) it
- starts the request's server span before anything else runs, continuing the caller's W3C
  trace context (traceparent, tracestate) when the request carries one;
- keeps the status of the response it sends (http.response.start); an exception that escapes
  before one is sent is a 500 (what the server answers), and its class the span's error.type;
  a request that ends with no response sent (the client left) is 499, as the access log has it;
- ends the span once the app is done with the request, with what the inner middlewares and the
  route left in scope["state"] (service.routes' keys): the tenant (the API key check), the
  request id (the access log), the batch size and the phases (a compute route), whose phases
  become the span's children.

Outermost, so that the span holds all of the server's time on the request, the refusals of
every other middleware included (401, 413, 415, the in-flight 503), and sees the state the
others fill in: they share scope["state"], one dict, with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.middleware.access_log import CLIENT_CLOSED_STATUS, UNMATCHED_ROUTE, route_template
from service.routes import BATCH_SIZE, PHASES, REQUEST_ID, TENANT, UNMETERED_PATHS
from service.tenants import ANONYMOUS

if TYPE_CHECKING:
    from service.tracing import ServerSpan, Tracing

logger = logging.getLogger("sdpa.tracing")

_TRACEPARENT = b"traceparent"
_TRACESTATE = b"tracestate"


class TracingMiddleware:
    """One server span per HTTP request but those to `untraced_paths` (see the module)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tracing: Tracing,
        untraced_paths: frozenset[str] = UNMETERED_PATHS,
        included: Sequence[BaseRoute] = (),
    ) -> None:
        """Args:
        tracing: the app's (AppState.tracing).
        untraced_paths: matched exactly against the request's path.
        included: the routes of the app's included routers, to name a request refused before
            routing by the route it was meant for (access_log.route_template).
        """
        self.app = app
        self.tracing = tracing
        self.untraced_paths = untraced_paths
        self.included = tuple(included)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.untraced_paths:
            await self.app(scope, receive, send)
            return

        carrier: list[tuple[str, bytes]] = []
        for name, value in scope["headers"]:  # ASGI: names lower-case
            if name in (_TRACEPARENT, _TRACESTATE):
                carrier.append((name.decode("latin-1"), value))
        client = scope.get("client")
        span = self.tracing.start_http(
            method=scope["method"],
            path=scope["path"],
            carrier=carrier,
            scheme=scope.get("scheme", "http"),
            http_version=scope.get("http_version"),
            client=client[0] if client else None,
        )
        # The inner middlewares and the route add to this same dict (request.state).
        state: dict[str, Any] = scope.setdefault("state", {})
        status: int | None = None

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        error: BaseException | None = None
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if status is None:
                # The server answers 500 to an exception before a response; with neither, the
                # client left before its answer was ready.
                status = 500 if error is not None else CLIENT_CLOSED_STATUS
            try:
                self._end(span, scope, state, status, error)
            except Exception:  # a bug in tracing must not fail a request that was answered
                logger.exception("tracing: the span of %s %s", scope["method"], scope["path"])

    def _end(
        self,
        span: ServerSpan,
        scope: Scope,
        state: dict[str, Any],
        status: int,
        error: BaseException | None,
    ) -> None:
        route = route_template(scope, self.included)
        batch_size = state.get(BATCH_SIZE)
        request_id = state.get(REQUEST_ID)
        tenant = state.get(TENANT, ANONYMOUS)  # no API keys: everyone is anonymous
        span.end(
            status=status,
            route=None if route == UNMATCHED_ROUTE else route,
            tenant=tenant if isinstance(tenant, str) else None,
            request_id=request_id if isinstance(request_id, str) else None,
            batch_size=batch_size if isinstance(batch_size, int) else None,
            phases=state.get(PHASES),
            error=error,
        )
